"""The ``lightrft`` command, modelled on torchtune's ``tune`` (``tune run``-style launches).

    lightrft ls                                   recipes and their configs
    lightrft cp <recipe|config> <dest>            copy one out to edit it
    lightrft cat <config>                         print a config
    lightrft validate [--nproc_per_node N] [--nnodes N] <config> [key=value ...]
        schema + the recipe's build_options for that world size; loads no model
    lightrft run [torchrun flags] <recipe|file.py> --config <config|file.yaml> [key=value ...] [~key]
    lightrft view RUN_DIR [--out FILE] [--steps N] [--samples N] [--max-mib M]   a run's page
    lightrft export CHECKPOINT_DIR --out DIR      a checkpoint as the HF directory final/ is
    lightrft plan --config <config> [--nodes N] [--gpus-per-node G] [--gpu-memory 80GiB] [key=value ...]
        per-GPU memory of each phase of the run, from the model's config.json (no weights)
    lightrft tiny-model --out DIR [--arch ARCH] [--layers N] [--hidden N] [--chat-template T] ...
        ARCH: qwen2 | llama (text), qwen2_vl | qwen2_5_vl | qwen3_vl | llava (with a processor)

Recipes ship inside the package (``lightrft.recipes``) and run by path with ``runpy``; configs ship
as ``lightrft.configs`` data. A config opens with its launch command, ``# lightrft run <recipe>
--config ...``, which is how ``ls`` and ``validate`` know which recipe a config belongs to.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import runpy
import shutil
import sys
from pathlib import Path

# libgomp (the OpenMP runtime of the torch CPU wheel) spins its idle intra-op threads for a while
# before sleeping. On a core shared with another busy process that spinning steals the time the
# other threads wait for, and a tiny-model step slowed 3.6-4.2x beside one CPU-bound process; with
# PASSIVE waits 1.2-1.3x, at a price of 1.4-1.65x on an idle machine for tiny models
# (docs/performance.md, "Busy machines").
# Set before torch loads (the runtime reads it once); torchrun children inherit it; the user's
# own OMP_WAIT_POLICY (ACTIVE on a dedicated box) wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# lightrft.tasks.tiny.CHAT_TEMPLATES' names, spelled out so `--help` does not import torch.
CHAT_TEMPLATE_NAMES = ("chatml", "tools", "compact_tools")


# The torch line pyproject admits (keep the two in step); 2.13 is what vllm 0.32 pins.
TORCH_RANGE = ((2, 11), (2, 14))
_TORCH_FIX = "pip install torch==2.13.0"
_CPU_TORCH_FIX = (
    "pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
)


def torch_problem(version: str, cuda: str | None, has_gpu: bool) -> tuple[str, bool] | None:
    """What is wrong with the installed torch, as ``(one line, fatal)``, or None when it fits:
    a release outside :data:`TORCH_RANGE` is fatal; a CUDA build on a machine without an NVIDIA
    GPU runs (on the CPU) but is gigabytes of CUDA for nothing, so it is a notice."""
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = TORCH_RANGE
    if m is None or not lo <= (int(m[1]), int(m[2])) < hi:
        return (
            f"torch {version} is installed; LightRFT needs torch >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}:"
            f" {_TORCH_FIX}",
            True,
        )
    if cuda and not has_gpu:
        return (
            f"torch {version} is a CUDA {cuda} build but this machine has no NVIDIA GPU (it runs on"
            f" the CPU); the CPU build is much smaller: {_CPU_TORCH_FIX}",
            False,
        )
    return None


def installed_torch() -> tuple[str, str | None] | None:
    """``(version, CUDA version or None)`` of the installed torch, read from its files without
    importing it (an import costs seconds and is what a broken install breaks); None if absent."""
    import importlib.metadata

    try:
        torch = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    vfile = Path(torch.locate_file("torch/version.py"))
    m = re.search(
        r"^cuda\b.*?=\s*['\"]([^'\"]+)['\"]", vfile.read_text() if vfile.is_file() else "", re.M
    )
    return torch.version, m[1] if m else None


def check_torch() -> None:
    """At start-up: one line naming the installed torch and the command that fixes it, instead of
    a traceback from deep inside a kernel. Raises :class:`UsageError` when torch cannot work."""
    found = installed_torch()
    if found is None:
        raise UsageError(f"torch is not installed: {_TORCH_FIX}")
    has_gpu = Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()
    line, fatal = torch_problem(*found, has_gpu=has_gpu) or ("", False)
    if fatal:
        raise UsageError(line)
    if line:
        print(f"lightrft: note: {line}", file=sys.stderr)


class UsageError(Exception):
    """A mistake on the command line (an unknown recipe or config name, a missing file): one
    line on stderr and exit status 2, like argparse's own usage errors and config errors."""


