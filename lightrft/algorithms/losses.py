"""Policy and value losses on ``[B, T]`` tensors, loss aggregation, importance correction,
entropy bonus and high-entropy token selection.

Every function is a pure function of tensors (no module state), so the fused linear log-prob
kernel can compose with it: log-probs in, ``(loss, metrics)`` out. Losses are minimised.
``metrics`` values are detached 0-dim tensors (no host sync); the recipe reduces and logs them.

Masks are ``[B, T]`` with nonzero on response tokens. Whatever sits at padded positions
(garbage log-probs, NaN) never reaches the loss value: padding is selected out, not multiplied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightrft.config import at_least

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
TIS_MODES = ("token", "sequence_mask")

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: finite in fp32 and bf16
_LOW_PRECISION = (torch.float16, torch.bfloat16)

Number = float | int | Tensor


# --------------------------------------------------------------------------- helpers


def upcast(x: Tensor) -> Tensor:
    """Loss math in at least fp32: ratios of bf16 log-probs are too coarse to clip."""
    return x.float() if x.dtype in _LOW_PRECISION or not x.is_floating_point() else x


def check_mask(mask: Tensor, like: Tensor | None = None) -> Tensor:
    """The valid (nonzero) tokens of a ``[B, T]`` mask as bool, refusing another shape than
    ``like``'s when given (the one mask rule of the losses and the advantage estimators)."""
    if mask.ndim != 2 or (like is not None and like.shape != mask.shape):
        want = "" if like is None else f" with the shape of the inputs {tuple(like.shape)}"
        raise ValueError(f"mask must be [B, T]{want}, got mask shape {tuple(mask.shape)}")
    return mask != 0


def check_shape(t: Tensor, like: Tensor, name: str, what: str) -> None:
    if t.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must match {what} {tuple(like.shape)}")


def _denominator(value: Number, like: Tensor) -> Tensor | float:
    """A user-given count as a divisor that never divides by zero (0 / tiny = 0, never NaN)."""
    tiny = torch.finfo(like.dtype).tiny
    if isinstance(value, Tensor):
        return value.to(device=like.device, dtype=like.dtype).clamp_min(tiny)
    if value < 0:
        raise ValueError(f"a normaliser count must be >= 0, got {value}")
    return max(float(value), tiny)


def _zero_padding(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, 0.0)


def _masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    m = valid.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def _masked_extreme(x: Tensor, valid: Tensor, fill: float) -> Tensor:
    """Min (``fill=inf``) or max (``fill=-inf``) over valid entries; ``fill`` if there are none."""
    flat = torch.where(valid, x, fill).reshape(-1)
    flat = torch.cat([flat, flat.new_full((1,), fill)])  # amin/amax reject empty tensors
    return flat.amin() if fill > 0 else flat.amax()


# --------------------------------------------------------------------------- aggregation


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    norm_len: int | float | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
) -> Tensor:
    """Reduce a per-token ``loss_mat [B, T]`` over the valid tokens of ``mask`` to a scalar.

    Modes:

    - ``token_mean``: sum over valid tokens / number of valid tokens (DAPO, Yu et al. 2025,
      arXiv:2503.14476). Every token weighs the same.
    - ``seq_mean_token_mean``: mean over tokens within each sequence, then mean over the
      sequences that have at least one valid token (original GRPO).
    - ``seq_mean_token_sum``: sum over tokens, mean over non-empty sequences.
    - ``seq_mean_token_sum_norm``: sum over tokens divided by the constant ``norm_len``
      (default ``T``), mean over non-empty sequences (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783).

    Gradient accumulation and data parallelism: by default the denominators are this
    micro-batch's own counts. To make the sum of micro-batch gradients equal the gradient of
    one big batch, pass the global counts: ``num_tokens`` (valid tokens of the whole step, for
    ``token_mean``) or ``num_seqs`` (non-empty sequences of the whole step, for the seq modes),
    and *sum* (do not average) the micro-batch losses. Under FSDP/DDP, whose gradient reduce
    averages over ``world_size`` ranks, pass ``global_count / world_size``. Empty masks give 0.
    """
    valid = check_mask(mask, loss_mat)
    masked = _zero_padding(loss_mat, valid)
    per_seq = valid.sum(dim=1).to(loss_mat.dtype)  # [B] tokens per sequence
    if mode == "token_mean":
        total, count, given = masked.sum(), valid.sum(), num_tokens
    elif mode == "seq_mean_token_mean":
        seq_loss = masked.sum(dim=1) / per_seq.clamp_min(1.0)  # [B]
    elif mode == "seq_mean_token_sum":
        seq_loss = masked.sum(dim=1)
    elif mode == "seq_mean_token_sum_norm":
        length = loss_mat.shape[1] if norm_len is None else norm_len
        if not length > 0:
            raise ValueError(f"norm_len must be > 0 (the constant Dr.GRPO divisor), got {norm_len}")
        seq_loss = masked.sum(dim=1) / float(length)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {list(AGG_MODES)}")
    if mode != "token_mean":
        # Empty sequences contribute 0 to the sum and are not counted.
        total, count, given = seq_loss.sum(), (per_seq > 0).sum(), num_seqs
    if given is None:
        return total / count.clamp_min(1).to(loss_mat.dtype)
    return total / _denominator(given, loss_mat)


