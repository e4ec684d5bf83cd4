"""The ``algorithm:`` config section: advantages, the policy loss and every term and trick
around it, declared as typed :class:`~lightrft.config.Section` s next to the functions they
configure, with every rule between their keys (and with the rollout's group size and length).
Any RL recipe on these functions reads its algorithm through :class:`AlgorithmConfig`.

Keys that switch a feature on by their presence (``kl``, ``tis``, ``shaping.overlong``,
``shaping.dynamic_sampling``) default to null; :meth:`AlgorithmConfig.for_rollout` fills in
their defaults once the section is known to be on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, Protocol

from torch import Tensor

from lightrft.algorithms.advantages import check_estimator, check_group_size
from lightrft.algorithms.kl import ALIASES, KINDS, build_kl_controller
from lightrft.algorithms.losses import AGG_MODES, OBJECTIVES, check_objective, lookup
from lightrft.algorithms.mismatch import (
    check_geometric,
    check_icepop,
    geometric_rejection,
    icepop_mask,
    mismatch_metrics,
)
from lightrft.algorithms.shaping import overlong_penalty
from lightrft.config import Section, option, section


class Sampling(Protocol):
    """What the algorithm's rules read of the rollout's sampling (the engine's
    ``SamplingParams`` has it; the algorithms layer does not import the engine)."""

    n: int
    max_tokens: int
    first_token_temperature: float | None
    top_p: float
    top_k: int


@section
class AdvantageConfig(Section):
    """``algorithm.advantage:``: the estimator and the options it takes (docs/algorithms.md)."""

    # Names are checked against the registries when read, not frozen into the schema: a copied
    # recipe may register its own estimator or objective before its config is parsed.
    estimator: str = option(doc="grpo, rloo, reinforce_pp, gae, ... (ESTIMATORS)")
    eps: float | None = option(None, doc="std normalisation epsilon")
    scale: Literal["group", "batch", "none"] | None = option(None, doc="normalise by which std")
    weight: Literal["filter", "std", "none"] | None = option(None, doc="group weighting")
    gamma: float | None = option(None, doc="gae / reinforce_pp discount")
    lam: float | None = option(None, doc="gae lambda")

    def options(self) -> dict[str, Any]:
        """The keys the config sets: the estimator checks they apply to it."""
        return {k: v for k, v in vars(self).items() if v is not None and k != "estimator"}


@section
class PolicyLossConfig(Section):
    """``algorithm.policy_loss:``: the objective (lightrft.algorithms.OBJECTIVES) and its
    aggregation; unset keys take the objective's published defaults."""

    objective: str = option("ppo", doc="ppo, gspo, gmpo, cpgd, ... (OBJECTIVES)")
    clip_low: float | None = option(None, doc="ratio clip below 1")
    clip_high: float | None = option(None, doc="ratio clip above 1 (clip-higher)")
    dual_clip: float | None = option(None, doc="dual-clip bound (> 1)")
    agg: Literal[AGG_MODES] | None = option(None, doc="how token losses aggregate")
    norm_len: int | None = option(None, ge=1, doc="seq_mean_token_sum_norm's divisor")


@section
class TISConfig(Section):
    """``algorithm.tis:``: truncated importance sampling towards the engine's log-probs."""

    mode: Literal["token", "sequence_mask"] | None = option(None, doc="unset: off")
    cap: float | None = option(None, gt=0, doc="the weight cap; default 2")


@section
class IcePopConfig(Section):
    """``algorithm.mismatch.icepop:``: a sampled token whose ratio ``exp(trainer - engine)``
    leaves ``[low, high]`` gets no policy gradient (the section switches it on)."""

    low: float = option(0.5, doc="the band's lower bound (< 1)")
    high: float = option(2.0, doc="the band's upper bound (> 1)")

    def resolve(self, at: str) -> IcePopConfig:
        check_icepop(self.low, self.high, at)
        return self


@section
class GeometricConfig(Section):
    """``algorithm.mismatch.geometric:``: a sequence whose geometric-mean ratio leaves
    ``[low, high]``, or one of whose tokens has a ratio below ``veto``, gets no policy gradient
    (the section switches it on)."""

    low: float = option(0.999, doc="the band's lower bound (<= 1)")
    high: float = option(1.001, doc="the band's upper bound (>= 1)")
    veto: float = option(1e-4, doc="a token ratio below it rejects its sequence; 0: off")

    def resolve(self, at: str) -> GeometricConfig:
        check_geometric(self.low, self.high, self.veto, at)
        return self


