"""KL to the reference policy: per-token estimators, coefficient controllers, and the two ways
to apply it (as a per-token reward penalty before the advantages, or as a loss term).

Estimators follow Schulman, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html),
with samples drawn from the current policy: ``log r = ref - logp``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightrft.algorithms.advantages import to_token_rewards
from lightrft.algorithms.losses import LOG_RATIO_CLAMP, aggregate, check_shape, lookup, upcast
from lightrft.config import at_least

KINDS = ("k1", "abs", "k2", "k3", "k3+")
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's names for the same estimators."""

_CLAMP_K3 = 10.0


def estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(current || reference): ``[B, T]`` (unmasked; aggregate with a mask).

    - ``k1``: ``logp - ref`` (unbiased, high variance, can be negative).
    - ``abs``: ``|logp - ref|``.
    - ``k2``: ``0.5 * (logp - ref)^2`` (low variance, biased).
    - ``k3``: with ``d = clamp(ref - logp, -20, 20)``, ``clamp(exp(d) - d - 1, -10, 10)``
      (unbiased, non-negative; verl's ``low_var_kl``, GRPO's KL loss).
    - ``k3+``: the value of k3 with the gradient of k2 (unbiased value, the k2 gradient is the
      correct gradient of the KL for on-policy samples).

    ``kl``, ``mse`` and ``low_var_kl`` are accepted as aliases of k1, k2 and k3.
    """
    kind = ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ValueError(
            f"unknown KL estimator {kind!r}; choose one of {list(KINDS)} "
            f"(or the aliases {list(ALIASES)})"
        )
    check_shape(ref_logprobs, logprobs, "ref_logprobs", "logprobs")
    logprobs = upcast(logprobs)
    ref = ref_logprobs.to(logprobs.dtype)
    diff = logprobs - ref  # [B, T]
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    k2 = 0.5 * diff.square()
    if kind == "k2":
        return k2
    d = (ref - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = (d.exp() - d - 1.0).clamp(-_CLAMP_K3, _CLAMP_K3)
    if kind == "k3":
        return k3
    return k2 + (k3 - k2).detach()  # k3+


def kl_in_reward(
    rewards: Tensor, kl: Tensor, mask: Tensor, coef: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL as a per-token reward penalty: ``(token_rewards [B, T], metrics)``.

    ``token_rewards = reward on the last valid token - coef * kl`` on every valid token (0 on
    padding); ``rewards`` may be ``[B]`` (placed on the last token) or already ``[B, T]``.
    ``kl`` is detached: a reward carries no gradient. Feed the result to the advantage
    estimator (``compute_advantages(..., token_rewards=...)``) as in InstructGPT / OpenRLHF.
    Metrics: ``kl`` (mean over sequences of the per-sequence token mean; the quantity to pass to
    ``AdaptiveKLController.update``) and ``kl_coef``.
    """
    valid = mask != 0
    check_shape(kl, mask, "kl", "mask")
    kl = torch.where(valid, kl.detach(), 0.0)
    if rewards.ndim == 1:
        token_rewards = to_token_rewards(rewards, mask)
    elif rewards.shape == mask.shape:
        token_rewards = torch.where(valid, rewards, 0.0)
    else:
        raise ValueError(f"rewards must be [B] or [B, T], got {tuple(rewards.shape)}")
    token_rewards = token_rewards.to(kl.dtype) - coef * kl
    return token_rewards, _metrics(kl, mask, coef)


def kl_in_loss(
    kl: Tensor,
    mask: Tensor,
    coef: float,
    *,
    agg: str = "token_mean",
    norm_len: int | float | None = None,
    num_tokens: float | int | Tensor | None = None,
    num_seqs: float | int | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL as a loss term: ``(coef * aggregate(kl, mask, agg), metrics)`` (GRPO's KL loss).

    Use the same ``agg`` and normaliser counts as the policy loss so that both terms scale
    alike under gradient accumulation. Metrics as in :func:`kl_in_reward`.
    """
    term = coef * aggregate(
        kl, mask, agg, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs
    )
    with torch.no_grad():
        return term, _metrics(kl.detach(), mask, coef)


def _metrics(kl: Tensor, mask: Tensor, coef: float) -> dict[str, Tensor]:
    return {
        "kl": aggregate(kl, mask, "seq_mean_token_mean"),
        "kl_coef": torch.tensor(float(coef), device=kl.device),
    }


# --------------------------------------------------------------------------- controllers


class _Controller:
    """What both controllers share: ``value``, and a state that is their float attributes."""

    coef: float

    @property
    def value(self) -> float:
        """verl's name for ``coef``."""
        return self.coef

    def state_dict(self) -> dict[str, float]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, float]) -> None:
        for key in vars(self):
            setattr(self, key, float(state[key]))


class FixedKLController(_Controller):
    """A constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, coef: float) -> None:
        at_least("kl coef", coef, 0)
        self.coef = float(coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController(_Controller):
    """Proportional KL controller (Ziegler et al. 2019, arXiv:1909.08593, section 2.2).

    ``update(current_kl, n_steps)``: ``coef *= 1 + clip(current / target - 1, -0.2, 0.2) *
    n_steps / horizon``, steering the measured KL towards ``target``. ``n_steps`` is the number
    of samples since the last update (verl passes the batch size) and ``horizon`` the time
    scale: an update with ``n_steps == horizon`` changes the coefficient by at most 20%.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        at_least("init_coef", init_coef, 0)
        at_least("target KL", target, 0, strict=True)
        at_least("horizon", horizon, 0, strict=True)
        self.coef = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def build_kl_controller(
    kind: Literal["fixed", "adaptive"],
    coef: float,
    *,
    target: float | None = None,
    horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Make the controller named by the config (``fixed`` or ``adaptive``)."""
    if lookup(KL_CONTROLLERS, kind, "KL controller") is FixedKLController:
        return FixedKLController(coef)
    if target is None or horizon is None:
        raise ValueError("an adaptive KL controller needs target and horizon")
    return AdaptiveKLController(coef, target, horizon)