_LAUNCH = re.compile(r"^#\s*(?:lightrft|tune)\s+run\s+(?:--\S+\s+\S+\s+)*(\S+)")


def _package_dir(name: str) -> Path:
    """Where the data package ``lightrft.<name>`` lives: its import location, else the source
    checkout's top-level folder."""
    import importlib.util

    spec = importlib.util.find_spec(f"lightrft.{name}")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / name


def recipes_dir() -> Path:
    return _package_dir("recipes")


def configs_dir() -> Path:
    return _package_dir("configs")


def list_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(recipes_dir().glob("*.py")) if not p.stem.startswith("_")}


def list_configs() -> dict[str, Path]:
    root = configs_dir()
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in sorted(root.rglob("*.yaml"))}


def recipe_of_config(path: Path) -> str | None:
    """The recipe named by a config's launch-command comment (``# lightrft run grpo --config``)."""
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            m = _LAUNCH.match(line.strip())
            if m:
                return Path(m.group(1)).stem
    return None


def resolve_recipe(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".py":
        if not p.is_file():
            raise UsageError(f"recipe file not found: {name}")
        return p.resolve()
    recipes = list_recipes()
    if name not in recipes:
        raise UsageError(f"unknown recipe {name!r}; available: {', '.join(recipes)}")
    return recipes[name]


def resolve_config(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise UsageError(f"config file not found: {name}")
        return p.resolve()
    configs = list_configs()
    if name not in configs:
        import difflib

        close = difflib.get_close_matches(name, list(configs), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UsageError(f"unknown config {name!r}{hint}; see `lightrft ls`")
    return configs[name]


# --------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    by_recipe: dict[str, list[str]] = {name: [] for name in list_recipes()}
    for name, path in list_configs().items():
        by_recipe.setdefault(recipe_of_config(path) or "?", []).append(name)
    width = max([len("RECIPE"), *(len(r) for r in by_recipe)]) + 2
    print(f"{'RECIPE':<{width}}CONFIG")
    for recipe, configs in by_recipe.items():
        for i, c in enumerate(configs or ["-"]):
            print(f"{recipe if i == 0 else '':<{width}}{c}")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    src = {**list_configs(), **list_recipes()}.get(args.name)  # a recipe before a config
    if src is None:
        raise UsageError(f"{args.name!r} is neither a recipe nor a config; see `lightrft ls`")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / src.name
    if dest.exists() and not args.force:
        raise UsageError(f"{dest} exists; pass --force to overwrite")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    print(f"copied {src.name} to {dest}")
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    print(resolve_config(args.config).read_text(), end="")
    return 0


def load_recipe_checks(recipe_path: Path):
    """A recipe's ``(CONFIG_SCHEMA, build_options or None)``, read by importing the file
    without running its main."""
    module = runpy.run_path(str(recipe_path), run_name="lightrft_recipe_schema")
    if "CONFIG_SCHEMA" not in module:
        raise UsageError(f"{recipe_path} defines no CONFIG_SCHEMA")
    return module["CONFIG_SCHEMA"], module.get("build_options")


def _config_and_recipe(args: argparse.Namespace) -> tuple[Path, str]:
    """``--config``'s path and the recipe ``--recipe`` or the config's launch comment names."""
    path = resolve_config(args.config)
    recipe = args.recipe or recipe_of_config(path)
    if recipe is None:
        raise UsageError(f"{path} does not open with `# lightrft run <recipe> ...`; pass --recipe")
    return path, recipe


def checked_config(recipe: str | Path, argv: list[str], world: contextlib.AbstractContextManager):
    """``(cfg, options)``: the recipe-style ``argv`` (``--config PATH key=value ...``) loaded and
    checked as ``recipe`` checks it (schema, then its ``build_options``) under ``world`` (the
    launch's world size). A config error, or a damaged checkpoint a resume check found, is a
    :class:`UsageError`: one line and exit status 2 instead of a failure in every worker."""
    from lightrft.config import UserError, load, split_argv, validate

    try:
        cfg, src = load(*split_argv(argv))
        schema, build_options = load_recipe_checks(resolve_recipe(str(recipe)))
        with world:
            return cfg, validate(cfg, schema=schema, options=build_options, source=src)
    except UserError as e:
        raise UsageError(str(e)) from None


def cmd_validate(args: argparse.Namespace) -> int:
    path, recipe = _config_and_recipe(args)
    # No flag: the environment's WORLD_SIZE stands (a shell inside a torchrun job).
    given = (args.nproc_per_node, args.nnodes) != (None, None)
    world = str((args.nproc_per_node or 1) * (args.nnodes or 1)) if given else ""
    checked_config(recipe, ["--config", str(path), *args.overrides], launch_world_size(world, "1"))
    n = int(world or os.environ.get("WORLD_SIZE") or 1)
    print(f"{path}: valid config for recipe '{recipe}' on {n} process{'es' * (n > 1)}")
    return 0


@contextlib.contextmanager
def launch_world_size(nproc: str, nnodes: str):
    """``WORLD_SIZE`` as the launch will set it (``--nnodes x --nproc_per_node`` when both are
    plain numbers), for the rules that depend on it (asynchronous rollout's 2 processes, mesh and
    sequence-parallel sizes), restored afterwards."""
    old = os.environ.get("WORLD_SIZE")
    if nproc.isdigit() and nnodes.isdigit():
        os.environ["WORLD_SIZE"] = str(int(nproc) * int(nnodes))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = old


def _spellings(names: str) -> set[str]:
    """Each torchrun flag in ``names`` in both spellings (--nproc_per_node, --nproc-per-node)."""
    return {f"--{s}" for name in names.split() for s in (name, name.replace("_", "-"))}


# torchrun flags that take a value; flags given as --flag=value need no table entry.
_TORCHRUN_VALUE_FLAGS = _spellings(
    "nproc_per_node nnodes node_rank rdzv_endpoint rdzv_backend rdzv_id rdzv_conf master_addr "
    "master_port max_restarts monitor_interval start_method log_dir redirects tee local_addr "
    "role local_ranks_filter"
)


# The torchrun flags that choose how a worker starts: given any, `lightrft run` leaves it to them.
_WORKER_START_FLAGS = _spellings("start_method run_path no_python module") | {"-m"}


def _worker_start(given: set[str], cfg) -> list[str]:
    """torchrun flags for how the workers start: a CPU run's workers are forks of this launcher
    (:mod:`lightrft._worker`), which has imported the recipe for its config check, so none
    imports torch and transformers again; a GPU run's are fresh processes (a fork must not
    inherit CUDA state), as are any the user's own flags describe."""
    import torch

    device = str(cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if given & _WORKER_START_FLAGS or not device.startswith("cpu") or sys.platform != "linux":
        return []
    worker = Path(__file__).resolve().parent / "_worker.py"
    return ["--run-path", "--start-method", "fork", str(worker)]


def cmd_run(argv: list[str]) -> int:
    given: dict[str, str] = {}  # each torchrun flag (spelled with '-') and its value
    i = 0  # the torchrun flags and their values are argv[:i]
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        name, eq, value = flag.partition("=")
        if not eq and flag in _TORCHRUN_VALUE_FLAGS:
            if i + 1 >= len(argv):
                raise UsageError(f"{flag} needs a value")
            value = argv[i + 1]
            i += 1
        given[name.replace("_", "-")] = value
        i += 1
    if i >= len(argv):
        raise UsageError(
            "usage: lightrft run [torchrun flags] <recipe> --config <cfg> [key=value ...]"
        )
    recipe = resolve_recipe(argv[i])
    rest = argv[i + 1 :]
    # Resolve a config name to its path; everything else passes through to the recipe.
    for j, a in enumerate(rest):
        if a == "--config" and j + 1 < len(rest):
            rest[j + 1] = str(resolve_config(rest[j + 1]))
        elif a.startswith("--config="):
            rest[j] = "--config=" + str(resolve_config(a.split("=", 1)[1]))
    if i:
        # The config checked once in the launcher, for the world size of the launch
        # (``--nnodes x --nproc_per_node`` when both are plain numbers, else the workers check it).
        nproc, nnodes = given.get("--nproc-per-node") or "1", given.get("--nnodes") or "1"
        cfg, _ = checked_config(recipe, rest, launch_world_size(nproc, nnodes))
        from torch.distributed.run import main as torchrun_main

        torchrun_main([*argv[:i], *_worker_start(set(given), cfg), str(recipe), *rest])
        return 0
    from unittest import mock

    try:
        with mock.patch.object(sys, "argv", [str(recipe), *rest]):  # the recipe reads its argv
            runpy.run_path(str(recipe), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            return e.code if isinstance(e.code, int) else 1
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from lightrft.view import ViewError, write_view

    try:
        path, data = write_view(
            args.run_dir, args.out, steps=args.steps, samples=args.samples, max_mib=args.max_mib
        )
    except ViewError as e:
        raise UsageError(str(e)) from None
    cap = data["cap"]
    print(
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): {len(data['curves'])} charts, "
        f"{cap['shown_samples']} samples of {len(cap['shown_steps'])} steps"
    )
    if cap["no_trajectories"]:
        print(cap["no_trajectories"])
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lightrft.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, trust_remote_code=args.trust_remote_code)
    except ValueError as e:  # not a checkpoint, an older one, a missing file: one line
        raise UsageError(str(e)) from None
    except OSError as e:  # --out under a file, no permission, a full disk: one line
        raise UsageError(
            f"--out {args.out}: {e.strerror or e} ({e.filename or args.out})"
        ) from None
    print(f"exported {args.checkpoint} to {out}")
    return 0


@contextlib.contextmanager
def _planning_for(world: int, device: str):
    """Validate as the recipe would on the planned machine: ``WORLD_SIZE`` is the cluster's and,
    planning for GPUs, CUDA counts as available (the checks of ``device: cuda`` and of CUDA-only
    engines are about the machine the run will have, not this one, as is what it installs)."""
    from unittest import mock

    import torch

    from lightrft.engine.config import planned_elsewhere

    available = (lambda: True) if device == "cuda" else torch.cuda.is_available
    with launch_world_size(str(world), "1"), planned_elsewhere():
        with mock.patch.object(torch.cuda, "is_available", available):
            yield


def cmd_plan(args: argparse.Namespace) -> int:
    from lightrft.training.plan import Cluster, format_plan, inputs_from_options, parse_size, plan

    path, recipe = _config_and_recipe(args)
    if recipe not in ("grpo", "sft", "reward_model"):
        raise UsageError(
            f"the planner knows the grpo, sft and reward_model recipes, not {recipe!r}"
        )
    try:
        cluster = Cluster(args.nodes, args.gpus_per_node, parse_size(args.gpu_memory))
        argv = ["--config", str(path), *args.overrides]
        _, opts = checked_config(recipe, argv, _planning_for(cluster.world, args.device))
        inputs = inputs_from_options(
            opts, recipe=recipe, cluster=cluster, device=args.device, model_config=args.model_config
        )
        result = plan(inputs)
    except ValueError as e:  # a flag, a model.path without a local config.json, or a
        # sequence_parallel the model's heads refuse
        raise UsageError(str(e)) from None
    print(format_plan(result))
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from lightrft.tasks.tiny import make_tiny_model

    sizes = {k: v for k, v in vars(args).items() if k not in ("command", "out")}
    out = make_tiny_model(args.out, **sizes)  # every other option is a keyword of it
    print(f"wrote tiny {args.arch} model to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightrft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list recipes and configs")
    cp = sub.add_parser("cp", help="copy a recipe or config out for editing")
    cp.add_argument("name")
    cp.add_argument("dest")
    cp.add_argument("--force", action="store_true")
    cat = sub.add_parser("cat", help="print a config")
    cat.add_argument("config")
    v = sub.add_parser("validate", help="check a config without loading models")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*")
    v.add_argument("--recipe", help="recipe name, when the config has no launch comment")
    # The launch's world size, as `run` takes it: rules such as asynchronous rollout's 2
    # processes and the mesh and sequence-parallel sizes depend on it.
    v.add_argument("--nproc_per_node", "--nproc-per-node", type=int, metavar="N")
    v.add_argument("--nnodes", type=int, metavar="N")
    sub.add_parser("run", help="run a recipe (torchrun flags before the recipe)", add_help=False)
    vw = sub.add_parser(
        "view",
        help="write one self-contained HTML page of a run: curves and trajectories",
        description="Write one HTML file (no server, nothing fetched) with the run's curves from "
        "metrics.jsonl and its saved trajectories (GRPO's `trajectories: true`; "
        "`trajectory_tokens: true` adds the per-token colouring).",
    )
    vw.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir")
    vw.add_argument("--out", help="the HTML file to write (default RUN_DIR/view.html)")
    vw.add_argument(
        "--steps", type=int, default=20, help="embed the last N step files (default 20)"
    )
    vw.add_argument(
        "--samples",
        type=int,
        default=64,
        help="embed the first N samples of each step (default 64; groups are consecutive)",
    )
    vw.add_argument(
        "--max-mib",
        type=float,
        default=64.0,
        help="and at most this many MiB of samples and media, newest first (default 64)",
    )
    ex = sub.add_parser(
        "export",
        help="write a training checkpoint as the HF directory a run's final/ is",
        description="Turn a checkpoint (<output_dir>/checkpoints/step_N: FSDP2 DCP shards of any "
        "number of ranks, LoRA adapters, DeepSpeed ZeRO-1/2/3 files) into the directory the run's "
        "final/ would be had it stopped at that step: safetensors weights + config.json + "
        "tokenizer or processor (a reward model with its heads; LoRA: the adapter directory, and "
        "DIR_merged beside it with lora.export_merged). Runs in this one process; needs the base "
        "model directory the run started from (named in the checkpoint's meta.json).",
    )
    ex.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a step_N checkpoint directory")
    ex.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    ex.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the base model directory's own code (its config.json auto_map) while "
        "rebuilding the model; never taken from the checkpoint itself",
    )
    pl = sub.add_parser(
        "plan",
        help="per-GPU memory of each phase of a run, before renting the GPUs",
        description="Read a config (checked as the recipe would on the planned cluster) and the "
        "model's config.json (no weights), and print the per-GPU bytes of the rollout, scoring "
        "and training phases; phases over --gpu-memory are flagged with what would fit them. "
        "Formulas and their validation: docs/strategies.md, 'Planning memory'.",
    )
    pl.add_argument("--config", required=True)
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--recipe", help="recipe name, when the config has no launch comment")
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--gpus-per-node", type=int, default=1)
    pl.add_argument("--gpu-memory", default="80GiB", help="per GPU (default 80GiB)")
    pl.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: bf16 compute under FSDP2; cpu: the master dtype (as the CPU runs)",
    )
    pl.add_argument(
        "--model-config",
        help="the model's config.json, when model.path is a hub id with no local copy",
    )
    t = sub.add_parser("tiny-model", help="write a tiny random-init HF model and tokenizer")
    t.add_argument("--out", required=True)
    t.add_argument(
        "--arch",
        default="qwen2",
        choices=["qwen2", "llama", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "qwen2_audio"],
        help="a text causal LM, or a vision- or audio-language model written with its processor",
    )
    # make_tiny_model's sizes and defaults (spelled out: `--help` does not import torch)
    sizes = {"layers": 2, "hidden": 64, "heads": 4, "kv-heads": 2, "intermediate": None}
    for name, default in {**sizes, "max-positions": 1024, "seed": 0}.items():
        t.add_argument(f"--{name}", type=int, default=default)
    t.add_argument("--tie-embeddings", action="store_true")
    t.add_argument(
        "--chat-template",
        default="chatml",
        choices=list(CHAT_TEMPLATE_NAMES),
        help="a text model's chat template: chatml, or one that renders tool schemas (tools) or "
        "names the tools compactly in the system turn (compact_tools)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_torch()
        # `run` forwards its arguments untouched (torchrun flags, --config, overrides).
        if argv and argv[0] == "run":
            return cmd_run(argv[1:])
        args = build_parser().parse_args(argv)
        return globals()[f"cmd_{args.command.replace('-', '_')}"](args)  # cmd_ls ... cmd_tiny_model
    except UsageError as e:
        print(f"lightrft: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
