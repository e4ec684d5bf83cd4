"""Run a test body in N real processes over a gloo process group (CPU FSDP2, weight sync, DCP)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    from lightrft.distributed import destroy

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        destroy(clean=False)  # no barrier: the peer may be stuck or gone
        raise
    destroy()


def run_distributed(fn: Callable, *args, world_size: int = 2) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be a module-level function. An exception in any rank fails the caller with that
    rank's traceback.
    """
    mp.spawn(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


@contextlib.contextmanager
def recipe_instance(recipe: str, cfg) -> Iterator:
    """The recipe file's recipe object for ``cfg`` (a loaded config), built as its
    ``recipe_main`` builds it (options, the run contract), not yet set up; the run is torn down
    on leaving. For tests that reach into a recipe (its model, logger) in this process."""
    import runpy

    from lightrft.cli import recipes_dir
    from lightrft.training.run import training_run

    module = runpy.run_path(str(recipes_dir() / f"{recipe}.py"))
    name = next(k for k in module if k.endswith("Recipe") and isinstance(module[k], type))
    opts = module["build_options"](cfg)
    with training_run(cfg, opts.run) as run:
        yield module[name](cfg, opts, run)
