"""A training checkpoint as a model: ``lightrft export``, eval's ``model.path`` and
:class:`~lightrft.rewards.RewardModel` given ``<output_dir>/checkpoints/step_N``.

A checkpoint is exported by rebuilding the trained model whole from the record its
``meta.json`` carries (:class:`~lightrft.training.export.ExportSpec`), loading the checkpoint's
weights into it and writing it with the same :func:`~lightrft.training.export.export_trained` a
run's end calls, so the export equals the run's ``final/`` had it ended at that step. Its own
room: reward models and eval take a checkpoint through it without importing ``training``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torch import nn

from lightrft.distributed import is_main
from lightrft.sections import is_checkpoint_dir
from lightrft.training.export import ExportSpec, export_trained


def read_export_spec(checkpoint: str | Path) -> tuple[dict[str, Any], ExportSpec]:
    """``meta.json`` and the :class:`ExportSpec` of ``checkpoint``, after checking that every
    file the export reads is there; a ``ValueError`` naming the path and the key or file that
    is missing, before anything heavy loads."""
    from lightrft.training.checkpoint import FORMAT, META, CheckpointError, check_readable

    path = Path(checkpoint)
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a directory; give a checkpoint (<output_dir>/checkpoints/step_N)"
        )
    if not (path / META).is_file():
        tmp = " (a save in progress or one that crashed)" if path.name.endswith(".tmp") else ""
        hint = ""
        if (path / "checkpoints").is_dir():
            hint = f"; it is a run's output_dir: give one of {path / 'checkpoints'}/step_N"
        elif (path / "config.json").is_file():
            hint = "; it is already a model directory"
        raise ValueError(f"{path} is not a complete checkpoint: it has no {META}{tmp}{hint}")
    try:
        meta, _ = check_readable(path)
    except CheckpointError as e:
        raise ValueError(f"checkpoint {path} cannot be exported: {e}") from None
    fmt = meta.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise ValueError(
            f"{path / META}: 'format' is {fmt!r}, written by a newer LightRFT (this one reads "
            f"formats up to {FORMAT}); export it with that version"
        )
    if "export" not in meta:
        raise ValueError(
            f"{path / META} has no 'export' key (format {fmt}; LightRFT writes it from format "
            f"{FORMAT}): the checkpoint does not name the base model, model kind, LoRA config "
            "and strategy it needs to be rebuilt on one process. Resume the run from it with "
            "this version and let it save again, or load it into the model by hand "
            "(Checkpointer.load)"
        )
    spec = ExportSpec.from_json(meta["export"], path / META)
    if spec.model not in meta.get("models", []):
        raise ValueError(
            f"{path / META}: 'export.model' is {spec.model!r}, but the checkpoint holds models "
            f"{meta.get('models', [])}"
        )
    deepspeed = spec.model in meta.get("deepspeed", [])
    if deepspeed != (spec.strategy == "deepspeed"):
        raise ValueError(
            f"{path / META}: 'export.strategy' is {spec.strategy!r} but model {spec.model!r} "
            f"is stored as {'DeepSpeed files' if deepspeed else 'DCP state'}"
        )
    if deepspeed:
        ds_dir = path / f"deepspeed.{spec.model}"
        if not ds_dir.is_dir():
            raise ValueError(f"{path}: the DeepSpeed directory {ds_dir.name} is missing")
    elif not (path / ".metadata").is_file():
        raise ValueError(f"{path}: the DCP metadata file .metadata is missing")
    base = Path(spec.base_path())
    if not (base / "config.json").is_file():
        raise ValueError(
            f"{path / META}: 'export.path' names the base model {spec.path!r}, but "
            f"{base} holds no config.json: the export rebuilds the model from it (the frozen "
            "weights and the config come from there)"
        )
    return meta, spec


def _load_dcp(model: nn.Module, path: Path, name: str) -> None:
    """Load the model ``name`` of checkpoint ``path`` (DCP, saved by any number of ranks) into
    the plain ``model``: the tensors the checkpoint holds (its trainable ones, or all of them);
    the others keep their base value, which training never changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lightrft.training.checkpoint import quiet_single_process
    from lightrft.training.safe_state import (
        SafeFileSystemReader,
        SafeLoadPlanner,
        read_dcp_metadata,
    )

    with open(path / ".metadata", "rb") as f:
        md = read_dcp_metadata(f, path / ".metadata")
    prefix = f"model.{name}.model."
    stored = [k.removeprefix(prefix) for k in md.state_dict_metadata if k.startswith(prefix)]
    if not stored:
        raise ValueError(f"{path}: the DCP state holds no tensors of model {name!r}")
    sd = get_model_state_dict(model)
    unknown = [k for k in stored if k not in sd]
    if unknown:
        raise ValueError(
            f"{path}: model {name!r} holds {unknown[0]!r}, which the model rebuilt from its "
            "export record has not (another base model, or another LoRA config)"
        )
    # Adapters the rebuilt model has but the checkpoint lacks would be exported untrained.
    from lightrft.models.lora import is_adapter_param

    absent = [k for k in sd if is_adapter_param(k) and k not in stored]
    if absent:
        raise ValueError(
            f"{path}: model {name!r} holds no {absent[0]!r}, which the LoRA config of its "
            "export record creates"
        )
    target = {k: sd[k] for k in stored}
    try:
        with quiet_single_process():
            dcp.load(
                {f"model.{name}": {"model": target}},
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except CheckpointException as e:  # a BaseException: e.g. another shape (LoRA rank)
        inner = next(iter(e.failures.values()))[0] if e.failures else e
        first = (str(inner).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"{path}: model {name!r} does not load into the model rebuilt from its export "
            f"record ({type(inner).__name__}: {first})"
        ) from None


def _load_deepspeed(model: nn.Module, path: Path, name: str) -> None:
    """The ZeRO-1/2/3 files of engine ``name`` merged into ``model`` (DeepSpeed's
    ``zero_to_fp32``: the fp32 master weights, cast to the model's dtype as the engine casts
    them into its parameters)."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ValueError(
            f"{path} holds a DeepSpeed checkpoint: exporting it needs the DeepSpeed extra, "
            "pip install 'lightrft[deepspeed]'"
        ) from None
    from lightrft.models.names import strip_wrappers

    merged = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=f"deepspeed.{name}")
    merged = {strip_wrappers(k): v for k, v in merged.items()}
    unknown = model.load_state_dict(merged, strict=False).unexpected_keys
    if unknown:
        raise ValueError(
            f"{path}: DeepSpeed model {name!r} holds {unknown[0]!r}, which the model rebuilt "
            "from its export record has not (another base model?)"
        )


def export_checkpoint(
    checkpoint: str | Path, out_dir: str | Path, *, trust_remote_code: bool = False
) -> Path:
    """Write checkpoint ``checkpoint`` (FSDP2 DCP state saved by any number of ranks, LoRA
    adapters, DeepSpeed ZeRO-1/2/3 files) as the directory the run's ``final/`` would be had the
    run ended at that step, in this one process (``lightrft export``). Returns ``out_dir``.

    Bad input (not a checkpoint, an older checkpoint without the export record, another
    version's, a missing file) is a ``ValueError`` naming the path and key, before any model
    loads. Without a process group it needs none; under one it is collective (every rank
    rebuilds the model, rank 0 writes), as the final export is.

    ``trust_remote_code`` comes from the caller (the command line, a config) only, never from
    the checkpoint: a ``meta.json`` is a file anyone can write, and with it the base directory's
    ``auto_map`` code would run. A checkpoint whose run trusted remote code is refused, naming
    the flag, unless the caller trusts it too."""
    from lightrft.models.lora import apply_backbone_lora, apply_lora
    from lightrft.models.multimodal import load_processors
    from lightrft.models.reward import load_reward_net_parallel, set_reward_config
    from lightrft.models.sharded import load_parallel

    path = Path(checkpoint)
    _meta, spec = read_export_spec(path)
    if spec.trust_remote_code and not trust_remote_code:
        raise ValueError(
            f"{path / 'meta.json'}: the run loaded its base model {spec.base_path()} with "
            "trust_remote_code=true, and a checkpoint cannot grant that itself; if you trust the "
            "code in that directory, pass --trust-remote-code to lightrft export (or set "
            "model.trust_remote_code=true in the config that names the checkpoint)"
        )
    spec = dataclasses.replace(spec, trust_remote_code=bool(trust_remote_code))
    out = Path(out_dir)
    if out.resolve() == path.resolve() or path.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} lies inside the checkpoint {path}; write it elsewhere")
    # The export replaces its directory whole: never someone's other files. Rank 0 writes, so
    # it checks (another rank could see the directory rank 0 has just written).
    merged = spec.lora is not None and spec.adapter and spec.lora.get("export_merged")
    dirs = [out, out.with_name(out.name + "_merged")] if merged else [out]
    for d in dirs if is_main() else []:
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise ValueError(f"--out: {d} exists and is not empty; give a new directory")
        above = next((a for a in d.absolute().parents if a.exists()), None)
        if above is not None and not above.is_dir():
            raise ValueError(f"--out: {above} is a file, not a directory; give a directory path")
    # The trained model as the run built it before training, whole, on the CPU (the base
    # weights from spec.path, LoRA adapters on it, a reward model's head(s) and pooler), and its
    # processor. A relative model.path is what the run loaded, and what an adapter's
    # base_model_name_or_path records: load them by the same name, from the run's directory.
    lora = spec.lora_config()
    apply = apply_lora if spec.kind == "causal_lm" else apply_backbone_lora
    prepare = None if lora is None else (lambda m: apply(m, lora))
    common = dict(dtype=spec.dtype, device="cpu", trust_remote_code=spec.trust_remote_code)
    old = os.getcwd()
    if spec.cwd and Path(spec.cwd).is_dir():
        os.chdir(spec.cwd)
    try:
        if spec.kind == "causal_lm":
            model = load_parallel(spec.path, prepare=prepare, shard=False, **common)
        else:
            r = spec.reward
            model = load_reward_net_parallel(
                spec.path,
                heads=r["heads"],
                pooling=r["pooling"],
                end_token_id=r.get("end_token_id"),
                probe_layer=r.get("probe_layer"),
                prepare=prepare,
                shard=False,
                **common,
            )
        processor, _ = load_processors(spec.path, trust_remote_code=spec.trust_remote_code)
    finally:
        os.chdir(old)
    if spec.strategy == "deepspeed":
        _load_deepspeed(model, path, spec.model)
    else:
        _load_dcp(model, path, spec.model)
    if spec.kind == "reward_net":
        set_reward_config(model, spec.reward)
    return export_trained(model, processor, out, lora, adapter=spec.adapter)


def resolve_model_dir(path: str | Path, *, trust_remote_code: bool = False) -> str:
    """``path`` itself, or for a training checkpoint (:func:`~lightrft.sections.is_checkpoint_dir`) its export
    (:func:`export_checkpoint`) in the export cache (``$LIGHTRFT_EXPORT_CACHE``, else
    ``~/.cache/lightrft/exports``), made once and reused while the checkpoint is unchanged
    (keyed by its absolute path and ``meta.json``). What eval's
    ``model.path`` and :class:`~lightrft.rewards.RewardModel` call. Under a process group it is
    collective (call it on every rank; the cache must be on a file system they share).
    ``trust_remote_code``: the caller's (its config's) flag; the checkpoint's own is never
    trusted (:func:`export_checkpoint`)."""
    import hashlib

    from lightrft.distributed import all_gather_objects, barrier
    from lightrft.training.checkpoint import META

    if not is_checkpoint_dir(path):
        return str(path)
    p = Path(path).resolve()
    key = hashlib.sha256(str(p).encode() + b"\0" + (p / META).read_bytes()).hexdigest()[:16]
    env = os.environ.get("LIGHTRFT_EXPORT_CACHE")
    cache = Path(env).expanduser() if env else Path.home() / ".cache" / "lightrft" / "exports"
    out = cache / f"{p.parent.parent.name}-{p.name}-{key}"
    # Rank 0 decides, so every rank takes part in the (collective) export or none does.
    if all_gather_objects(not out.is_dir() if is_main() else None)[0]:  # rank 0's
        export_checkpoint(p, out, trust_remote_code=trust_remote_code)
        if is_main():
            print(f"exported checkpoint {p} to {out}", flush=True)
    barrier()
    return str(out)
