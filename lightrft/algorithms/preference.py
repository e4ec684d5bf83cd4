"""Offline preference losses (the DPO family) on sequence log-probs, as small pure functions.

Every paired loss reads per-pair sequence log-probs ``[B]`` of the chosen and the rejected
response under the policy (and, where it needs one, the frozen reference) and returns
``(loss [B], chosen_rewards [B], rejected_rewards [B])``; the rewards are the implicit ones users
read in TRL's metrics (detached). Sums or length-normalised means are the recipe's choice (the
registry says which each paper uses). Losses are minimised.

- ``dpo``: Rafailov et al. 2023, "Direct Preference Optimization": ``-logsigmoid(beta * h)`` with
  ``h = (pi_c - ref_c) - (pi_r - ref_r)``.
- ``cdpo``: conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"): the labels
  flip with probability ``label_smoothing``, ``-(1-e) logsigmoid(beta h) - e logsigmoid(-beta h)``.
- ``rdpo``: robust DPO (Chowdhury et al. 2024, "Provably Robust DPO"): the unbiased loss under
  label noise ``e``, ``((1-e)(-logsigmoid(beta h)) - e(-logsigmoid(-beta h))) / (1 - 2e)``.
- ``ipo``: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences": ``(h - 1/(2 beta))^2`` (on length-normalised log-probs, as TRL computes it).
- ``simpo``: Meng et al. 2024, "SimPO": reference-free, length-normalised,
  ``-logsigmoid(beta (pi_c - pi_r) - gamma)`` with the target margin ``gamma``.
- ``orpo``: Hong et al. 2024, "ORPO": ``-beta logsigmoid(log odds(c) - log odds(r))`` with
  ``odds(y) = p / (1 - p)`` of the mean token log-prob; the recipe adds the chosen NLL.
- ``kto``: Ethayarajh et al. 2024, "KTO": unpaired, per example ``w_d (1 - sigmoid(beta (r - z)))``
  for a desirable one and ``w_u (1 - sigmoid(beta (z - r)))`` for an undesirable one, with
  ``r = pi - ref`` and ``z`` the detached, non-negative KL estimate of the batch.

``PREFERENCE_LOSSES`` maps config names to :class:`PreferenceLoss` (function, the options it
takes, whether it needs a reference, its length normalisation and NLL defaults); a copied recipe
may add its own entry before its config is read. docs/dpo.md has the formulas and config keys.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightrft.algorithms.losses import lookup
from lightrft.config import Section, at_least, option, section

PairLoss = tuple[Tensor, Tensor, Tensor]


def _margin(
    beta: float, chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor
) -> PairLoss:
    """``h = (pi_c - ref_c) - (pi_r - ref_r)`` and the implicit rewards ``beta (pi - ref)`` of
    the chosen and the rejected responses (detached). ``[B]`` each."""
    c, r = chosen - ref_chosen, rejected - ref_rejected  # [B]
    return c - r, (beta * c).detach(), (beta * r).detach()


def dpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
) -> PairLoss:
    """DPO (Rafailov et al. 2023): ``-logsigmoid(beta * h)``. ``[B]`` each."""
    h, *rewards = _margin(beta, chosen, rejected, ref_chosen, ref_rejected)
    return (-F.logsigmoid(beta * h), *rewards)


def cdpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> PairLoss:
    """Conservative DPO: DPO against labels flipped with probability ``label_smoothing``."""
    h, *rewards = _margin(beta, chosen, rejected, ref_chosen, ref_rejected)
    z, e = beta * h, label_smoothing  # [B], the label noise rate
    return (-(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z), *rewards)


def rdpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> PairLoss:
    """Robust DPO (Chowdhury et al. 2024): unbiased under label noise rate ``label_smoothing``
    (< 0.5); it can be negative."""
    h, *rewards = _margin(beta, chosen, rejected, ref_chosen, ref_rejected)
    z, e = beta * h, label_smoothing  # [B], the label noise rate
    return ((-(1 - e) * F.logsigmoid(z) + e * F.logsigmoid(-z)) / (1 - 2 * e), *rewards)


def ipo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
) -> PairLoss:
    """IPO (Azar et al. 2023): ``(h - 1 / (2 beta))^2``; ``beta`` is the paper's ``tau``."""
    h, *rewards = _margin(beta, chosen, rejected, ref_chosen, ref_rejected)
    return ((h - 1 / (2 * beta)) ** 2, *rewards)


def simpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: None = None,
    ref_rejected: None = None,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> PairLoss:
    """SimPO (Meng et al. 2024): ``-logsigmoid(beta (pi_c - pi_r) - gamma)`` on length-normalised
    log-probs, no reference; ``label_smoothing`` as in cDPO. Rewards: ``beta * pi``."""
    z = beta * (chosen - rejected) - gamma  # [B]
    e = label_smoothing
    loss = -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)  # [B]
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation near 0 (Maechler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: None = None,
    ref_rejected: None = None,
    *,
    beta: float = 0.1,
) -> PairLoss:
    """ORPO's odds-ratio term (Hong et al. 2024): ``-beta logsigmoid(log odds_c - log odds_r)``
    with ``log odds(y) = lp - log(1 - exp(lp))`` of mean token log-probs ``lp < 0``; the NLL of
    the chosen answers (ORPO's other term) is added by the recipe. Rewards: ``beta * lp``."""
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))  # [B]
    loss = -beta * F.logsigmoid(log_odds)  # [B]
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


def kto_loss(
    policy: Tensor,
    ref: Tensor,
    desirable: Tensor,
    kl: Tensor | float = 0.0,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """KTO (Ethayarajh et al. 2024) per example ``[N]`` and its implicit rewards ``[N]``.

    ``policy``, ``ref``: sequence log-probs ``[N]``; ``desirable``: bool ``[N]``; ``kl``: the
    reference point ``z``, the mean log-ratio of mismatched (prompt, completion) pairs, detached
    and clamped at 0 (:func:`lightrft.training.preference.kto_reference_point`)."""
    r = policy - ref  # [N]
    want = desirable.bool()
    loss = torch.where(
        want,
        desirable_weight * (1 - torch.sigmoid(beta * (r - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - r))),
    )  # [N]
    return loss, (beta * r).detach()


@torch.no_grad()
def preference_metrics(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    chosen: Tensor,
    rejected: Tensor,
    *,
    paired: bool = True,
) -> dict[str, Tensor]:
    """Sums and counts of TRL's metrics: ``rewards/chosen``, ``rewards/rejected``,
    ``logps/chosen``, ``logps/rejected`` with ``n/chosen``, ``n/rejected``; for pairs (rows
    aligned) also ``rewards/margins``, ``rewards/accuracies`` and ``n/pairs``. Unpaired (KTO):
    the margin is the difference of the means (:func:`metric_means`). 0-dim tensors."""
    out = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "logps/chosen": chosen.detach().sum(),
        "logps/rejected": rejected.detach().sum(),
        "n/chosen": torch.tensor(float(len(chosen_rewards))),
        "n/rejected": torch.tensor(float(len(rejected_rewards))),
    }
    if paired:
        margins = chosen_rewards - rejected_rewards  # [B]
        out["rewards/margins"] = margins.sum()
        out["rewards/accuracies"] = (margins > 0).float().sum()
        out["n/pairs"] = torch.tensor(float(len(margins)))
    return out


