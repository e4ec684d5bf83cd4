"""Training-inference mismatch: how far the rollout engine's log-probs are from the trainer's,
and two corrections that drop what is too far.

The engine (vLLM, SGLang, bf16 kernels) samples from a distribution slightly different from
the one the trainer computes for the same weights. With ``d_t = log p_trainer - log p_engine``
per sampled token (the log importance ratio ``log r_t``):

- :func:`mismatch_metrics`: mean ``|d_t|`` per token, the sequence-level KL of engine against
  trainer (``KL(engine || trainer)`` estimated on the engine's own samples, ``-sum_t d_t`` per
  sequence, averaged over sequences), the largest ``|d_t|`` and the fraction of tokens with
  ``|d_t| > threshold``.
- :func:`icepop_mask`: IcePop's two-sided token masking (Ling Team, "Every Step Evolves:
  Scaling Reinforcement Learning for Trillion-Scale Thinking Model", arXiv:2510.18855): a token
  whose ratio ``r_t = exp(d_t)`` leaves ``[low, high]`` gets no gradient.
- :func:`geometric_rejection`: sequence-level rejection on the geometric mean of the ratios,
  ``exp(mean_t d_t)`` outside ``[low, high]``, with a veto: a sequence any of whose tokens has
  ``r_t < veto`` is rejected whatever its mean (as verl's rollout-correction "geo_mean" mode with
  its veto threshold).

All are detached, work on ``[B, T]`` tensors with a ``[B, T]`` mask of sampled tokens (padding
and multi-turn observation tokens 0) and return masks of the same shape.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightrft.config import at_least


def check_icepop(low: float, high: float, at: str = "") -> None:
    """IcePop's band, ``0 < low < 1 < high`` (``at``: the keys' dotted prefix in the message):
    the one place the rule is written, for :func:`icepop_mask` and the config section."""
    at_least(f"{at}low", low, 0, strict=True)
    if not low < 1 < high:
        raise ValueError(f"{at}low < 1 < {at}high is needed, got {low}, {high}")


def check_geometric(low: float, high: float, veto: float, at: str = "") -> None:
    """Geometric rejection's band, ``0 < low <= 1 <= high``, and ``0 <= veto < 1`` (0: off),
    for :func:`geometric_rejection` and the config section."""
    at_least(f"{at}low", low, 0, strict=True)
    if not low <= 1 <= high:
        raise ValueError(f"{at}low <= 1 <= {at}high is needed, got {low}, {high}")
    at_least(f"{at}veto", veto, 0)
    if not veto < 1:
        raise ValueError(f"{at}veto must be < 1 (0: off), got {veto}")


def _delta(trainer: Tensor, engine: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``d = trainer - engine`` in float64, 0 where masked out, and the boolean mask."""
    if trainer.shape != engine.shape or trainer.shape != mask.shape:
        raise ValueError(
            f"trainer {tuple(trainer.shape)}, engine {tuple(engine.shape)} and mask "
            f"{tuple(mask.shape)} log-probs must have one shape [B, T]"
        )
    valid = mask.bool()
    d = (trainer.double() - engine.double()).masked_fill(~valid, 0.0)
    return d, valid


@torch.no_grad()
def mismatch_metrics(
    trainer: Tensor, engine: Tensor, mask: Tensor, *, threshold: float = 0.1
) -> dict[str, float]:
    """``rollout/mismatch/*``: mean / max ``|log p_trainer - log p_engine|`` per sampled token,
    the mean over sequences of ``KL(engine || trainer) ~ sum_t (log p_engine - log p_trainer)``,
    and the fraction of tokens whose ``|delta|`` exceeds ``threshold``. Zeros when no token is
    sampled."""
    at_least("threshold", threshold, 0, strict=True)
    d, valid = _delta(trainer, engine, mask)
    tokens = int(valid.sum())
    if tokens == 0:
        keys = ("mean_abs_delta", "seq_kl", "max_abs_delta", "frac_beyond_threshold")
        return {f"rollout/mismatch/{k}": 0.0 for k in keys}
    a = d.abs()
    seqs = valid.any(dim=1)  # [B] sequences with at least one sampled token
    seq_kl = (-d).sum(dim=1)[seqs].mean()  # [B] -> mean over sequences
    return {
        "rollout/mismatch/mean_abs_delta": float(a.sum() / tokens),
        "rollout/mismatch/seq_kl": float(seq_kl),
        "rollout/mismatch/max_abs_delta": float(a.max()),
        "rollout/mismatch/frac_beyond_threshold": float(((a > threshold) & valid).sum() / tokens),
    }


@torch.no_grad()
def icepop_mask(
    trainer: Tensor, engine: Tensor, mask: Tensor, *, low: float = 0.5, high: float = 2.0
) -> Tensor:
    """IcePop two-sided token masking: ``mask_t * 1[low <= exp(d_t) <= high]`` as ``[B, T]``
    float. Multiply the per-token loss by it (the masked tokens give no gradient)."""
    check_icepop(low, high)
    d, valid = _delta(trainer, engine, mask)
    keep = (d >= math.log(low)) & (d <= math.log(high)) & valid
    return keep.to(trainer.dtype)


@torch.no_grad()
def geometric_rejection(
    trainer: Tensor,
    engine: Tensor,
    mask: Tensor,
    *,
    low: float = 0.999,
    high: float = 1.001,
    veto: float = 1e-4,
) -> tuple[Tensor, Tensor]:
    """Sequence-level rejection on the geometric-mean ratio ``g = exp(sum_t d_t / n_tokens)``:
    a sequence is kept when ``low <= g <= high`` and (``veto > 0``) no token has
    ``exp(d_t) < veto``. Returns ``(token_mask [B, T] float, kept [B] bool)``; a sequence with
    no sampled token is kept (it carries no loss)."""
    check_geometric(low, high, veto)
    d, valid = _delta(trainer, engine, mask)
    n = valid.sum(dim=1)  # [B]
    log_g = d.sum(dim=1) / n.clamp_min(1)  # [B] log of the geometric mean ratio
    kept = (log_g >= math.log(low)) & (log_g <= math.log(high))
    if veto > 0:
        kept &= ~((d < math.log(veto)) & valid).any(dim=1)
    kept |= n == 0
    return (valid & kept[:, None]).to(trainer.dtype), kept