@section
class MismatchConfig(Section):
    """``algorithm.mismatch:``: corrections for the engine's log-probs being off the trainer's
    (lightrft.algorithms.mismatch); they narrow the policy loss's tokens, beside ``tis``."""

    icepop: IcePopConfig | None = option(None, doc="")
    geometric: GeometricConfig | None = option(None, doc="")

    def apply(self, trainer: Tensor, engine: Tensor, mask: Tensor):
        """``rollout/mismatch/*`` (with the masked fractions) and the ``[B, T]`` bool tokens the
        corrections keep (None: no correction is on)."""
        metrics, keep, mask = mismatch_metrics(trainer, engine, mask), None, mask.bool()
        if (ice := self.icepop) is not None:
            keep = icepop_mask(trainer, engine, mask, low=ice.low, high=ice.high).bool()
            frac = (mask & ~keep).sum() / mask.sum().clamp_min(1)
            metrics["rollout/mismatch/icepop_masked_frac"] = float(frac)
        if (geo := self.geometric) is not None:
            kept_tokens, kept = geometric_rejection(
                trainer, engine, mask, low=geo.low, high=geo.high, veto=geo.veto
            )
            keep = kept_tokens.bool() if keep is None else keep & kept_tokens.bool()
            seqs = mask.any(dim=1)  # [B]
            frac = (seqs & ~kept).sum() / seqs.sum().clamp_min(1)
            metrics["rollout/mismatch/geometric_rejected_frac"] = float(frac)
        return keep, metrics


@section
class KLConfig(Section):
    """``algorithm.kl:``: a KL to the frozen reference (the section switches it on)."""

    coef: float | None = option(None, doc="the KL coefficient (> 0)")
    estimator: Literal[(*KINDS, *ALIASES)] | None = option(None, doc="default k3")
    placement: Literal["loss", "reward"] | None = option(None, doc="default loss")
    controller: Literal["fixed", "adaptive"] | None = option(None, doc="default fixed")
    target: float | None = option(None, doc="adaptive only")
    horizon: float | None = option(None, doc="adaptive only")


@section
class EntropyConfig(Section):
    """``algorithm.entropy:``: an entropy bonus and high-entropy token selection."""

    coef: float = option(0.0, doc="entropy bonus coefficient")
    top_rho: float | None = option(None, doc="train on the top-rho highest-entropy tokens only")


@section
class OverlongConfig(Section):
    """``algorithm.shaping.overlong:``: DAPO's soft overlong penalty."""

    max_len: int | None = option(None, doc="default rollout.max_tokens")
    buffer: int | None = option(None, doc="tokens before max_len where the penalty ramps up")
    factor: float | None = option(None, doc="the penalty at max_len; default 1")


@section
class DynamicSamplingConfig(Section):
    """``algorithm.shaping.dynamic_sampling:``: draw again until enough informative groups."""

    enabled: bool | None = option(None, doc="default: on when the section is set")
    max_draws: int | None = option(None, ge=1, doc="draws per step at most (default 10)")

    @property
    def draws(self) -> int:
        return 10 if self.max_draws is None else self.max_draws


@section
class ShapingConfig(Section):
    """``algorithm.shaping:``: reward clipping / normalisation, overlong, dynamic sampling."""

    reward_norm: bool = option(False, doc="running reward normalisation")
    reward_clip: float | None = option(None, gt=0, doc="clip rewards to [-c, c]")
    overlong: OverlongConfig = option(default_factory=OverlongConfig, doc="")
    dynamic_sampling: DynamicSamplingConfig = option(default_factory=DynamicSamplingConfig, doc="")

    @property
    def dynamic(self) -> bool:
        ds = self.dynamic_sampling
        return ds.is_set() and ds.enabled is not False


@section
class ValueConfig(Section):
    """``algorithm.value:`` (gae only): the critic's value-loss clip."""

    clip: float | None = option(None, gt=0, doc="default 0.5; `.inf` turns clipping off")