def metric_means(sums: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``prefix + name``: the means of :func:`preference_metrics`' sums (e.g. summed over
    micro-batches and ranks); an unpaired margin is ``rewards/chosen - rewards/rejected``."""
    out = {}
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        out[prefix + name] = sums[name] / max(sums["n/" + name.split("/")[1]], 1.0)
    if "n/pairs" in sums:
        for name in ("rewards/margins", "rewards/accuracies"):
            out[prefix + name] = sums[name] / max(sums["n/pairs"], 1.0)
    else:
        out[prefix + "rewards/margins"] = (
            out[prefix + "rewards/chosen"] - out[prefix + "rewards/rejected"]
        )
    return out


def _check_smoothing(name: str, opts: Mapping[str, Any], lo_open: bool) -> None:
    e = opts.get("label_smoothing")  # unset: the paper's default in the loss's signature
    if e is not None and not ((0 < e if lo_open else 0 <= e) and e < 0.5):
        interval = "(0, 0.5)" if lo_open else "[0, 0.5)"
        raise ValueError(f"loss.label_smoothing must be in {interval} for loss {name!r}, got {e}")


@dataclass(frozen=True)
class PreferenceLoss:
    """One entry of :data:`PREFERENCE_LOSSES`.

    ``fn``: the loss function; ``options``: the ``loss:`` keys it takes besides ``beta`` (unset,
    ``fn``'s signature gives the paper's default); ``reference``: it needs reference log-probs;
    ``paired``: it reads pairs (KTO reads single labelled examples); ``length_normalize``: the
    paper's default (mean token log-prob instead of the sum); ``nll_coef``: the default weight of
    the chosen answers' NLL; ``check(name, opts)`` raises ``ValueError`` on option values the loss
    cannot use (an unset one is ``None``)."""

    fn: Callable[..., Any]
    options: tuple[str, ...] = ()
    reference: bool = True
    paired: bool = True
    length_normalize: bool = False
    nll_coef: float = 0.0
    check: Callable[[str, Mapping[str, Any]], None] | None = None


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "dpo": PreferenceLoss(dpo_loss),
    "cdpo": PreferenceLoss(
        cdpo_loss,
        ("label_smoothing",),
        check=lambda n, o: _check_smoothing(n, o, lo_open=True),
    ),
    "rdpo": PreferenceLoss(
        rdpo_loss,
        ("label_smoothing",),
        check=lambda n, o: _check_smoothing(n, o, lo_open=False),
    ),
    "ipo": PreferenceLoss(ipo_loss, length_normalize=True),
    "simpo": PreferenceLoss(
        simpo_loss,
        ("gamma", "label_smoothing"),
        reference=False,
        length_normalize=True,
        check=lambda n, o: _check_smoothing(n, o, lo_open=False),
    ),
    "orpo": PreferenceLoss(orpo_loss, reference=False, length_normalize=True, nll_coef=1.0),
    "kto": PreferenceLoss(kto_loss, ("desirable_weight", "undesirable_weight"), paired=False),
}
"""Config name -> :class:`PreferenceLoss`. Register a new loss with
``PREFERENCE_LOSSES["mine"] = PreferenceLoss(fn, ...)`` before the config is parsed."""


def check_preference_loss(name: str, beta: float, opts: Mapping[str, Any]) -> PreferenceLoss:
    """Raise ``ValueError`` on a loss name or option values the loss cannot use; return its
    entry. ``opts``: the ``loss:`` keys the config sets (``None``: unset)."""
    spec: PreferenceLoss = lookup(PREFERENCE_LOSSES, name, "preference loss", "loss.type")
    at_least("loss.beta", beta, 0, strict=True)
    stray = [k for k, v in opts.items() if v is not None and k not in spec.options]
    if stray:
        raise ValueError(
            f"loss.{stray[0]} does not apply to loss {name!r} (it takes "
            f"{list(spec.options) or 'beta only'})"
        )
    if spec.check is not None:
        spec.check(name, opts)
    return spec


@section
class ReferenceConfig(Section):
    """``reference:``: the frozen reference (null section: the start model)."""

    path: str | None = option(None, doc="its checkpoint; null: model.path (LoRA: adapters off)")
    precompute: bool = option(False, doc="log-probs of the whole data set once, cached")


@section
class PreferenceLossConfig(Section):
    """``loss:``: the preference loss (PREFERENCE_LOSSES) and its options; unset: its paper's."""

    type: str = option("dpo", doc="dpo, cdpo, rdpo, ipo, simpo, orpo, kto (PREFERENCE_LOSSES)")
    beta: float = option(0.1, doc="the KL strength / temperature; > 0")
    label_smoothing: float | None = option(None, doc="cdpo, rdpo, simpo: label noise rate")
    gamma: float | None = option(None, doc="simpo: the target reward margin")
    desirable_weight: float | None = option(None, doc="kto: weight of desirable examples")
    undesirable_weight: float | None = option(None, doc="kto: weight of undesirable examples")
    length_normalize: bool | None = option(None, doc="mean token log-prob (default: the paper's)")
    nll_coef: float | None = option(None, ge=0, doc="+ coef * chosen NLL (default: orpo 1, else 0)")

    def options(self) -> dict[str, Any]:
        """The loss-specific keys the config sets: the loss's arguments besides ``beta``."""
        keys = ("label_smoothing", "gamma", "desirable_weight", "undesirable_weight")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def check(self, reference: ReferenceConfig | None) -> PreferenceLoss:
        """Refuse, by key, what this loss cannot use: ``beta <= 0``, options of other losses, a
        reference for a reference-free loss (SimPO, ORPO), a precomputed reference for KTO."""
        spec = check_preference_loss(self.type, self.beta, self.options())
        if not spec.reference and reference is not None:
            raise ValueError(
                f"reference: loss.type={self.type} uses no reference model; remove the "
                "reference section"
            )
        if not spec.paired and reference is not None and reference.precompute:
            raise ValueError(
                f"reference.precompute: loss.type={self.type} needs the reference on mismatched "
                "(prompt, response) pairs made per batch; set reference.precompute=false"
            )
        return spec


@section
class PairRuleConfig(Section):
    """``online.pairs:``: which of a prompt's scored samples make its pair (online DPO)."""

    min_margin: float = option(0.0, ge=0, doc="the best's reward exceeds the worst's by more")


def best_worst_pairs(
    rewards: Tensor, groups: Sequence[Any], answers: Sequence[Any], min_margin: float = 0.0
) -> tuple[list[tuple[int, int]], int]:
    """Online DPO's pair rule (OpenRLHF's iterative DPO, best-of-n against worst-of-n): per
    prompt (a run of equal consecutive ``groups`` keys) its best-rewarded sample over its worst
    (the first of ties), if their rewards differ by more than ``min_margin`` and their
    ``answers`` differ. The ``(chosen, rejected)`` row indices of each pair, and how many
    prompts gave no pair."""
    pairs, unpaired, start = [], 0, 0
    for _, run in itertools.groupby(groups):
        end = start + len(list(run))
        r = rewards[start:end]
        best, worst = start + int(r.argmax()), start + int(r.argmin())
        if float(r.max() - r.min()) > min_margin and answers[best] != answers[worst]:
            pairs.append((best, worst))
        else:
            unpaired += 1
        start = end
    return pairs, unpaired
