"""Run a test body in N real processes over a gloo process group (CPU FSDP2, weight sync, DCP)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    import faulthandler

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
    faulthandler.enable()  # a crash in native code (SIGSEGV) prints where each thread was
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        destroy(clean=False)  # no barrier: the peer may be stuck or gone
        raise
    destroy()
    # The body passed and the group is gone: leave without interpreter finalization. A spawned
    # worker otherwise runs every native library's exit-time destructors, with gloo's threads
    # still winding down; CI once saw rank 1 of a passing 2-process test die by SIGSEGV (not
    # reproduced in 30 runs here). A crash inside the body still fails, with faulthandler's
    # traceback of every thread.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, *args, world_size: int = 2) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be a module-level function. An exception in any rank fails the caller with that
    rank's traceback.
    """
    mp.spawn(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def build_recipe(recipe: str, cfg):
    """The recipe file's recipe object for ``cfg`` (a loaded config), built as its
    ``recipe_main`` builds it (options, then the run contract: output directory, process group,
    seed, prepare steps), not yet set up. For tests that reach into a recipe (its model, its
    logger) in this process; the test harness leaves the process group."""
    import runpy

    from lightrft.cli import recipes_dir
    from lightrft.training.run import TrainingRun

    module = runpy.run_path(str(recipes_dir() / f"{recipe}.py"))
    name = next(k for k, v in module.items() if k.endswith("Recipe") and isinstance(v, type))
    opts = module["build_options"](cfg)
    return module[name](cfg, opts, TrainingRun(cfg, opts.run))