# --------------------------------------------------------------------------- importance correction


@torch.no_grad()
def tis_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: Literal["token", "sequence_mask"] = "token",
    cap: float = 2.0,
) -> Tensor:
    """Importance weights ``pi_old / pi_rollout`` correcting rollout/trainer mismatch: ``[B, T]``.

    The rollout engine (vLLM, bf16 kernels) samples from a slightly different distribution than
    the trainer computes. Weights are detached and 0 on padding.

    - ``"token"``: truncated IS per token, ``min(exp(old - rollout), cap)`` (Yao et al. 2025,
      "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").
    - ``"sequence_mask"``: sequence-level masked IS. ``rho = exp(sum_t (old - rollout))`` over the
      sequence's valid tokens; weight ``rho`` on every token when ``rho <= cap``, else 0 (the
      whole sequence is dropped) (Seq-MIS; Yao, Liu et al. 2025, "When Speed Kills Stability").
    """
    if mode not in TIS_MODES:
        raise ValueError(f"tis mode must be one of {list(TIS_MODES)}, got {mode!r}")
    at_least("tis cap", cap, 0, strict=True)
    old = upcast(old_logprobs)
    valid = check_mask(mask, old)
    check_shape(rollout_logprobs, old, "rollout_logprobs", "log-probs")
    m = valid.to(old.dtype)
    log_ratio = _zero_padding(old - rollout_logprobs.to(old.dtype), valid)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T], 0 on padding
    log_cap = math.log(cap)
    if mode == "token":
        return log_ratio.clamp(max=log_cap).exp() * m
    seq = log_ratio.sum(dim=1, keepdim=True)  # [B, 1] log rho
    weight = torch.where(seq <= log_cap, seq.clamp(max=log_cap).exp(), 0.0)  # [B, 1]
    return weight * m  # [B, T]


# --------------------------------------------------------------------------- policy loss


def _clip_flags(adv: Tensor, x: Tensor, low: Number, high: Number) -> dict[str, Tensor]:
    """Where the lower clip bound binds (A < 0 and ``x < low``) and where the upper one does
    (A > 0 and ``x > high``); bool ``[B, T]``."""
    return {"low": (adv < 0) & (x < low), "high": (adv > 0) & (x > high)}


def _check_ratio_clip(
    name: str, clip_low: float, clip_high: float, dual_clip: float | None, agg: str
) -> None:
    """Checks of the ratio objectives (ppo, gspo, cpgd): the ratio floor 1 - clip_low > 0."""
    if clip_low >= 1:
        raise ValueError(
            f"clip_low must be < 1 for objective {name!r} (the ratio floor is 1 - clip_low), "
            f"got {clip_low}"
        )


def _check_gmpo(name: str, clip_low: float, clip_high: float, dual_clip: float | None, agg: str):
    if agg != "seq_mean_token_mean":
        raise ValueError(
            f"objective 'gmpo' is a per-sequence loss and aggregates 'seq_mean_token_mean', "
            f"got agg={agg!r}"
        )


