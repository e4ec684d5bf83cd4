"""GRPO-family algorithms as small pure functions on tensors.

- :mod:`~lightrft.algorithms.advantages`: GRPO, Dr.GRPO, RLOO, CPGD, REINFORCE++(-baseline),
  GAE; ``ESTIMATORS`` (name -> :class:`Estimator`: function, options, group need) and
  ``compute_advantages`` select them by config name.
- :mod:`~lightrft.algorithms.losses`: ``OBJECTIVES`` (name -> :class:`Objective`: per-token
  loss, defaults, checks), ``aggregate``, ``policy_loss`` (ppo / gspo / gmpo / cpgd,
  dual clip, clip-higher, importance correction), ``value_loss``, entropy bonus and
  high-entropy token selection.
- :mod:`~lightrft.algorithms.kl`: KL estimators (k1, abs, k2, k3, k3+), fixed and adaptive
  coefficient controllers, KL in the reward or in the loss.
- :mod:`~lightrft.algorithms.preference`: offline preference losses (DPO, cDPO, robust DPO, IPO,
  SimPO, ORPO, KTO) on sequence log-probs; ``PREFERENCE_LOSSES`` selects them by config name.
- :mod:`~lightrft.algorithms.shaping`: running reward normalisation, DAPO overlong penalty and
  dynamic sampling.

See docs/algorithms.md for formulas, config keys and papers.
"""

from lightrft.algorithms import advantages, kl, losses, preference, shaping
from lightrft.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    cpgd,
    dr_grpo,
    gae,
    grpo,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    to_token_rewards,
)
from lightrft.algorithms.kl import (
    build_kl_controller,
    kl_in_loss,
    kl_in_reward,
)
from lightrft.algorithms.losses import (
    AGG_MODES,
    OBJECTIVES,
    Objective,
    aggregate,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
    policy_loss,
    tis_weights,
    value_loss,
)
from lightrft.algorithms.shaping import (
    DynamicSamplingAccumulator,
    RunningRewardNormalizer,
    clip_rewards,
    filter_groups,
    overlong_penalty,
)

estimate_kl = kl.estimate

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "OBJECTIVES",
    "Objective",
    "DynamicSamplingAccumulator",
    "RunningRewardNormalizer",
    "advantages",
    "aggregate",
    "build_kl_controller",
    "clip_rewards",
    "compute_advantages",
    "cpgd",
    "dr_grpo",
    "entropy_bonus",
    "entropy_threshold",
    "estimate_kl",
    "filter_groups",
    "gae",
    "grpo",
    "high_entropy_mask",
    "kl",
    "kl_in_loss",
    "kl_in_reward",
    "losses",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "preference",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "shaping",
    "tis_weights",
    "to_token_rewards",
    "value_loss",
]
