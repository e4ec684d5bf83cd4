"""Advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO, CPGD), REINFORCE++ and GAE.

Conventions shared by every function here:

- ``rewards`` is ``[B]``, ordered as ``B // group_size`` consecutive groups of ``group_size``
  samples of the same prompt (sample ``i`` belongs to group ``i // group_size``).
- ``mask`` is ``[B, T]`` with 1 on response tokens and 0 on padding (any dtype; nonzero = valid).
- Token-level outputs are exactly 0 on padding.
- Everything runs without gradient: advantages are targets, not part of the graph.

``ESTIMATORS`` maps each config name to its function and :func:`compute_advantages` calls any of
them from one signature, returning token-level ``[B, T]`` advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightrft.algorithms.losses import check_mask, check_shape, lookup

WHITEN_EPS = 1e-8


# --------------------------------------------------------------------------- helpers


_NO_GROUP = "; sample at least 2 responses per prompt or use an estimator without groups"


def check_group_size(group_size: Any, what: str, remedy: str = "") -> None:
    """The one rule for a group (group baselines, dynamic sampling): ``group_size``
    (``rollout.n``) is an int >= 2; ``what`` names who needs it in the message."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(
            f"{what} needs a group: group_size (rollout.n) must be an int >= 2, got "
            f"{group_size!r}{remedy}"
        )


def check_rewards(rewards: Tensor, group_size: int, name: str = "rewards") -> Tensor:
    """Validate ``[B]`` rewards grouped by ``group_size``; return them as a float tensor."""
    check_group_size(group_size, "a group baseline", _NO_GROUP + " (reinforce_pp, gae)")
    if rewards.ndim != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{name} has {rewards.numel()} entries, not a multiple of group_size={group_size}; "
            "keep every group whole (B = num_prompts * group_size)"
        )
    rewards = _float(rewards)
    if not bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(rewards)).nonzero().flatten()[:8].tolist()
        raise ValueError(f"{name} contain NaN or inf at sample indices {bad}")
    return rewards


def _spread(adv: Tensor, valid: Tensor) -> Tensor:
    """A ``[B]`` advantage on every valid token of its sample, ``[B, T]`` (0 on padding)."""
    if adv.shape[0] != valid.shape[0]:
        raise ValueError(f"rewards has {adv.shape[0]} entries but mask has {valid.shape[0]} rows")
    return adv.unsqueeze(1) * valid.to(adv.dtype)


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = WHITEN_EPS) -> Tensor:
    """Whiten ``values`` over the valid tokens of the whole batch; 0 on padding.

    ``(x - mean) * rsqrt(var + eps)`` with the masked mean and the unbiased masked variance
    (``n - 1`` in the denominator). With fewer than 2 valid tokens the variance is taken as 0,
    so a single valid token whitens to 0 and an empty mask gives all zeros (never NaN).
    """
    valid = check_mask(mask, values)
    values = _float(values)
    m = valid.to(values.dtype)  # [B, T]
    n = m.sum()
    mean = (values * m).sum() / n.clamp_min(1.0)
    centred = (values - mean) * m  # [B, T]
    var = (centred * centred).sum() / (n - 1.0).clamp_min(1.0)
    return centred * torch.rsqrt(var + eps) * m


def to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar reward ``[B]`` on its last valid token: ``[B, T]``.

    A sequence without valid tokens (zero-length response) gets no reward token at all.
    """
    valid = check_mask(mask)
    if rewards.ndim != 1 or rewards.shape[0] != valid.shape[0]:
        raise ValueError(
            f"rewards must be [B] with B={valid.shape[0]} (mask rows), "
            f"got shape {tuple(rewards.shape)}"
        )
    rewards = _float(rewards)
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)  # [B, T]
    last = torch.where(valid, positions, -1).amax(dim=1)  # [B], -1 when empty
    onehot = positions == last.unsqueeze(1)  # [B, T]
    return torch.where(onehot, rewards.unsqueeze(1), 0.0).to(rewards.dtype)


# --------------------------------------------------------------------------- group estimators


@torch.no_grad()
def grpo(
    rewards: Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    scale: Literal["group", "batch", "none"] = "group",
) -> Tensor:
    """GRPO advantage ``(r - group mean) / (std + eps)`` per sample: ``[B]``.

    ``std`` is the unbiased standard deviation of the sample's group (``scale="group"``,
    DeepSeekMath, Shao et al. 2024, arXiv:2402.03300), of the whole batch's rewards
    (``scale="batch"``; the mean stays per group), or no division at all (``scale="none"``,
    which equals :func:`dr_grpo`). A group of equal rewards gives exactly 0.
    """
    rewards = check_rewards(rewards, group_size)
    groups = rewards.view(-1, group_size)  # [N, G]
    centred = groups - groups.mean(dim=1, keepdim=True)  # [N, G]
    if scale == "group":
        adv = centred / (groups.std(dim=1, unbiased=True, keepdim=True) + eps)
    elif scale == "batch":
        adv = centred / (rewards.std(unbiased=True) + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    # Equal rewards give exactly 0: the mean of equal floats can be off by one ulp, and with
    # eps=0 the division would be 0/0.
    flat = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)  # [N, 1]
    return adv.masked_fill(flat, 0.0).reshape(-1)


@torch.no_grad()
def dr_grpo(rewards: Tensor, group_size: int) -> Tensor:
    """Dr.GRPO advantage ``r - group mean``: ``[B]`` (Liu et al. 2025, arXiv:2503.20783).

    Pair it with the ``seq_mean_token_sum_norm`` aggregation for the full Dr.GRPO objective.
    """
    return grpo(rewards, group_size, scale="none")


@torch.no_grad()
def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantage ``r_i - mean of the other G-1 rewards of its group``: ``[B]``.

    REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).
    Equals ``G / (G - 1) * (r_i - group mean)``, which is how it is computed.
    """
    return dr_grpo(rewards, group_size) * (group_size / (group_size - 1))  # dr_grpo validates