def _ppo(logprobs, old, log_ratio, adv, valid, *, clip_low, clip_high, dual_clip):
    """PPO's pessimistic per-token loss ``max(-A r, -A clip(r))`` on ``r = exp(log_ratio)``,
    with optional dual clip."""
    ratio = log_ratio.exp()
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    r = ratio.detach()
    flags = _clip_flags(adv, r, 1.0 - clip_low, 1.0 + clip_high)
    if dual_clip is not None:
        # Dual clip (Ye et al. 2020, arXiv:1912.09729): a negative-advantage token whose ratio
        # exploded can cost at most -A * c, so one bad sample cannot dominate the batch.
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
        flags["dual"] = (adv < 0) & (r > dual_clip)
    return loss, ratio, flags


def _gspo(logprobs, old, log_ratio, adv, valid, **clips):
    n_tok = valid.sum(dim=1).to(logprobs.dtype)  # [B]
    with torch.no_grad():
        raw = torch.where(valid, logprobs - old, 0.0)
        seq_log_ratio = raw.sum(dim=1, keepdim=True) / n_tok.clamp_min(1.0).unsqueeze(1)
        seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, 1]
    token_log_ratio = seq_log_ratio + logprobs - logprobs.detach()  # [B, T], value log s
    return _ppo(logprobs, old, token_log_ratio, adv, valid, **clips)  # clipped like ppo


def _gmpo(logprobs, old, log_ratio, adv, valid, *, clip_low, clip_high, dual_clip):
    m = valid.to(logprobs.dtype)
    n_tok = m.sum(dim=1)  # [B]
    positive = adv >= 0
    clipped = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = torch.where(
        positive, torch.minimum(log_ratio, clipped), torch.maximum(log_ratio, clipped)
    )  # [B, T]
    seq_log = torch.where(valid, pessimistic, 0.0).sum(dim=1) / n_tok.clamp_min(1.0)  # [B]
    seq_ratio = seq_log.exp()  # [B]
    adv_seq = torch.where(valid, adv, 0.0).sum(dim=1) / n_tok.clamp_min(1.0)  # [B]
    seq_loss = -adv_seq * seq_ratio  # [B]
    # Every token carries its sequence's loss, so seq_mean_token_mean (token mean, then
    # mean over non-empty sequences) returns the mean of seq_loss over sequences.
    loss_mat = seq_loss.unsqueeze(1) * m  # [B, T]
    ratio = seq_ratio.unsqueeze(1).expand_as(logprobs)
    return loss_mat, ratio, _clip_flags(adv, log_ratio.detach(), -clip_low, clip_high)


def _cpgd(logprobs, old, log_ratio, adv, valid, *, clip_low, clip_high, dual_clip):
    lower = old + math.log1p(-clip_low)
    upper = old + math.log1p(clip_high)
    clipped_logp = torch.where(
        adv > 0, torch.minimum(logprobs, upper), torch.maximum(logprobs, lower)
    )
    flags = _clip_flags(adv, logprobs.detach(), lower, upper)
    return -adv * clipped_logp, log_ratio.exp(), flags


@dataclass(frozen=True)
class Objective:
    """One policy objective of the registry :data:`OBJECTIVES`.

    ``fn(logprobs, old, log_ratio, adv, valid, *, clip_low, clip_high, dual_clip)`` returns the
    per-token loss ``[B, T]`` (before aggregation and importance weights), the ratio it clips
    ``[B, T]`` (for the metrics) and its clip flags ``{"low", "high"[, "dual"]}`` (bool
    ``[B, T]``). ``defaults``: the paper's ``clip_low``, ``clip_high`` and ``agg``.
    ``check(name, clip_low, clip_high, dual_clip, agg)`` raises ``ValueError`` on settings the
    objective cannot use; ``dual_clip`` says whether it accepts a dual clip. ``per_token``: each
    token's loss depends on its own log-prob only (not on other tokens' through a sequence
    ratio), so the gradient of a chunk of tokens is known from their log-probs alone and the
    fused kernel can compute the LM-head gradients in its forward (``grad_hint``).
    """

    fn: Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]]
    defaults: Mapping[str, float | str]
    check: Callable[[str, float, float, float | None, str], None] | None = None
    dual_clip: bool = False
    per_token: bool = False


