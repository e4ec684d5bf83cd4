"""Resumable training checkpoints on ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout under ``<output_dir>/checkpoints/``::

    step_000010/            one complete checkpoint
      .metadata, *.distcp   DCP shards: models, optimizers, LR schedulers (resharded on load)
      rank_00000.json       per-rank state: dataloader positions, RNG states, ``extra`` (JSON,
      rank_00000.safetensors  tensors and arrays beside it: loading never unpickles)
      deepspeed.<name>/     a DeepSpeed engine's own model + optimizer files (strategy: deepspeed)
      config.json           the run's resolved config (compared on resume)
      meta.json             written last, before the rename: step, world size, names
    step_000020.tmp/        a save in progress (or one that crashed): never loaded
    latest                  the name of the newest complete checkpoint ("step_000020")

A save writes into ``step_N.tmp/``, waits for every rank, then rank 0 renames the directory to
``step_N/`` and replaces ``latest`` atomically (write a temp file, ``os.replace``). A crash at any
point before the rename leaves only a ``.tmp`` directory behind, which loading ignores, so the last
good checkpoint stays usable.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from lightrft.config import UserError, at_least
from lightrft.distributed import all_gather_objects, barrier, is_main
from lightrft.models.export import replace_dir
from lightrft.models.lora import has_adapters
from lightrft.training.optim import is_deepspeed_engine
from lightrft.training.resume import ConfigChange, check_resume_config
from lightrft.training.safe_state import (
    DamagedStateError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_state,
    read_dcp_metadata,
    save_state,
    stored_alike,
    write_atomic,
)

STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
META = "meta.json"
CONFIG = "config.json"
DEFAULT_NAME = "model"
# meta.json's "format": 2 added "export" (what rebuilds the trained model on one process for
# `lightrft export`); checkpoints without the key are format 1.
FORMAT = 2


@dataclass
class CheckpointState:
    """What :meth:`Checkpointer.load` hands back besides the objects it restored in place."""

    step: int
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rng: dict[str, Any] = field(default_factory=dict, repr=False)
    config_changes: list[ConfigChange] = field(default_factory=list)

    def restore_rng(self) -> None:
        """Set this rank's RNG states to the saved ones (again).

        Creating a ``DataLoader`` iterator draws from the global torch RNG; a recipe that builds
        its iterator after :meth:`Checkpointer.load` calls this afterwards to line up with the
        uninterrupted run.
        """
        set_rng_state(self.rng)


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP calls without a process group, without its warning about it."""
    # DCP warns on every call without a process group; one process is a supported mode here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _named(*given: Any) -> dict[str, dict[str, Any]]:
    """Each of ``given`` (the ``models``, ``optimizers``, ``schedulers`` and ``dataloaders``: the
    objects a checkpoint lists by kind) as a dict name -> object under its kind: ``None`` -> {},
    a mapping -> a dict, a single object -> ``{"model": obj}``."""
    named = {}
    for what, obj in zip(("models", "optimizers", "schedulers", "dataloaders"), given, strict=True):
        if obj is None:
            named[what] = {}
        elif isinstance(obj, Mapping):
            named[what] = dict(obj)
        elif isinstance(obj, (list, tuple)):
            raise ValueError(f"{what}: pass one object or a dict name -> object, not a {type(obj)}")
        else:
            named[what] = {DEFAULT_NAME: obj}
    return named


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed (damaged, from another model, an odd pointer): the
    message names the file or checkpoint and the way out. Not a ``ValueError``, so a config
    check that meets one does not blame the config file."""


def _warn(message: str) -> None:
    if is_main():
        print(f"resume: warning: {message}", flush=True)


def _one_line(e: BaseException, *, last: bool = False) -> str:
    """``e``'s type and the first (or ``last``) line of its message, which may be empty."""
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[-1 if last else 0][:300]}"


@contextmanager
def _reading(f: Path) -> Iterator[None]:
    """Read checkpoint file ``f``: any failure becomes a :class:`CheckpointError` naming it, but a
    refused format (a planted pickle) is not mere damage and is raised as is."""
    try:
        yield
    except DamagedStateError as e:  # names the file itself
        raise CheckpointError(str(e)) from None
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a truncated or garbage file
        raise CheckpointError(f"{f} is damaged ({_one_line(e)})") from None


