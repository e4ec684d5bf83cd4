"""Reward shaping before the advantages: running normalisation and clipping, DAPO's overlong
penalty, and DAPO's dynamic sampling (drop uninformative groups, refill the batch).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Generic, TypeVar

import torch
from torch import Tensor

from lightrft.algorithms.advantages import check_group_size, check_rewards
from lightrft.config import at_least

logger = logging.getLogger(__name__)

T = TypeVar("T")


# --------------------------------------------------------------------------- normalisation


def clip_rewards(rewards: Tensor, clip: float) -> Tensor:
    """Clamp rewards to ``[-clip, clip]``."""
    at_least("reward clip", clip, 0, strict=True)
    return rewards.clamp(-clip, clip)


class RunningRewardNormalizer:
    """Normalise rewards by running statistics over every reward seen so far, then clip.

    ``__call__(rewards)`` first merges the batch into the running mean and variance (Welford's
    online algorithm in the batched form of Chan, Golub and LeVeque 1979, in float64), then
    returns ``(r - mean) / (std + eps)`` (or ``r / (std + eps)`` with ``center=False``), clipped
    to ``[-clip, clip]`` when ``clip`` is set. ``std`` is the population standard deviation.
    Before any update the statistics are mean 0, std 1. ``state_dict``/``load_state_dict``
    make it resumable. In data-parallel runs feed it the gathered rewards of all ranks so every
    rank holds the same statistics.
    """

    def __init__(self, *, clip: float | None = None, center: bool = True, eps: float = 1e-8):
        at_least("reward clip", clip, 0, strict=True)  # None: no clipping
        self.clip = clip
        self.center = center
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self._m2 = 0.0

    @property
    def var(self) -> float:
        return self._m2 / self.count if self.count > 0 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    @torch.no_grad()
    def update(self, rewards: Tensor) -> None:
        """Merge a batch of rewards (any shape) into the running statistics."""
        x = rewards.detach().reshape(-1).double()
        n = x.numel()
        if n == 0:
            return
        if not bool(torch.isfinite(x).all()):
            raise ValueError("rewards contain NaN or inf; refusing to update the normaliser")
        batch_mean = float(x.mean())
        batch_m2 = float((x - batch_mean).square().sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self._m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @torch.no_grad()
    def normalize(self, rewards: Tensor) -> Tensor:
        """Normalise (and clip) with the current statistics, without updating them."""
        out = rewards.float() if not rewards.is_floating_point() else rewards
        if self.center:
            out = out - self.mean
        out = out / (self.std + self.eps)
        return out if self.clip is None else clip_rewards(out, self.clip)

    def __call__(self, rewards: Tensor, update: bool = True) -> Tensor:
        if update:
            self.update(rewards)
        return self.normalize(rewards)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self._m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self._m2 = float(state["m2"])


# --------------------------------------------------------------------------- overlong penalty


def overlong_penalty(
    lengths: Tensor | Sequence[int], max_len: int, buffer: int, factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13): ``[B]``.

    0 for responses up to ``max_len - buffer`` tokens, then linear down to ``-factor`` at
    ``max_len`` (and ``-factor`` beyond). Add it to the task reward.
    """
    at_least("max_len", max_len, 0, strict=True)
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer must be in (0, max_len={max_len}], got {buffer}")
    at_least("overlong penalty factor", factor, 0)
    lengths = torch.as_tensor(lengths).to(torch.float32)
    start = max_len - buffer
    return -factor * ((lengths - start) / buffer).clamp(0.0, 1.0)


# --------------------------------------------------------------------------- dynamic sampling


@torch.no_grad()
def filter_groups(metric: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: which groups carry a learning signal, ``[B // group_size]`` bool.

    A group whose ``metric`` (the reward, or e.g. the accuracy) is the same for all its
    samples gives every sample a zero group-relative advantage; it is dropped (False).
    """
    check_group_size(group_size, "dynamic sampling")
    check_rewards(metric, group_size, "metric values")  # [B] in whole groups, finite
    groups = metric.view(-1, group_size)  # [N, G]
    return groups.amax(dim=1) != groups.amin(dim=1)  # [N]


class DynamicSamplingAccumulator(Generic[T]):
    """Collect informative groups over several rollout draws until a train batch is full.

    Usage in a recipe::

        acc = DynamicSamplingAccumulator(target_groups=prompts_per_step, group_size=n,
                                         max_draws=cfg.max_draws)
        while not acc.done:
            samples, rewards = rollout(next(prompt_iter))    # B = prompts * n samples
            acc.add(samples, rewards)
        batch, stats = acc.take()                            # log stats

    ``add`` keeps the groups that :func:`filter_groups` accepts. ``done`` turns True when
    ``target_groups`` groups are held, or after ``max_draws`` draws (``None`` or ``<= 0``: no
    limit). ``take`` returns the first ``target_groups`` groups (surplus groups are dropped,
    they would be off-policy next step) flattened into one list, with metrics; when the limit
    was hit first it returns what there is, logs a warning and reports ``short = 1``. An empty
    list is possible: the recipe skips the update (and the losses return 0 on empty masks).
    """

    def __init__(self, target_groups: int, group_size: int, *, max_draws: int | None = 10):
        if not isinstance(target_groups, int) or target_groups < 1:
            raise ValueError(f"target_groups must be an int >= 1, got {target_groups!r}")
        check_group_size(group_size, "dynamic sampling")
        self.target_groups = target_groups
        self.group_size = group_size
        self.max_draws = max_draws if max_draws is not None and max_draws > 0 else None
        self._reset()

    def _reset(self) -> None:
        self._groups: list[list[T]] = []
        self.draws = 0
        self.groups_seen = 0

    @property
    def num_groups(self) -> int:
        """Informative groups held so far."""
        return len(self._groups)

    @property
    def full(self) -> bool:
        return self.num_groups >= self.target_groups

    @property
    def done(self) -> bool:
        """Full, or the draw limit is reached."""
        return self.full or (self.max_draws is not None and self.draws >= self.max_draws)

    def add(self, samples: Sequence[T], metric: Tensor) -> int:
        """Add one rollout draw (``B`` samples in consecutive groups); return groups kept."""
        if len(samples) != metric.numel():
            raise ValueError(
                f"got {len(samples)} samples but {metric.numel()} metric values; "
                "pass one value per sample"
            )
        keep = filter_groups(metric, self.group_size)  # [N]
        g = self.group_size
        self._groups += [list(samples[i * g : (i + 1) * g]) for i in keep.nonzero()[:, 0].tolist()]
        self.draws += 1
        self.groups_seen += len(keep)
        return int(keep.sum())

    def take(self) -> tuple[list[T], dict[str, float]]:
        """Return up to ``target_groups`` groups as one flat list, plus metrics; then reset."""
        used = self._groups[: self.target_groups]
        short = len(used) < self.target_groups
        metrics = {
            "dynamic_sampling/draws": float(self.draws),
            "dynamic_sampling/groups_seen": float(self.groups_seen),
            "dynamic_sampling/groups_kept": float(self.num_groups),
            "dynamic_sampling/groups_used": float(len(used)),
            "dynamic_sampling/kept_frac": self.num_groups / max(self.groups_seen, 1),
            "dynamic_sampling/short": float(short),
        }
        if short:
            logger.warning(
                "dynamic sampling: %d of %d groups after %d draws (limit %s); "
                "training on the %d informative groups there are",
                len(used),
                self.target_groups,
                self.draws,
                self.max_draws,
                len(used),
            )
        self._reset()
        return [s for group in used for s in group], metrics
