"""What ``lightrft run`` starts each torchrun worker in, on CPU: the recipe run inside a fork of
the launcher (torchrun's ``--run-path --start-method fork``), so a worker begins with the
imports the launcher's config check already paid for instead of importing torch,
transformers and the recipe again (seconds per process; docs/performance.md), and on its own
share of the machine's cores.

    torchrun --run-path --start-method fork lightrft/_worker.py <recipe.py> [recipe args]

torchrun's in-process entry point takes the function's return as the worker's result, and a
``sys.exit`` that unwinds past it leaves the launcher waiting for that result forever: a recipe
ends with ``sys.exit(recipe_main())``, so a clean exit (code 0 or None) returns here, and any
other code leaves the process with that status, as a worker process of its own would.
"""

from __future__ import annotations

import os
import runpy
import sys


def own_cores() -> list[int] | None:
    """Pin this worker to its share of the cores the launcher may use: local rank ``r`` of ``n``
    takes the ``r``-th of ``n`` equal slices (none when there are fewer cores than workers).

    Left to the scheduler, the workers of one machine migrate between its cores (and meet the
    launcher's monitor there), and each move costs them their caches: on the 2-core development
    machine the asynchronous demo's trainer and generator took 32 s pinned against 37 s not
    (docs/performance.md). Returns the cores taken."""
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local_rank < 0 or local_world < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_world
    if share < 1:
        return None
    mine = cores[local_rank * share : (local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    return mine


def run_recipe(recipe: str, *argv: str) -> None:
    # torchrun's own workers run `python -u`: the forked streams are made unbuffered the same way.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(write_through=True)
    # A fresh worker's OpenMP runtime reads the OMP_NUM_THREADS torchrun gives it (1 by default);
    # a fork's was set up in the launcher, before that: apply it as a fresh process would.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    own_cores()
    sys.argv = [recipe, *argv]
    try:
        runpy.run_path(recipe, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


if __name__ == "__main__":
    run_recipe(*sys.argv[1:])