OBJECTIVES: dict[str, Objective] = {
    "ppo": Objective(
        _ppo,
        {"clip_low": 0.2, "clip_high": 0.2, "agg": "token_mean"},
        _check_ratio_clip,
        dual_clip=True,
        per_token=True,
    ),
    "gspo": Objective(
        _gspo,
        {"clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq_mean_token_mean"},
        _check_ratio_clip,
        dual_clip=True,
    ),
    "gmpo": Objective(
        _gmpo, {"clip_low": 0.4, "clip_high": 0.4, "agg": "seq_mean_token_mean"}, _check_gmpo
    ),
    "cpgd": Objective(
        _cpgd,
        {"clip_low": 0.2, "clip_high": 0.2, "agg": "token_mean"},
        _check_ratio_clip,
        per_token=True,
    ),
}
"""Config name -> :class:`Objective`. Add an objective with one entry here (or, in a copied
recipe, ``OBJECTIVES["mine"] = Objective(...)`` before the config is parsed)."""


def lookup(registry: Mapping[str, Any], name: str, what: str, key: str = "") -> Any:
    """The entry ``name`` of ``registry`` (the objectives, estimators or preference losses), or
    ``ValueError`` naming ``what`` it is (``key``: the config key that names it, put in front of
    the message)."""
    if name not in registry:
        raise ValueError(
            f"{key + ': ' if key else ''}unknown {what} {name!r}; choose one of {list(registry)}"
        )
    return registry[name]


