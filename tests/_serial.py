"""Several 2-rank test bodies in one process group: one spawn of the ranks instead of one each.

Starting the gloo ranks (spawned interpreters importing torch, transformers and lightrft) is most
of a tiny 2-rank run on 2 cores; tests whose bodies need no process group of their own share one
start-up through :func:`each` (with ``_dist.run_distributed``), usually in a module fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def each(rank: int, world_size: int, calls: Sequence[tuple[Callable, tuple]]) -> None:
    """``fn(rank, world_size, *args)`` for each ``(fn, args)`` in turn (module-level ``fn``s);
    the ranks meet at a barrier between two calls."""
    import torch.distributed as dist

    for i, (fn, args) in enumerate(calls):
        if i:
            dist.barrier()
        fn(rank, world_size, *args)
