"""The rollout batch: what one RL step knows about its samples, as padded tensors
(:class:`RolloutBatch`), with :func:`pad_rows` and the ``IGNORE`` target id."""

from lightrft.rollout.batch import IGNORE, RolloutBatch, pad_rows

__all__ = ["IGNORE", "RolloutBatch", "pad_rows"]