def _read_json_object(f: Path) -> dict[str, Any] | None:
    """The JSON object in file ``f`` (None when absent: a checkpoint saved without a config has
    no ``config.json``); a :class:`CheckpointError` naming it when it is not UTF-8 JSON holding
    an object."""
    if not f.is_file():
        return None
    with _reading(f):
        obj = json.loads(f.read_bytes().decode("utf-8"))
    if not isinstance(obj, dict):
        raise CheckpointError(f"{f} is damaged (not a JSON object)")
    return obj


def check_readable(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read every small file of checkpoint ``path`` and size-check its shards and DeepSpeed
    files before anything is loaded; its ``meta.json`` dict and every saved rank's state (what
    :meth:`Checkpointer.load` restores, so it is read once), or a :class:`CheckpointError`
    naming the damaged file."""
    meta = _read_json_object(path / META) or {}  # a dict with an integer step, or not ours
    if not isinstance(meta.get("step"), int):
        raise CheckpointError(
            f"{path / META} is damaged (not a checkpoint record with an integer step)"
        )
    _read_json_object(path / CONFIG)
    md_file = path / ".metadata"
    if md_file.is_file() or any(path.glob("*.distcp")):
        with _reading(md_file), open(md_file, "rb") as f:
            md = read_dcp_metadata(f, md_file)
        # Every DCP shard named in ``.metadata`` is at least as long as the data it must hold:
        # by file name, each file's furthest end first (the one a truncated file fails on).
        storage = (getattr(md, "storage_data", None) or {}).values()
        for info in sorted(storage, key=lambda i: (i.relative_path, -i.offset - i.length)):
            f, end = path / info.relative_path, info.offset + info.length
            size = f.stat().st_size if f.is_file() else -1
            if size < end:
                got = "missing" if size < 0 else f"{size} bytes, {end} needed"
                raise CheckpointError(f"{f} is damaged (truncated: {got})")
    # Every DeepSpeed file (``deepspeed.<model>/**/*.pt``, torch.save's zip archives) opens as a
    # zip whose members all lie inside the file: a truncated one has lost its central directory
    # (read from the end, so this costs no full read).
    for f in sorted(path.glob("deepspeed.*/**/*.pt")):
        with _reading(f), zipfile.ZipFile(f) as z:
            size = f.stat().st_size
            if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                raise zipfile.BadZipFile("a member runs past the end of the file")
    states = []
    for r in range(int(meta.get("world_size", 1))):
        with _reading(path / f"rank_{r:05d}.safetensors"):
            states.append(load_state(path / f"rank_{r:05d}"))
    return meta, states


def _load_failed(path: Path, e: CheckpointException) -> Exception:
    """DCP's wrapped failure as one line: another model's shapes, or a damaged file."""
    # The first rank's own exception inside DCP's ``CheckpointException`` (a BaseException that
    # ``except Exception`` would miss); ``e`` itself when it wraps nothing usable.
    failures = [exc for exc, _trace in e.failures.values()]
    inner = next((x for x in failures if isinstance(x, (UnsafeCheckpointError, OSError))), e)
    if isinstance(inner, UnsafeCheckpointError):
        return inner
    for exc in failures:
        if "size mismatch" in str(exc).lower():
            return CheckpointError(
                f"checkpoint {path} is from a different model ({_one_line(exc)}): resume with "
                "the model it was trained from, or start a new run (resume=false, another "
                "output_dir)"
            )
    return CheckpointError(
        f"checkpoint {path} is damaged and cannot be loaded ({_one_line(inner)})"
    )


# ---------------------------------------------------------------------------------------------
# RNG state (per rank)


def rng_state() -> dict[str, Any]:
    """The RNG states of python, numpy, torch CPU and the current CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (parts absent here or there are skipped)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------
# The DCP part: models + optimizers + schedulers as one Stateful per model name


