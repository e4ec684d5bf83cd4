"""A resumable, distributed dataloader (torchdata ``StatefulDataLoader``).

Each rank reads a disjoint shard of a per-epoch seeded permutation (``StatefulDistributedSampler``:
the same permutation on every rank for a given ``seed`` and epoch). ``state_dict()`` records how
far the current epoch got, so a loader restored from it yields exactly the batches the
interrupted one would have yielded. The loop that makes resume exact, epoch boundary included::

    loader.load_state_dict(saved)            # when resuming; `epoch` saved next to it
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:                 # resumed at an epoch's end: no batches, then on
            ...
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightrft.config import at_least
from lightrft.distributed import even_micro_batches

_EPOCH = "lightrft_epoch"
# The saved position's units, so that a resume on another world size can re-derive it.
_BATCH = "lightrft_batch_size"
_WORLD = "lightrft_world_size"


class ResumableDataLoader(StatefulDataLoader):
    """``StatefulDataLoader`` whose state also holds the sampler's epoch; adds ``set_epoch``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: noise, not our bug.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            super().__init__(*args, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle order of ``epoch`` (call before iterating each epoch)."""
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return int(self.sampler.epoch)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            _EPOCH: self.epoch,
            _BATCH: int(self.batch_size),
            _WORLD: int(self.sampler.num_replicas),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = {k: v for k, v in state_dict.items() if k not in (_BATCH, _WORLD)}
        if _EPOCH in state:
            self.set_epoch(int(state.pop(_EPOCH)))
        super().load_state_dict(state)

    def load_resharded(self, states: Sequence[dict[str, Any]], name: str = "dataloader") -> None:
        """Continue from the position that ``states`` (one :meth:`state_dict` per rank of a run
        on ``len(states)`` ranks, in rank order) saved, on this loader's own rank and world size.

        Every rank of a run reads the same per-epoch permutation, rank ``r`` of ``W`` the items
        ``r, r + W, ...``, so after ``k`` batches of ``b`` the ranks together have read its first
        ``k * b * W`` items. That prefix is the position: this rank takes its own items after it
        (``C / M`` into its shard on ``M`` ranks), so no item is skipped or read twice. It must
        be a whole number of this loader's global batches (``batch_size x world``), which holds
        when the global batch is the saved one. A ``ValueError`` (naming ``name``) otherwise.
        """
        if self.num_workers:
            raise ValueError(f"{name}: a loader with worker processes cannot be resharded")
        if not states or any(_BATCH not in s or _WORLD not in s for s in states):
            raise ValueError(
                f"{name}: the checkpoint's loader state lacks its batch size and world size "
                "(saved by an older lightrft): resume with the world size it was saved with"
            )
        world = len(states)
        if any(int(s[_WORLD]) != world for s in states):
            raise ValueError(f"{name}: the saved states are not one per rank of one run")
        positions = {
            (int(s[_EPOCH]), int(s["_num_yielded"]), bool(s["_iterator_finished"])) for s in states
        }
        if len(positions) != 1:
            raise ValueError(
                f"{name}: the saved ranks stopped at different positions {sorted(positions)}; "
                "only a loader whose ranks read in step can be resharded"
            )
        ((epoch, batches, finished),) = positions
        n = len(self.dataset)  # type: ignore[arg-type]
        drop = bool(self.sampler.drop_last)
        saved_shard = n // world if drop else -(-n // world)  # items per rank per epoch
        batch, new_world = int(self.batch_size), int(self.sampler.num_replicas)
        saved_global = int(states[0][_BATCH]) * world
        if saved_global != batch * new_world:
            raise ValueError(
                f"{name}: the checkpoint read {saved_global} items per batch over its {world} "
                f"rank(s) ({states[0][_BATCH]} each), this run {batch * new_world} over "
                f"{new_world} ({batch} each): keep the global batch to resume on another world "
                "size"
            )
        read = saved_shard if finished else min(batches * int(states[0][_BATCH]), saved_shard)
        consumed = read * world  # the permutation's prefix the saved run has read
        start = consumed // new_world
        if not finished and consumed % (batch * new_world):
            raise ValueError(
                f"{name}: the saved position ({consumed} items of epoch {epoch}) is not a whole "
                f"number of this run's batches ({batch} x {new_world} ranks)"
            )
        self.load_state_dict(
            {
                **states[0],
                "_sampler_iter_state": {
                    "samples_yielded": start,
                    "sampler_state": {"yielded": start},
                },
                "_sampler_iter_yielded": start // batch,
                "_num_yielded": start // batch,
                "_iterator_finished": finished,
                _EPOCH: epoch,
            }
        )


def build_dataloader(
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    collate_fn: Callable | None = None,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    num_workers: int = 0,
) -> ResumableDataLoader:
    """A resumable loader over this rank's shard of ``dataset``.

    Args:
        dataset: a map-style dataset.
        batch_size: items per batch on this rank.
        shuffle: reshuffle every epoch (seeded by ``seed`` and the epoch from ``set_epoch``).
        seed: shuffle seed; must be the same on all ranks.
        collate_fn: e.g. :func:`~lightrft.data.pack_or_pad_collator`'s result.
        rank, world_size: this process's shard.
        drop_last: drop the tail that does not divide evenly over ranks and the last incomplete
            batch. Without it, the sampler repeats a few items so that every rank gets the same
            count, which keeps collective ops (FSDP) in step, and the last batch may be short.
        num_workers: worker processes for loading; 0 loads in the main process.
    """
    at_least("batch_size", batch_size, 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size), got rank={rank} world_size={world_size}"
        )
    at_least("num_workers", num_workers, 0)
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("the dataset is empty")
    per_rank = n // world_size if drop_last else -(-n // world_size)
    if drop_last and per_rank < batch_size:
        raise ValueError(
            f"the dataset has {n} items, {per_rank} per rank over world_size={world_size}, fewer "
            f"than batch_size={batch_size} with drop_last=true: no batch would be produced; "
            "lower batch_size or add data"
        )
    sampler = StatefulDistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=num_workers,
    )


def epoch_batches(loader: ResumableDataLoader, epoch: int) -> Iterator[tuple[int, Any]]:
    """``(epoch, batch)``, epoch after epoch from the loader's (resumable) position: each epoch
    re-seeds the shuffle (``set_epoch``) before its first batch is drawn."""
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def step_batches(
    loader: ResumableDataLoader, epoch: int, *, uneven: bool, device: torch.device | None = None
) -> Iterator[tuple[int, list, int]]:
    """``(epoch, micro-batches, how many are real)`` of each optimizer step on this rank (see
    :func:`epoch_batches`), for a loader whose batches are a step's micro-batches
    (:class:`~lightrft.data.StepCollator`). ``uneven``: a token budget makes the counts differ
    across ranks; the ranks with fewer repeat their last one, for the caller to give no weight
    (:func:`~lightrft.distributed.even_micro_batches`)."""
    for epoch_, micro in epoch_batches(loader, epoch):
        if uneven:
            yield (epoch_, *even_micro_batches(micro, device))
        else:
            yield epoch_, micro, len(micro)
