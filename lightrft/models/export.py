"""Export a trained (possibly FSDP2-sharded) model as a plain Hugging Face directory.

The export holds ``model.safetensors`` (or shards + index), ``config.json``,
``generation_config.json`` and the tokenizer files, so ``AutoModelForCausalLM.from_pretrained``
and vLLM load it directly. A vision-language model is exported with its processor in place of the
tokenizer: the processor files (``processor_config.json`` with the image processor, the chat
template, the tokenizer) let ``AutoModelForImageTextToText`` and ``AutoProcessor`` (or
:func:`lightrft.models.load_processor`) load it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightrft.distributed import barrier, is_main
from lightrft.models.loading import to_dtype
from lightrft.models.names import strip_wrappers


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full, unsharded state dict on CPU with HF names (collective).

    Rank 0 gets every tensor; other ranks get an empty dict. Names the model ties together
    (e.g. ``lm_head.weight`` and ``model.embed_tokens.weight`` with tied embeddings) share one
    tensor again, so ``save_pretrained`` can drop the alias.
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=opts)
    if not sd:
        return {}
    sd = {strip_wrappers(k): v for k, v in sd.items()}
    # Gathering returns separate copies of tied parameters: re-alias them to the first name.
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name = strip_wrappers(name)
        if name in sd:
            sd[name] = sd[first.setdefault(id(param), name)]
    return sd


def export_hf(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write ``model`` (plain or FSDP2) and ``tokenizer`` as an HF directory at ``out_dir``.

    ``tokenizer``: the tokenizer, or a vision-language model's processor (anything with
    ``save_pretrained``; the processor writes its image-processor and tokenizer files).

    Collective: call on every rank. Rank 0 writes into a new uniquely named directory beside
    ``out_dir`` (:func:`writing_dir`) and renames it to ``out_dir`` only when complete, replacing an older export there, so a crash never leaves a
    half-written export under the final name. ``dtype`` casts floating-point weights (e.g.
    ``"bfloat16"`` for serving); ``None`` keeps the training dtype. ``tokenizer=None`` skips it.
    """
    if not hasattr(model, "save_pretrained"):
        raise ValueError(
            f"export_hf needs a Hugging Face model (with save_pretrained), got "
            f"{type(model).__name__}; use full_state_dict(model) to gather its weights instead"
        )
    sd = full_state_dict(model)  # every rank takes part in the gather
    return export_hf_state_dict(
        model, sd, tokenizer, out_dir, dtype=dtype, max_shard_size=max_shard_size
    )


def export_hf_state_dict(
    model: nn.Module,
    sd: dict[str, torch.Tensor],
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    **save: Any,
) -> Path:
    """:func:`export_hf` with the full state dict ``sd`` already gathered (rank 0's; ``{}`` on
    the others), e.g. by another backend (DeepSpeed ZeRO-3). Collective: call on every rank.
    ``save``: more ``model.save_pretrained`` arguments (a PEFT adapter's)."""
    out = Path(out_dir)
    cast = to_dtype(dtype) if dtype is not None else None
    if is_main():
        if cast is not None:
            # Cast floating tensors, keeping tied aliases aliased (one cast per storage).
            done: dict[int, torch.Tensor] = {}
            for v in sd.values():
                if v.is_floating_point() and id(v) not in done:
                    done[id(v)] = v.to(cast)
            sd = {k: done.get(id(v), v) for k, v in sd.items()}
        with writing_dir(out) as tmp:
            model.save_pretrained(
                tmp, state_dict=sd, is_main_process=True, max_shard_size=max_shard_size, **save
            )
            # save_pretrained records the dtype of the live (training) parameters; record the
            # cast one. Transformers 4 also records the directory the model was loaded from: not
            # the export's. (A PEFT adapter directory has no config.json.)
            config_file = tmp / "config.json"
            if config_file.is_file():
                cfg = json.loads(config_file.read_text())
                cfg.pop("_name_or_path", None)
                if cast is not None:
                    cfg["dtype"] = str(cast).removeprefix("torch.")
                config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    barrier()
    return out


@contextlib.contextmanager
def writing_dir(target: Path) -> Iterator[Path]:
    """A new, uniquely named, empty directory beside ``target`` to write into: renamed to
    ``target`` when the block ends, deleted (it is this call's own) when the block raises.
    (``mkdtemp``: never a path that existed, so nothing of anyone else's, such as a
    ``<target>.tmp`` of theirs, is reused or deleted.)"""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make the export private to this user
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, target)


def replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` to ``dst``; an existing ``dst`` is first moved into a new
    uniquely named directory beside it (which is then deleted, with only what was at ``dst``)."""
    old = None
    if dst.exists() or dst.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
        os.replace(dst, old / dst.name)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