@section
class AlgorithmConfig(Section):
    """``algorithm:``: advantages, the policy loss and every term and trick around it."""

    advantage: AdvantageConfig = option(doc="")
    policy_loss: PolicyLossConfig = option(default_factory=PolicyLossConfig, doc="")
    old_logprobs: Literal["trainer", "engine"] = option("trainer", doc="the ratio's denominator")
    tis: TISConfig = option(default_factory=TISConfig, doc="")
    mismatch: MismatchConfig = option(default_factory=MismatchConfig, doc="")
    kl: KLConfig | None = option(None, doc="")
    entropy: EntropyConfig = option(default_factory=EntropyConfig, doc="")
    value: ValueConfig = option(default_factory=ValueConfig, doc="")
    shaping: ShapingConfig = option(default_factory=ShapingConfig, doc="")

    def for_rollout(self, sampling: Sampling) -> AlgorithmConfig:
        """The section checked against the rollout's sampling (group size ``n``,
        ``max_tokens``, FIRE, top-p / top-k) with every default that depends on it filled in."""
        n, max_tokens = sampling.n, sampling.max_tokens
        check_estimator(
            self.advantage.estimator,
            self.advantage.options(),
            group_size=n,
            key="algorithm.advantage.estimator",
        )
        self._check_sampling_correction(sampling)
        top_rho = self.entropy.top_rho
        if top_rho is not None and not 0 < top_rho <= 1:
            raise ValueError(f"algorithm.entropy.top_rho must be in (0, 1], got {top_rho}")
        return replace(
            self,
            policy_loss=self._policy_loss(max_tokens),
            kl=self._kl(),
            shaping=self._shaping(n, max_tokens),
        )

    @property
    def tis_cap(self) -> float:
        return 2.0 if self.tis.cap is None else float(self.tis.cap)

    @property
    def value_clip(self) -> float:
        return 0.5 if self.value.clip is None else float(self.value.clip)

    def _policy_loss(self, max_tokens: int) -> PolicyLossConfig:
        pl = self.policy_loss
        key = "algorithm.policy_loss.objective"
        defaults = lookup(OBJECTIVES, pl.objective, "policy objective", key).defaults
        agg = pl.agg or defaults["agg"]
        if pl.norm_len is not None and agg != "seq_mean_token_sum_norm":
            raise ValueError(
                f"algorithm.policy_loss.norm_len is used only by agg=seq_mean_token_sum_norm "
                f"(agg is {agg!r}); remove it"
            )
        pl = replace(
            pl,
            clip_low=float(defaults["clip_low"] if pl.clip_low is None else pl.clip_low),
            clip_high=float(defaults["clip_high"] if pl.clip_high is None else pl.clip_high),
            agg=agg,
            # Dr.GRPO divides by a constant: the generation budget, not a per-batch length, so
            # the loss does not depend on how a step is split into micro-batches.
            norm_len=pl.norm_len or (max_tokens if agg == "seq_mean_token_sum_norm" else None),
        )
        check_objective(**vars(pl))  # every key is an argument of policy_loss
        return pl

    def _kl(self) -> KLConfig | None:
        kl = self.kl
        if kl is None or not kl.is_set():
            return None  # no KL and no reference model
        kl = replace(
            kl,
            estimator=kl.estimator or "k3",
            placement=kl.placement or "loss",
            controller=kl.controller or "fixed",
        )
        if kl.coef is None or not kl.coef > 0:
            raise ValueError(
                f"algorithm.kl.coef must be > 0 (got {kl.coef}); remove the algorithm.kl "
                "section to train without a KL and without a reference model"
            )
        if kl.controller == "fixed" and (kl.target is not None or kl.horizon is not None):
            raise ValueError("algorithm.kl.target / horizon apply to controller=adaptive only")
        # The controller's own checks (target, horizon > 0).
        build_kl_controller(kl.controller, kl.coef, target=kl.target, horizon=kl.horizon)
        return replace(kl, coef=float(kl.coef))

    def _check_sampling_correction(self, sampling: Sampling) -> None:
        tis = self.tis
        if tis.mode is None and tis.cap is not None:
            raise ValueError(
                "algorithm.tis.cap is set but algorithm.tis.mode is not: set mode "
                "(token | sequence_mask) or remove the tis section"
            )
        if tis.mode is not None and self.old_logprobs != "trainer":
            raise ValueError(
                "algorithm.tis corrects the engine's log-probs towards the trainer's old "
                "log-probs, so it needs algorithm.old_logprobs=trainer (got engine)"
            )
        if sampling.first_token_temperature is not None and (
            self.old_logprobs == "engine" or tis.mode is not None or self.mismatch.is_set()
        ):
            # The engine reports the first token's log-prob at first_token_temperature, the
            # trainer scores every token at rollout.temperature: the first token's ratio would
            # be wrong.
            raise ValueError(
                "rollout.first_token_temperature (FIRE) makes the engine's first-token log-prob "
                "differ from the trainer's (scored at rollout.temperature), so it cannot be used "
                "with algorithm.old_logprobs=engine, algorithm.tis or algorithm.mismatch; remove "
                "one of them"
            )
        truncated = sampling.top_p < 1 or sampling.top_k > 0
        if truncated and self.old_logprobs == "engine":
            # The engine reports log-probs of the distribution it sampled from, renormalised
            # over the nucleus / top-k; the trainer scores the full distribution. Their ratio is
            # not 1 even on-policy, so every clipped ratio would be biased. TIS is fine: it
            # weights by exactly that behaviour distribution.
            raise ValueError(
                f"algorithm.old_logprobs=engine needs untruncated sampling: rollout.top_p="
                f"{sampling.top_p} / rollout.top_k={sampling.top_k} make the engine report "
                "log-probs of the truncated distribution, which the trainer does not score. "
                "Use algorithm.old_logprobs=trainer (optionally with algorithm.tis), or top_p=1 "
                "and top_k=0"
            )

    def _shaping(self, n: int, max_tokens: int) -> ShapingConfig:
        shaping = self.shaping
        over = shaping.overlong
        if over.is_set():
            if over.buffer is None:
                raise ValueError(
                    "algorithm.shaping.overlong needs buffer (tokens before max_len "
                    "where the penalty ramps up)"
                )
            over = replace(
                over,
                max_len=over.max_len or max_tokens,
                factor=1.0 if over.factor is None else float(over.factor),
            )
            overlong_penalty([0], over.max_len, over.buffer, over.factor)  # its own checks
        ds = shaping.dynamic_sampling
        if ds.is_set() and not shaping.dynamic and ds.max_draws is not None:
            raise ValueError(
                "algorithm.shaping.dynamic_sampling.max_draws is set but dynamic sampling is "
                "disabled"
            )
        if shaping.dynamic:
            check_group_size(n, "dynamic sampling")
        return replace(shaping, overlong=over)