@torch.no_grad()
def cpgd(
    rewards: Tensor,
    group_size: int,
    *,
    weight: Literal["filter", "std", "none"] = "filter",
    eps: float = 1e-6,
) -> Tensor:
    """CPGD advantage: group-mean baseline times a per-prompt weight, ``[B]``.

    CPGD (Liu et al. 2025, "CPGD: Toward Stable Rule-based Reinforcement Learning for
    Language Models", arXiv:2505.12504) optimises ``A * clip(log ratio)`` with the advantage
    ``A(x, y) = w(x) * (r(x, y) - mean_group r)``. The paper discusses the weight ``w(x)``:

    - ``"filter"`` (default, the paper's "clip-filter-like" weight as we read it):
      ``w = num_groups / num_informative_groups`` for every group, where informative groups are
      those whose rewards are not all equal. The batch's gradient then has the scale it would
      have if the zero-advantage prompts had been filtered out, without dropping samples.
      If no group is informative every advantage is 0.
    - ``"std"``: ``w = 1 / (unbiased group std + eps)``, i.e. the GRPO advantage.
    - ``"none"``: ``w = 1``, i.e. the Dr.GRPO advantage.
    """
    if weight in ("std", "none"):
        return grpo(rewards, group_size, eps=eps, scale="group" if weight == "std" else "none")
    if weight != "filter":
        raise ValueError(f"weight must be 'filter', 'std' or 'none', got {weight!r}")
    centred = dr_grpo(rewards, group_size)  # validates
    # A group whose rewards are not all equal has a nonzero centred reward (equal ones give 0).
    informative = centred.view(-1, group_size).ne(0).any(dim=1).sum()
    scale = centred.numel() // group_size / informative.clamp_min(1).to(centred.dtype)
    return centred * scale


# --------------------------------------------------------------------------- token-level estimators


@torch.no_grad()
def reinforce_pp(
    token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): ``(advantages [B, T], returns [B, T])``.

    ``returns`` is the discounted reverse cumulative sum of ``token_rewards`` over each
    sequence's valid tokens (padding is skipped, not counted as a step); ``advantages`` are the
    returns whitened over all valid tokens of the batch (:func:`masked_whiten`). Both are 0 on
    padding. Put the scalar reward on the last token with :func:`to_token_rewards` and, for KL in
    the reward, subtract ``coef * kl`` per token (:func:`lightrft.algorithms.kl.kl_in_reward`).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    # The discounted returns are GAE's raw advantages (and returns) with no values and lam = 1.
    return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma=gamma, lam=1.0)


