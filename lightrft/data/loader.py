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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightrft.distributed import even_micro_batches

__all__ = ["ResumableDataLoader", "build_dataloader"]

_EPOCH = "lightrft_epoch"


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
        return {**super().state_dict(), _EPOCH: self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        if _EPOCH in state:
            self.set_epoch(int(state.pop(_EPOCH)))
        super().load_state_dict(state)


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
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size), got rank={rank} world_size={world_size}"
        )
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
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
        persistent_workers=False,
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