class _ModelState:
    """DCP ``Stateful`` for one model and (optionally) its optimizer.

    ``get_state_dict`` / ``set_state_dict`` give FQN-keyed, DTensor-sharded model and optimizer
    states, so FSDP2 shards (and plain tensors) round-trip and may even reshard across world sizes.
    A model saved with its optimizer keeps only its trainable parameters (frozen ones, e.g. the
    base weights under LoRA adapters, come back from the model's own files).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model = model
        self.optimizers = [] if optimizer is None else [optimizer]  # none: an empty "optim"
        frozen_out = optimizer is not None
        # The DCP load already failed on any trainable key the checkpoint lacks; the frozen
        # ones are absent on purpose, so the final copy into the model is not strict.
        self.options = StateDictOptions(ignore_frozen_params=frozen_out, strict=not frozen_out)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=self.options,
        )


def _app_state(
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Stateful],
) -> dict[str, Any]:
    unknown = sorted(set(optimizers) - set(models))
    if unknown:
        raise ValueError(
            f"optimizers {unknown} have no model of the same name; models: "
            f"{sorted(models)} (name each optimizer after the model it updates)"
        )
    state: dict[str, Any] = {}
    for name, model in models.items():
        if is_deepspeed_engine(model):  # saved by the engine itself, optimizer included
            if name in optimizers:
                raise ValueError(
                    f"model {name!r} is a DeepSpeed engine, which checkpoints its own optimizer: "
                    "pass the engine alone"
                )
            continue
        state[f"model.{name}"] = _ModelState(model, optimizers.get(name))
    for name, sched in schedulers.items():  # the same state on every rank: DCP saves it as is
        state[f"scheduler.{name}"] = sched  # a DCP ``Stateful`` itself
    return state


# ---------------------------------------------------------------------------------------------


class Checkpointer:
    """Save and resume training state under ``<output_dir>/checkpoints``.

    Call every method on every rank (they are collective). Works in a single process without a
    process group and with any number of ranks; the directory must be shared by all ranks.

    Args:
        output_dir: the run's output directory; checkpoints go to ``output_dir/checkpoints``.
        keep_last: keep the newest ``keep_last`` checkpoints and delete older ones
            (``None`` keeps all).
        every_n_steps: :meth:`should_save` is true every this many steps (``None``: never;
            the recipe may still call :meth:`save` whenever it likes).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        every_n_steps: int | None = None,
    ):
        at_least("keep_last", keep_last, 1)  # None: keep all
        at_least("every_n_steps", every_n_steps, 1)
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.every_n_steps = every_n_steps

    # -- queries ----------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True when ``step`` (count of optimizer steps done) is a multiple of ``every_n_steps``."""
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0

    def list_checkpoints(self) -> list[Path]:
        """Complete checkpoints (renamed, with ``meta.json``), oldest first."""
        found = [
            (int(m.group(1)), p)
            for p in self.root.glob("step_*")
            if (m := STEP_DIR.match(p.name)) and (p / META).is_file()  # a file in a directory
        ]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names; the newest complete one if the pointer is stale.

        The pointer must hold a plain ``step_N`` name: anything else (a path, ``..``, bytes
        that are not text) is ignored with a warning naming the pointer file."""
        pointer = self.root / LATEST
        if pointer.is_file():
            try:
                name = pointer.read_bytes().decode("utf-8").strip()
            except (OSError, UnicodeDecodeError):
                name = None
            if name is None or not STEP_DIR.match(name):
                _warn(
                    f"{pointer} does not hold a plain step_N name ({name!r}); ignored, the newest "
                    "complete checkpoint in this directory is used"
                )
            elif (self.root / name / META).is_file():
                return self.root / name
        complete = self.list_checkpoints()
        return complete[-1] if complete else None

    def latest_readable(self) -> tuple[Path, dict[str, Any], list[dict[str, Any]]] | None:
        """:meth:`latest` when it is readable (:func:`check_readable`), else the newest older
        complete checkpoint that is, with what :func:`check_readable` read of it; each damaged
        one skipped is reported. ``None``: none."""
        first = self.latest()
        if first is None:
            return None
        problems = []
        for p in dict.fromkeys([first, *reversed(self.list_checkpoints())]):  # first, then older
            try:
                meta, states = check_readable(p)
            except CheckpointError as e:
                _warn(f"checkpoint {p} is damaged: {e}; skipped")
                problems.append(str(e))
                continue
            if p != first:
                _warn(f"resuming from {p}, the newest complete and readable checkpoint")
            return p, meta, states
        raise CheckpointError(
            f"every checkpoint in {self.root} is damaged (newest: {problems[0]}); start a new "
            "run (overwrite=true or another output_dir)"
        )

    def none_to_resume(self) -> ValueError:
        """What ``resume=true`` without a complete checkpoint here raises (the one message)."""
        return ValueError(
            f"resume=true but no checkpoint found in {self.root} (no complete step_* directory); "
            "point output_dir at the run to continue, or start without resume (a run stopped "
            "before its first checkpoint starts over with overwrite=true)"
        )

    # -- save -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        models: nn.Module | Mapping[str, nn.Module],
        optimizers: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
        schedulers: Stateful | Mapping[str, Stateful] | None = None,
        dataloaders: Stateful | Mapping[str, Stateful] | None = None,
        extra: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        export: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write a checkpoint of ``step`` and return its directory (collective).

        ``config``: the run's resolved config (a plain dict, e.g.
        ``OmegaConf.to_container(cfg, resolve=True)``), stored as ``config.json`` so that a
        resume can compare it with its own (:meth:`load`'s ``config``).

        ``export``: what rebuilds the trained model on one process and writes it as the run's
        ``final/`` would be (:class:`lightrft.training.export.ExportSpec` as JSON), stored in
        ``meta.json`` for ``lightrft export``.

        ``models`` / ``optimizers`` / ``schedulers``: one object or a dict name -> object; an
        optimizer is stored with the model of the same name (a single one goes with a single
        model). ``dataloaders`` (e.g. torchdata ``StatefulDataLoader``), the RNG states and
        ``extra`` (a dict of JSON-able values, tuples, tensors or numpy arrays: epoch, KL controller, reward normaliser, ...) are saved per
        rank, since they may differ between ranks.
        """
        at_least("step", step, 0)
        given = _named(models, optimizers, schedulers, dataloaders)
        models_, optims_, scheds_, loaders_ = given.values()
        if not models_:
            raise ValueError("models: pass at least one model to checkpoint")
        app = _app_state(models_, optims_, scheds_)
        rank, world = _rank_and_world()
        final = self.root / f"step_{step:06d}"  # six digits, more when needed
        tmp = final.with_name(final.name + ".tmp")

        try:  # every file of the checkpoint into ``tmp`` (collective); ``meta.json`` last
            if rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left over by a crashed save of the same step
                    shutil.rmtree(tmp)
                tmp.mkdir()
            barrier()
            with quiet_single_process():  # no process group: DCP saves as one process
                dcp.save(app, checkpoint_id=tmp)
            for name, engine in _engines(models_).items():  # ZeRO partitions, in DeepSpeed's layout
                engine.save_checkpoint(str(tmp), tag=f"deepspeed.{name}", save_latest=False)
            per_rank = {
                "step": step,
                "dataloaders": {k: v.state_dict() for k, v in loaders_.items()},
                "rng": rng_state(),
                "extra": dict(extra or {}),
            }
            save_state(per_rank, tmp / f"rank_{rank:05d}")
            barrier()
            if rank == 0:
                meta = {
                    "format": FORMAT,
                    "step": step,
                    "world_size": world,
                    **{what: sorted(objs) for what, objs in given.items()},
                    # Items per batch over all ranks: a resume on another world size must
                    # keep it (checked before anything loads, lightrft.training.run).
                    "global_batches": {
                        k: int(v.batch_size) * world
                        for k, v in loaders_.items()
                        if isinstance(getattr(v, "batch_size", None), int)
                    },
                    "lora": sorted(k for k, m in models_.items() if _is_lora(m)),
                    "deepspeed": sorted(_engines(models_)),
                    "time": time.time(),
                    "torch": torch.__version__,
                }
                if export is not None:
                    meta["export"] = dict(export)
                if config is not None:
                    text = json.dumps(dict(config), indent=1, default=str)
                    write_atomic(tmp / CONFIG, (text + "\n").encode())
                write_atomic(tmp / META, (json.dumps(meta, indent=1) + "\n").encode())
        except (Exception, CheckpointException) as e:  # DCP's wrapper is a BaseException
            raise _save_failed(tmp, step, self.latest(), e) from None
        if rank == 0:
            # Rename ``tmp`` to ``final`` (the same step saved again, e.g. after a resume, is
            # swapped out, then dropped) and point ``latest`` at it.
            replace_dir(tmp, final)
            with suppress(OSError):  # the rename on disk before ``latest`` names it
                fd = os.open(self.root, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            write_atomic(self.root / LATEST, (final.name + "\n").encode())
            # Delete stale ``.tmp`` dirs, the ``.step_N.*.old`` copy a step saved again left when
            # killed while deleting it, and complete checkpoints beyond ``keep_last`` but the
            # one ``latest`` now names.
            for pattern in ("step_*.tmp", ".step_*.old"):
                for p in self.root.glob(pattern):
                    shutil.rmtree(p, ignore_errors=True)
            if self.keep_last is not None:
                for p in self.list_checkpoints()[: -self.keep_last]:
                    if p != final:
                        shutil.rmtree(p, ignore_errors=True)
        barrier()
        return final

    # -- load -------------------------------------------------------------------------------

    def load(
        self,
        path: str | os.PathLike,
        *,
        models: nn.Module | Mapping[str, nn.Module],
        optimizers: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
        schedulers: Stateful | Mapping[str, Stateful] | None = None,
        dataloaders: Stateful | Mapping[str, Stateful] | None = None,
        restore_rng: bool = True,
        config: Mapping[str, Any] | None = None,
        override_lr: bool = False,
        seed: int = 0,
        read: tuple[dict[str, Any], list[dict[str, Any]]] | None = None,
    ) -> CheckpointState:
        """Restore the given objects in place from checkpoint ``path`` (collective).

        Build models (and ``parallelize`` them) and optimizers exactly as for training first:
        DCP loads into the existing, possibly sharded, tensors. Every name passed must exist in
        the checkpoint; names in the checkpoint that are not passed are ignored.

        ``config`` (the current run's resolved config) is compared with the one saved beside
        the checkpoint before anything is loaded (:func:`~lightrft.training.resume.
        check_resume_config`): changes that cannot be honoured raise a ``ValueError`` listing
        them; allowed ones are printed. A changed learning rate needs ``override_lr=True``; then
        the optimizers' and LambdaLR schedulers' base LRs become the ones the optimizers were
        just built with, at the saved position of the schedule. Prints
        ``resumed from step N (path)`` on rank 0.

        Saved by another number of ranks: DCP reshards the models and optimizers; each
        dataloader continues from the position all saved ranks reached together
        (:meth:`~lightrft.data.loader.ResumableDataLoader.load_resharded`); ``extra`` must be
        the same on every saved rank (it is rank 0's); the RNG states, which were per rank, are
        re-seeded from ``(seed, step, rank)`` (:func:`reseed`). Weights alone (no
        ``dataloaders``, ``restore_rng=False``) are not checked for that: every rank gets rank
        0's ``extra``. A DeepSpeed engine's files do not reshard: refused.

        ``read``: what :func:`check_readable` has already read of ``path`` (:meth:`load_latest`
        passes rank 0's), so the checkpoint is not read a second time.
        """
        path = Path(path)
        if not (path / META).is_file():
            raise ValueError(
                f"{path} is not a complete checkpoint (no {META}); "
                f"complete ones: {[p.name for p in self.list_checkpoints()]}"
            )
        meta, states = read or check_readable(path)
        given = _named(models, optimizers, schedulers, dataloaders)
        models_, optims_, scheds_, loaders_ = given.values()
        check_held_alike(
            path, meta, "deepspeed", {k: is_deepspeed_engine(m) for k, m in models_.items()}
        )
        for what, objs in given.items():
            missing = sorted(set(objs) - set(meta.get(what, [])))
            if missing:
                raise ValueError(
                    f"{what} {missing} are not in checkpoint {path} "
                    f"(it holds {what}: {meta.get(what, [])})"
                )
        check_held_alike(path, meta, "lora", {k: _is_lora(m) for k, m in models_.items()})
        (rank, world), saved_world = _rank_and_world(), int(meta["world_size"])
        needs_rank_state = bool(loaders_) or restore_rng
        resharded = saved_world != world
        changes = []
        saved_config = None if config is None else _read_json_object(path / CONFIG)
        if config is not None and saved_config is None and rank == 0:
            print(f"resume: {path} holds no config record; config changes are not checked")
        elif saved_config is not None:
            changes = check_resume_config(
                saved_config,
                json.loads(json.dumps(dict(config), default=str)),  # same normalisation as saved
                path=path,
                override_lr=override_lr,
                resharded=resharded and needs_rank_state,
            )
        # Each optimizer's configured LR per param group (``initial_lr`` once a scheduler exists).
        new_lrs = {
            name: [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
            for name, opt in optims_.items()
        }
        if resharded:
            check_reshardable(path, meta, world, loaders=loaders_)

        # A DeepSpeed engine's model and optimizer from its own files (collective); the LR
        # schedule is ours (in DCP), so DeepSpeed's is not loaded.
        for name, engine in _engines(models_).items():
            loaded, _ = engine.load_checkpoint(
                str(path), tag=f"deepspeed.{name}", load_lr_scheduler_states=False
            )
            if loaded is None:
                raise ValueError(f"checkpoint {path}: no DeepSpeed files for model {name!r}")
        app = _app_state(models_, optims_, scheds_)
        # Vet the metadata here too: inside dcp.load the refusal would come back as a
        # stringified AssertionError wrapped in a CheckpointException.
        try:
            with quiet_single_process():
                dcp.load(app, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        except CheckpointException as e:
            raise _load_failed(path, e) from None
        if resharded and needs_rank_state:
            # The loaders continue from the saved ranks' joint position; ``extra`` is rank 0's,
            # which every saved rank must share.
            extra = states[0]["extra"]
            differ = sorted(
                k
                for k in extra
                if not all(stored_alike(extra[k], s["extra"].get(k)) for s in states[1:])
            )
            if differ or any(s["extra"].keys() != extra.keys() for s in states):
                raise CheckpointError(
                    f"checkpoint {path}: the per-rank state {differ or 'keys'} differs between "
                    f"its {saved_world} ranks, so it cannot be handed to another number of "
                    f"ranks; resume with {saved_world} process(es)"
                )
            for name, loader in loaders_.items():
                loader.load_resharded([s["dataloaders"][name] for s in states], name)
            per_rank = {"extra": extra, "rng": {}}
            if restore_rng:
                reseed(seed, int(meta["step"]), rank)
                per_rank["rng"] = rng_state()
        else:  # resharded without rank state (weights alone): rank 0's extra, unchecked
            per_rank = states[0 if resharded else rank]
            for name, loader in loaders_.items():
                loader.load_state_dict(per_rank["dataloaders"][name])
            if restore_rng:
                set_rng_state(per_rank["rng"])
        if override_lr and any(c.kind in ("lr", "schedule") for c in changes):
            # The configured base LRs back, keeping the schedule's position: each group's
            # current LR is scaled by new_base / saved_base.
            for name, opt in optims_.items():
                for i, g in enumerate(opt.param_groups):
                    saved = g.get("initial_lr", g["lr"])
                    g["lr"] = new_lrs[name][i] * (g["lr"] / saved if saved else 1.0)
                    if "initial_lr" in g:
                        g["initial_lr"] = new_lrs[name][i]
                if hasattr(sched := scheds_.get(name), "base_lrs"):
                    sched.base_lrs = list(new_lrs[name])
                    sched._last_lr = [g["lr"] for g in opt.param_groups]
        barrier()
        if rank == 0:
            for c in changes:
                applied = c.kind in ("lr", "schedule")
                print(f"resume: {c} ({'applied' if applied else 'allowed'})", flush=True)
            if resharded:
                print(
                    f"resume: world size {saved_world} -> {world} (models and optimizers "
                    "resharded; data positions re-derived; RNG re-seeded from (seed, step, "
                    "rank))",
                    flush=True,
                )
            print(f"resumed from step {meta['step']} ({path})", flush=True)
        return CheckpointState(
            step=int(meta["step"]),
            path=path,
            extra=per_rank["extra"],
            world_size=saved_world,
            rng=per_rank["rng"],
            config_changes=changes,
        )

    def load_latest(self, *, required: bool = False, **load: Any) -> CheckpointState | None:
        """:meth:`load` the newest complete checkpoint with the keyword arguments ``load`` takes
        (``models``, ``optimizers``, ``schedulers``, ``dataloaders``, ``restore_rng``,
        ``config``, ``override_lr``); ``None`` when there is none.

        ``required=True`` (a recipe's ``resume=true``) turns "none" into a ``ValueError`` that
        names the directory searched.
        """
        # Rank 0 decides, so every rank loads the same checkpoint even if their views of a
        # shared file system lag behind one another.
        found = self.latest_readable() if is_main() else None
        path = all_gather_objects(found and found[0])[0]  # rank 0's
        if path is None:
            if required:
                raise self.none_to_resume()
            return None
        return self.load(path, read=found and found[1:], **load)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) from ``(seed, step, rank)``: the RNG streams
    of a run resumed on another world size, where the saved per-rank states have no owner.
    Distinct per rank and step, the same on every resume of the same checkpoint."""
    value = ((seed * 1_000_003 + step) * 1_009 + rank) % 2**63
    random.seed(value)
    torch.manual_seed(value)  # every CUDA device too
    np.random.seed(value % 2**32)


def check_reshardable(
    path: Path,
    meta: Mapping[str, Any],
    world: int,
    *,
    loaders: Mapping[str, Any] | None = None,
    global_batch: int | None = None,
) -> None:
    """Refuse, before anything loads, a checkpoint of ``meta["world_size"]`` ranks that cannot
    continue on ``world``: a DeepSpeed engine's files (ZeRO partitions its optimizer state per
    rank, ``zero_pp_rank_*``), a loader that cannot re-derive its position, or a run whose
    global batch (items per step over all ranks, ``global_batch``) differs from the saved one.
    """
    saved = int(meta["world_size"])
    if meta.get("deepspeed"):
        raise ValueError(
            f"checkpoint {path} was saved by {saved} rank(s) with strategy=deepspeed, and this run "
            f"has {world}: DeepSpeed ZeRO writes its optimizer partitions per rank "
            "(zero_pp_rank_*_optim_states.pt), which do not reshard; resume with "
            f"{saved} process(es), or train with strategy=fsdp2 (DCP reshards)"
        )
    for name, loader in (loaders or {}).items():
        if not hasattr(loader, "load_resharded"):
            raise ValueError(
                f"checkpoint {path} was saved by {saved} rank(s) and this run has {world}: "
                f"dataloader {name!r} ({type(loader).__name__}) cannot re-derive its position "
                "on another world size (use lightrft.data.build_dataloader); resume with "
                f"{saved} process(es)"
            )
    batches = meta.get("global_batches")
    if global_batch is not None and meta.get("dataloaders"):
        if not batches:
            raise ValueError(
                f"checkpoint {path} was saved by {saved} rank(s) by an older lightrft, which "
                f"did not record its global batch; resume with {saved} process(es)"
            )
        for name, value in sorted(batches.items()):
            if int(value) != global_batch:
                raise ValueError(
                    f"checkpoint {path} was saved by {saved} rank(s) reading {value} items per "
                    f"step over all ranks ({name}); this run on {world} reads {global_batch}. "
                    "A resume on another world size keeps the global batch: scale the per-rank "
                    f"batch (e.g. batch_size or gradient_accumulation_steps) by {saved}/{world}"
                )


def _is_lora(model: nn.Module) -> bool:
    """Whether ``model`` (or the module a DeepSpeed engine wraps) trains LoRA adapters."""
    return has_adapters(model.module if is_deepspeed_engine(model) else model)


def _engines(models: Mapping[str, Any]) -> dict[str, Any]:
    return {name: m for name, m in models.items() if is_deepspeed_engine(m)}


# How a model the checkpoint holds may differ from this run: meta.json's key -> what a resume
# says when this run has it and the checkpoint not, and the reverse.
_HELD = {
    "deepspeed": (
        "holds model {name} as FSDP2 (DCP) state, but this run trains it with strategy=deepspeed: "
        "resume with strategy=fsdp2",
        "holds model {name} as a DeepSpeed engine's files, but this run trains it with FSDP2: "
        "resume with strategy=deepspeed",
    ),
    "lora": (
        "holds a full fine-tune of model {name} but this run trains LoRA adapters (the lora: "
        "section): remove the lora section to resume it, or start a new run (resume=false)",
        "holds LoRA adapters of model {name} but this run is a full fine-tune: add the same "
        "lora: section to resume it, or start a new run (resume=false)",
    ),
}


def check_held_alike(
    path: Path, meta: Mapping[str, Any], key: str, run: Mapping[str, bool]
) -> None:
    """Raise a ``ValueError`` when a model of the checkpoint (``meta``) is held as ``key`` says
    (``lora``: LoRA adapters; ``deepspeed``: a DeepSpeed engine's files) but not in this run
    (``run``: model name -> held so), or the reverse: the way out is named."""
    for name, held in sorted(run.items()):
        if name in meta.get("models", []) and held != (name in meta.get(key, [])):
            why = _HELD[key][0 if held else 1].format(name=repr(name))
            raise ValueError(f"checkpoint {path} {why}")


# ---------------------------------------------------------------------------------------------
# a failed save


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the partial directory has been removed."""


def _os_cause(e: BaseException) -> OSError | None:
    """The ``OSError`` behind ``e``: itself, its cause/context chain, or inside DCP's wrapper."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None:
            return x
        if isinstance(x, CheckpointException):
            stack += [exc for exc, _ in x.failures.values()]
        stack += [x.__cause__, x.__context__]
    return None


def _save_failed(tmp: Path, step: int, latest: Path | None, e: BaseException) -> Exception:
    """Remove the partial ``tmp`` directory and describe the failure by its real cause (torch's
    own message on a full disk is ``unexpected pos ...`` from its zip writer)."""
    shutil.rmtree(tmp, ignore_errors=True)
    cause = _os_cause(e)
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        free = None
    if cause is not None:
        why = f"{os.strerror(cause.errno)} (errno {errno.errorcode.get(cause.errno, cause.errno)})"
    elif free is not None and free < 16 * 2**20:
        why = f"{_one_line(e)}; most likely the disk is full"
    else:
        why = _one_line(e, last=True)
    room = f"; {free / 2**20:.1f} MiB free there now" if free is not None else ""
    keep = f"the last good checkpoint {latest} is intact" if latest else "no earlier checkpoint"
    return CheckpointSaveError(
        f"saving the checkpoint of step {step} into {tmp} failed: {why}{room}. The partial "
        f"directory was removed; {keep}"
    )


# ---------------------------------------------------------------------------------------------
# the resume check a recipe's config runs before anything loads


def check_resume(
    output_dir: str | Path,
    adapted: bool,
    models: tuple[str, ...],
    world: int = 1,
    global_batch: Callable[[int], int | None] | None = None,
) -> None:
    """Before anything loads (``resume=true``): there must be a checkpoint under ``output_dir``;
    the newest readable one must train LoRA adapters exactly when this run does (``adapted``),
    for each of ``models`` it holds; saved by another number of ranks than ``world``, it must be
    able to continue on ``world`` (:func:`check_reshardable`, with this run's global batch
    ``global_batch(world)``)."""
    ckpt = Checkpointer(output_dir)
    found = ckpt.latest_readable()
    if found is None:
        raise ckpt.none_to_resume()
    latest, meta, _ = found
    check_held_alike(latest, meta, "lora", dict.fromkeys(models, adapted))
    if int(meta.get("world_size", 1)) != world:
        batch = global_batch(world) if global_batch is not None else None
        check_reshardable(latest, meta, world, global_batch=batch)
