"""The rollout side of an RL step: the sources a recipe draws its samples from
(:mod:`lightrft.rollout.source`: colocated, dynamic sampling, multi-turn; :mod:`~.partial`;
:mod:`~.remote`: asynchronous; :mod:`~.build`: which one a config asks for; :mod:`~.rules`: the
modes' rules), the typed batch of its samples (:class:`RolloutBatch`, with :func:`pad_rows` and
the ``IGNORE`` target id; :mod:`lightrft.rollout.batch`), its micro-batches
(:mod:`lightrft.rollout.micro`), and its metrics and trajectories (:mod:`lightrft.rollout.metrics`)."""

from lightrft.rollout.batch import IGNORE, RolloutBatch, pad_rows

__all__ = ["IGNORE", "RolloutBatch", "pad_rows"]