def check_objective(
    objective: str,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str | None = None,
    norm_len: int | float | None = None,
) -> str:
    """Raise ``ValueError`` on settings ``objective`` cannot use; return the aggregation mode
    (``agg``, or the objective's default when None). Runs on config values, no tensor."""
    spec: Objective = lookup(OBJECTIVES, objective, "policy objective")
    agg = spec.defaults["agg"] if agg is None else agg  # an unknown mode: aggregate's error
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None:
        if not spec.dual_clip:
            dual = [n for n, o in OBJECTIVES.items() if o.dual_clip]
            raise ValueError(f"dual_clip applies to the ratio objectives {dual}, not {objective!r}")
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (a cap on the ratio), got {dual_clip}")
    if spec.check is not None:
        spec.check(objective, clip_low, clip_high, dual_clip, agg)
    return agg


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    objective: Literal["ppo", "gspo", "gmpo", "cpgd"] = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str | None = None,
    norm_len: int | float | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_mode: Literal["token", "sequence_mask"] = "token",
    tis_cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss of the GRPO family: ``(scalar loss, metrics)``.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy (grad).
        old_logprobs: ``[B, T]`` log-probs under the policy that produced the batch; ``None``
            means on-policy (``logprobs.detach()``).
        advantages: ``[B]`` (one per sequence) or ``[B, T]``.
        mask: ``[B, T]``, nonzero on response tokens.
        objective: ``ppo`` | ``gspo`` | ``gmpo`` | ``cpgd`` (see below).
        clip_low, clip_high: the clip range; ``clip_high > clip_low`` is DAPO's clip-higher.
        dual_clip: ``c > 1`` caps the loss of negative-advantage tokens at ``-A c`` (ppo, gspo).
        agg: aggregation mode (:func:`aggregate`); ``None`` takes the objective's default
            (``token_mean``; ``seq_mean_token_mean`` for gspo and gmpo). gmpo is defined per
            sequence and accepts only ``seq_mean_token_mean``.
        norm_len, num_tokens, num_seqs: passed to :func:`aggregate`.
        rollout_logprobs: ``[B, T]`` engine log-probs; when given, the per-token loss is
            multiplied by :func:`tis_weights` ``(old_logprobs, rollout_logprobs, mode=tis_mode,
            cap=tis_cap)``.

    Objectives, with ``r = exp(logprobs - old_logprobs)`` (log-ratio clamped to +-20):

    - ``ppo`` (Schulman et al. 2017, arXiv:1707.06347): ``max(-A r, -A clip(r, 1-lo, 1+hi))``.
    - ``gspo`` (Zheng et al. 2025, arXiv:2507.18071): the sequence ratio
      ``s = exp(masked mean of the log-ratio)`` enters each token as
      ``exp(sg(log s) + logprobs - sg(logprobs))`` (value ``s``, gradient of the token's own
      log-prob), clipped like ppo. Use the paper's tiny range (3e-4 / 4e-4). Per-token
      advantages or importance weights scale each token's gradient individually (GSPO-token,
      as in verl).
    - ``gmpo`` (Zhao et al. 2025, arXiv:2507.20673): each token log-ratio is clipped to
      ``[-lo, hi]`` in log space on the pessimistic side chosen by the sign of its advantage
      (A >= 0: ``min(l, clip(l))``; A < 0: ``max(l, clip(l))``); the sequence ratio is
      ``exp(masked mean of the clipped log-ratios)``; loss = mean over non-empty sequences of
      ``-A_seq * ratio``, with ``A_seq`` the masked mean of the sequence's advantages.
    - ``cpgd`` (Liu et al. 2025, arXiv:2505.12504): ``-A * clip(logprobs)``, clipped only on the
      side chosen by the sign of A: ``min(logprobs, old + log(1+hi))`` for A > 0 and
      ``max(logprobs, old + log(1-lo))`` for A < 0. The value differs from the paper's
      log-ratio form ``-A * clip(log r)`` by the constant ``-A * old_logprobs`` (same gradient).
      CPGD's policy-drift term is a KL to the old policy: add it with
      ``kl.kl_in_loss(kl.estimate(logprobs, old_logprobs, "k3"), mask, coef)``.

    Metrics (token-level over this micro-batch's valid tokens): ``clip_frac_low`` (A < 0 and the
    lower bound binds), ``clip_frac_high`` (A > 0 and the upper bound binds), ``clip_frac``
    (their sum), ``clip_frac_dual``, ``approx_kl`` (k3 estimate of KL(old || current):
    ``mean(r - 1 - log r)``), ``ratio_mean/min/max`` of the ratio the objective clips (the
    token ratio for ppo/cpgd, the sequence ratio for gspo/gmpo; 1 when the mask is empty), and
    with importance correction ``tis_weight_mean`` and ``tis_frac_capped`` (tokens truncated at
    the cap, or tokens of dropped sequences).
    """
    clips = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
    agg = check_objective(objective, agg=agg, **clips)

    logprobs = upcast(logprobs)
    valid = check_mask(mask, logprobs)
    # Zero the padding first: its value never matters, and a NaN there would otherwise come
    # back as a NaN gradient (0 * NaN) through exp and the products below.
    logprobs = _zero_padding(logprobs, valid)
    if old_logprobs is None:
        old = logprobs.detach()
    else:
        check_shape(old_logprobs, logprobs, "old_logprobs", "logprobs")
        old = _zero_padding(old_logprobs.detach().to(logprobs.dtype), valid)
    adv = advantages.detach().to(logprobs.dtype)
    if adv.ndim == 1 and adv.shape[0] == logprobs.shape[0]:
        adv = adv.unsqueeze(1).expand_as(logprobs)  # [B, T]
    elif adv.shape != logprobs.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] matching log-probs {tuple(logprobs.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    adv = _zero_padding(adv, valid)  # [B, T]
    log_ratio = (logprobs - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]

    loss_mat, ratio, flags = OBJECTIVES[objective].fn(logprobs, old, log_ratio, adv, valid, **clips)

    metrics: dict[str, Tensor] = {}
    if rollout_logprobs is not None:
        weights = tis_weights(old, rollout_logprobs, mask, mode=tis_mode, cap=tis_cap)
        loss_mat = loss_mat * weights
        with torch.no_grad():
            # Truncated at the cap (token), or of a dropped sequence (sequence_mask).
            capped = valid & ((weights >= tis_cap) if tis_mode == "token" else (weights == 0))
            metrics["tis_weight_mean"] = _masked_mean(weights, valid)
            metrics["tis_frac_capped"] = _masked_mean(capped.to(logprobs.dtype), valid)

    loss = aggregate(
        loss_mat, mask, agg, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs
    )
    with torch.no_grad():
        ratio, log_ratio = ratio.detach(), log_ratio.detach()
        dtype = ratio.dtype
        low = _masked_mean(flags["low"].to(dtype), valid)
        high = _masked_mean(flags["high"].to(dtype), valid)
        dual = flags.get("dual")
        any_valid = valid.any()
        one = torch.ones((), dtype=dtype, device=ratio.device)
        metrics |= {
            "clip_frac": low + high,
            "clip_frac_low": low,
            "clip_frac_high": high,
            "clip_frac_dual": _masked_mean(dual.to(dtype), valid)
            if dual is not None
            else 0.0 * low,
            "approx_kl": _masked_mean(log_ratio.exp() - 1.0 - log_ratio, valid),
            "ratio_mean": torch.where(any_valid, _masked_mean(ratio, valid), one),
            "ratio_min": torch.where(any_valid, _masked_extreme(ratio, valid, math.inf), one),
            "ratio_max": torch.where(any_valid, _masked_extreme(ratio, valid, -math.inf), one),
        }
    return loss, metrics


# --------------------------------------------------------------------------- value loss


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.5,
    agg: str = "token_mean",
    norm_len: int | float | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ``0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))``.

    The PPO critic loss with value clipping (as in OpenAI baselines' PPO2); ``clip=None``
    gives the plain squared error. Metrics: ``value_clip_frac`` (tokens where the clipped term
    is the larger one), ``value_mean``, ``value_error`` (mean squared error, unclipped).
    """
    values = upcast(values)
    valid = check_mask(mask, values)
    for name, t in (("old_values", old_values), ("returns", returns)):
        check_shape(t, values, name, "values")
    values = _zero_padding(values, valid)
    old = _zero_padding(old_values.detach().to(values.dtype), valid)
    target = _zero_padding(returns.detach().to(values.dtype), valid)
    if clip is None:
        clip = math.inf  # clip(v) = v: the max of two equal errors, the plain squared error
    elif not clip > 0:
        raise ValueError(f"value clip must be > 0 or None, got {clip}")
    err = (values - target).square()  # [B, T]
    clipped_err = (torch.clamp(values, old - clip, old + clip) - target).square()
    loss_mat = torch.maximum(err, clipped_err)
    clipped_frac_flags = clipped_err.detach() > err.detach()
    loss = 0.5 * aggregate(
        loss_mat, mask, agg, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs
    )
    with torch.no_grad():
        metrics = {
            "value_clip_frac": _masked_mean(clipped_frac_flags.to(values.dtype), valid),
            "value_mean": _masked_mean(values.detach(), valid),
            "value_error": _masked_mean(err.detach(), valid),
        }
    return loss, metrics