@torch.no_grad()
def reinforce_pp_baseline(rewards: Tensor, mask: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: ``(advantages [B, T], returns [B, T])``.

    Subtract each group's mean reward, spread the result over every response token of the
    sample (``returns``), then whiten over all valid tokens of the batch (``advantages``).
    """
    valid = check_mask(mask)
    returns = _spread(dr_grpo(rewards, group_size), valid)  # [B, T]; dr_grpo validates
    return masked_whiten(returns, valid), returns


@torch.no_grad()
def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next *valid* token of the same sequence (0 after the last one): padded
    positions are skipped, so interior masked tokens neither bootstrap nor discount.
    Returns ``(advantages, returns)``: ``returns = raw advantages + values``, and the advantages
    whitened over all valid tokens of the batch. Both are 0 on padding.
    """
    valid = check_mask(mask, token_rewards)
    check_shape(values, token_rewards, "values", "token_rewards shape")
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    token_rewards = _float(token_rewards)
    values = values.to(token_rewards.dtype)
    # The reverse recursion over valid tokens only (0 on padding): padding carries the running
    # values through unchanged, so interior masked tokens (e.g. tool outputs) do not count as
    # discount steps.
    b, t = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = token_rewards.new_zeros(b)
    next_adv = token_rewards.new_zeros(b)
    for i in reversed(range(t)):
        v = valid[:, i]
        delta = token_rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(v, a, next_adv)
        next_value = torch.where(v, values[:, i], next_value)
        adv[:, i] = torch.where(v, a, 0.0)
    returns = (adv + values) * valid.to(adv.dtype)
    return masked_whiten(adv, valid), returns


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator of the registry :data:`ESTIMATORS`.

    ``fn``: the pure function. ``kind``: how :func:`compute_advantages` calls it:
    ``"sequence"`` ``fn(scores [B], group_size, **options) -> [B]``, broadcast over the tokens;
    ``"sequence_mask"`` ``fn(scores [B], mask, group_size) -> (adv, returns)``;
    ``"token"`` ``fn(token_rewards, mask, **options)``; ``"value"`` ``fn(token_rewards, values,
    mask, **options)`` (needs a critic). ``options``: the config options it takes (its defaults
    live in the function signature). ``group``: needs ``group_size >= 2`` samples per prompt.
    """

    fn: Callable[..., Tensor | tuple[Tensor, Tensor]]
    kind: Literal["sequence", "sequence_mask", "token", "value"] = "sequence"
    options: frozenset[str] = frozenset()
    group: bool = True


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo, options=frozenset({"eps", "scale"})),
    "dr_grpo": Estimator(dr_grpo),
    "rloo": Estimator(rloo),
    "cpgd": Estimator(cpgd, options=frozenset({"eps", "weight"})),
    "reinforce_pp": Estimator(reinforce_pp, "token", frozenset({"gamma"}), group=False),
    "reinforce_pp_baseline": Estimator(reinforce_pp_baseline, "sequence_mask"),
    "gae": Estimator(gae, "value", frozenset({"gamma", "lam"}), group=False),
}
"""Config name -> :class:`Estimator`. Add an estimator with one entry here."""


def check_estimator(
    estimator: str,
    options: Mapping[str, Any] | None = None,
    *,
    group_size: int | None = None,
    key: str = "",
) -> Estimator:
    """Raise ``ValueError`` for an unknown estimator, an option it does not take, or a group it
    needs and does not have; return its registry entry. Runs on config values, no tensor.
    ``key``: the config key that names the estimator, put in front of the unknown-name message."""
    spec: Estimator = lookup(ESTIMATORS, estimator, "advantage estimator", key)
    unknown = set(options or ()) - spec.options
    if unknown:
        raise ValueError(
            f"advantage estimator {estimator!r} takes options {sorted(spec.options) or 'none'}, "
            f"got unexpected {sorted(unknown)}"
        )
    if spec.group and group_size is not None:
        check_group_size(group_size, f"advantage estimator {estimator!r}", _NO_GROUP)
    return spec


@torch.no_grad()
def compute_advantages(
    estimator: str,
    *,
    mask: Tensor,
    rewards: Tensor | None = None,
    token_rewards: Tensor | None = None,
    values: Tensor | None = None,
    group_size: int | None = None,
    **options: float | str,
) -> tuple[Tensor, Tensor | None]:
    """Run the estimator named ``estimator`` and return ``(advantages [B, T], returns | None)``.

    Inputs: ``rewards [B]`` (scalar per sample) and/or ``token_rewards [B, T]`` (e.g. the reward
    on the last token minus a per-token KL penalty). Sequence-level estimators (grpo, dr_grpo,
    rloo, cpgd, reinforce_pp_baseline) score each sample by ``token_rewards`` summed over valid
    tokens when given, else by ``rewards``, and broadcast their ``[B]`` advantage over the valid
    tokens. Token-level estimators (reinforce_pp, gae) use ``token_rewards``, or ``rewards``
    placed on the last token. ``values [B, T]`` is required by gae. ``options`` go to the
    estimator (``eps``, ``scale``, ``weight``, ``gamma``, ``lam``). ``returns`` is None for the
    group estimators without a return target.
    """
    spec = check_estimator(estimator, options)
    valid = check_mask(mask, token_rewards)
    if rewards is None and token_rewards is None:
        raise ValueError("compute_advantages needs rewards [B] or token_rewards [B, T]")
    fn = spec.fn
    if spec.kind in ("token", "value"):
        if token_rewards is None:
            token_rewards = to_token_rewards(rewards, mask)
        if spec.kind == "value":
            if values is None:
                raise ValueError("advantage estimator 'gae' needs values [B, T] from a critic")
            return fn(token_rewards, values, mask, **options)
        return fn(token_rewards, mask, **options)

    if group_size is None:
        raise ValueError(f"advantage estimator {estimator!r} needs group_size")
    scores = rewards
    if token_rewards is not None:
        scores = (_float(token_rewards) * valid).sum(dim=1)  # [B]
    if spec.kind == "sequence_mask":
        return fn(scores, mask, group_size)
    return _spread(fn(scores, group_size, **options), valid), None
