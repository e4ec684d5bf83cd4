"""What ``lightrft run`` starts each torchrun worker in, on CPU: the recipe run inside a fork of
the launcher (torchrun's ``--run-path --start-method fork``), so a worker begins with the
imports the launcher's config check already paid for instead of importing torch,
transformers and the recipe again (seconds per process; docs/performance.md).

    torchrun --run-path --start-method fork lightrft/_worker.py <recipe.py> [recipe args]

torchrun's in-process entry point takes the function's return as the worker's result, and a
``sys.exit`` that unwinds past it leaves the launcher waiting for that result forever: a recipe
ends with ``sys.exit(recipe_main())``, so a clean exit (code 0 or None) returns here, and any
other code leaves the process with that status, as a worker process of its own would.
"""

from __future__ import annotations

import runpy
import sys


def run_recipe(recipe: str, *argv: str) -> None:
    # torchrun's own workers run `python -u`: the forked streams are made unbuffered the same way.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(write_through=True)
    sys.argv = [recipe, *argv]
    try:
        runpy.run_path(recipe, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


if __name__ == "__main__":
    run_recipe(*sys.argv[1:])