# --------------------------------------------------------------------------- entropy


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    coef: float,
    *,
    agg: str = "token_mean",
    norm_len: int | float | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Entropy bonus as a loss term: ``(-coef * agg(entropy), {"entropy": token mean})``.

    Add the returned term to the loss; a positive ``coef`` rewards high entropy (more
    exploration), as verl's ``entropy_coeff`` and OpenRLHF's ``entropy_loss_coef`` do.
    ``entropy`` is the per-token entropy ``[B, T]`` of the current policy (with grad).
    """
    entropy = upcast(entropy)
    valid = check_mask(mask, entropy)
    entropy = _zero_padding(entropy, valid)
    term = -coef * aggregate(
        entropy, mask, agg, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs
    )
    with torch.no_grad():
        metrics = {"entropy": _masked_mean(entropy.detach(), valid)}
    return term, metrics


@torch.no_grad()
def entropy_threshold(entropy: Tensor, mask: Tensor, rho: float = 0.2) -> Tensor:
    """The entropy of the ``ceil(rho * n)``-th highest of the ``n`` valid tokens (0-dim).

    The batch quantile of "Beyond the 80/20 Rule" (Wang et al. 2025, arXiv:2506.01939).
    Returns ``+inf`` when the mask is empty (so nothing is selected).
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho must be in (0, 1], the kept fraction of tokens, got {rho}")
    valid = check_mask(mask, entropy)
    values = entropy.detach()[valid].float()  # [n]
    n = values.numel()
    if n == 0:
        return torch.tensor(math.inf, device=entropy.device)
    keep = max(1, math.ceil(rho * n - 1e-9))
    return values.kthvalue(n - keep + 1).values


@torch.no_grad()
def high_entropy_mask(entropy: Tensor, mask: Tensor, rho: float = 0.2) -> Tensor:
    """Keep only the valid tokens whose entropy is in the top ``rho`` fraction of the batch.

    Returns a bool ``[B, T]`` mask: valid and ``entropy >= entropy_threshold(...)``. Ties at the
    threshold are all kept, so slightly more than ``rho`` may survive. Use it as the loss mask
    of :func:`policy_loss` (Wang et al. 2025 train on the top 20% only). Compute it over the
    whole batch that should share one quantile.
    """
    threshold = entropy_threshold(entropy, mask, rho)
    return (mask != 0) & (entropy.detach().float() >= threshold)
