"""The rollout side of an RL step: the typed batch of its samples (:class:`RolloutBatch`, with
:func:`pad_rows` and the ``IGNORE`` target id; :mod:`lightrft.rollout.batch`), its micro-batches
(:mod:`lightrft.rollout.micro`), and its metrics and trajectories (:mod:`lightrft.rollout.metrics`)."""

from lightrft.rollout.batch import IGNORE, RolloutBatch, pad_rows

__all__ = ["IGNORE", "RolloutBatch", "pad_rows"]
