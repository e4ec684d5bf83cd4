"""The final export of a trained model: the full HF directory, or for LoRA the adapter directory
and, with ``lora.export_merged``, the merged model beside it.

The merged weights come from the same merge as weight sync (:func:`lightrft.engine.sync.
iter_weight_buckets`), so the export and the rollout engine see identical tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from lightrft.distributed import barrier, is_main
from lightrft.engine.sync import iter_weight_buckets
from lightrft.models.export import export_hf, replace_dir
from lightrft.models.lora import export_adapter, unwrap_peft
from lightrft.sections import LoraConfig

__all__ = ["export_merged", "export_trained"]


def export_merged(model: nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write the base model with the adapters merged in, as a plain HF directory (collective).

    The weights come from the same merge as weight sync (``iter_weight_buckets``), so the
    export and the rollout engine see identical tensors. ``model``: a PEFT model, or a model
    with adapters injected in place that saves itself (a reward model,
    :func:`lightrft.models.lora.apply_backbone_lora`).
    """
    main = is_main()
    sd = {}
    for bucket in iter_weight_buckets(model):
        if main:
            sd.update((name, t.clone()) for name, t in bucket)
    out = Path(out_dir)
    if main:
        base = unwrap_peft(model)
        tmp = out.with_name(out.name + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        base.save_pretrained(tmp, state_dict=sd, is_main_process=True)
        cfg_file = tmp / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.pop("_name_or_path", None)
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out)
    barrier()
    return out


def export_trained(
    model: nn.Module, tokenizer: Any, out_dir: str | Path, lora: LoraConfig | None
) -> Path:
    """A recipe's final export (collective): the full HF model, or for LoRA the adapter
    directory at ``out_dir`` and, with ``lora.export_merged``, the merged model beside it
    at ``<out_dir>_merged``."""
    if lora is None:
        return export_hf(model, tokenizer, out_dir)
    out = export_adapter(model, tokenizer, out_dir)
    if lora.export_merged:
        export_merged(model, tokenizer, Path(out_dir).with_name(Path(out_dir).name + "_merged"))
    return out
