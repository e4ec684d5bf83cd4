"""LoRA adapters (PEFT) on a Hugging Face causal LM, applied before ``parallelize`` (FSDP2).

    lora:
      rank: 16                  # required: the section switches LoRA on
      alpha: 32                 # default 2 * rank
      dropout: 0.05
      target_modules: auto      # every linear layer of the decoder blocks, or a list of names
      trained_modules: [lm_head]  # trained in full next to the adapters (embeddings, head)

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
The frozen base weights stay in the model; the reference policy of a KL term is the same model
with its adapters switched off (:func:`adapters_disabled`), so no second copy sits in memory.
Weight sync (``lightrft.engine.sync``) merges the adapters into full weights under HF names.

This module owns the LoRA rules every other module asks: which model is a PEFT wrapper
(:func:`lightrft.models.forward.is_peft_model`, which the forward funnel needs too) or carries
adapters (:func:`has_adapters`), which parameter is an adapter's (:func:`is_adapter_param`, :func:`is_lora_matrix`, :func:`is_original_copy`), which
factors weight sync merges into a base weight (:func:`merged_adapters`), and how a new adapter
parameter starts (:func:`initial_adapter_value`).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.models.forward import is_peft_model
from lightrft.models.loading import load_model
from lightrft.sections import LoraConfig

# The A / B matrix of a LoRA linear layer's adapter: weight sync merges it into the base weight.
_LORA_MATRIX = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")
_BASE_WEIGHT = ".base_layer.weight"


# ---------------------------------------------------------------------------------------------
# The rules: which model, layer and parameter is LoRA's


def is_adapter_param(name: str) -> bool:
    """Whether parameter ``name`` belongs to a PEFT LoRA adapter (``.lora_A.``, ``.lora_B.``,
    ``.lora_embedding_A.``, ...): trained, and never part of the base model's weights."""
    return ".lora_" in name


def is_lora_matrix(name: str) -> bool:
    """Whether parameter ``name`` is the A or B matrix of a LoRA linear layer's adapter, which
    weight sync and the merged export fold into the layer's base weight."""
    return _LORA_MATRIX.search(name) is not None


def is_original_copy(name: str) -> bool:
    """Whether parameter ``name`` is in the frozen original PEFT keeps beside the trained copy
    of a ``modules_to_save`` module (``lora.trained_modules``): the copy replaces it."""
    return ".original_module." in name


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer (a base layer plus adapters)."""
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B", "scaling"))


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` trains LoRA adapters: a PEFT model, or a model with PEFT LoRA layers
    injected in place (a reward model, :func:`apply_backbone_lora`)."""
    return is_peft_model(model) or any(is_lora_layer(m) for m in model.modules())


@dataclass
class LoraFactors:
    """One adapter of a LoRA linear layer: ``W + scaling * B @ A`` (``W^T`` for
    ``fan_in_fan_out`` layers, ``transpose``)."""

    a: torch.Tensor  # [r, in] (possibly a DTensor)
    b: torch.Tensor  # [out, r]
    scaling: float
    transpose: bool


def merged_adapters(model: nn.Module, name: str) -> list[LoraFactors]:
    """The adapters merged into parameter ``name`` of ``model`` when its weights leave it
    (weight sync, the merged export): the active, unmerged adapters of the LoRA layer whose base
    weight it is, else []."""
    if not name.endswith(_BASE_WEIGHT):
        return []
    module = model.get_submodule(name[: -len(_BASE_WEIGHT)])
    if not is_lora_layer(module):
        return []
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return []
    if any(getattr(module, "use_dora", {}).values()):
        raise ValueError(f"sync_weights: {name} uses DoRA, which is not supported; merge it first")
    adapters = getattr(module, "active_adapters", None) or list(module.lora_A.keys())
    return [
        LoraFactors(
            module.lora_A[ad].weight,
            module.lora_B[ad].weight,
            float(module.scaling[ad]),
            bool(getattr(module, "fan_in_fan_out", False)),
        )
        for ad in adapters
        if ad in module.lora_A
    ]


def initial_adapter_value(
    name: str, full_shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor | None:
    """The initial value of adapter parameter ``name`` as PEFT initialises LoRA (Hu et al.
    2021): ``lora_A`` Kaiming-uniform, ``lora_B`` zeros; None for any other parameter."""
    if ".lora_A." in name:
        w = torch.empty(full_shape, dtype=dtype)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        return w
    if ".lora_B." in name:
        return torch.zeros(full_shape, dtype=dtype)
    return None


# ---------------------------------------------------------------------------------------------
# Building, switching off and exporting adapters


def resolve_targets(model: nn.Module, opts: LoraConfig) -> list[str]:
    """The module names LoRA adapts: every decoder linear layer (``auto``) or the configured
    names, each of which must name at least one linear layer of the decoder."""
    from lightrft.models.parallel import decoder_layers

    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    # Full name -> last name part of every ``nn.Linear`` inside the decoder blocks.
    linears = {
        name: name.rsplit(".", 1)[-1]
        for name, mod in model.named_modules()
        if name.startswith(prefix + ".") and isinstance(mod, nn.Linear)
    }
    found = sorted(set(linears.values()))
    if opts.targets is None:
        return found
    for t in opts.targets:
        if not any(short == t or full.endswith("." + t) for full, short in linears.items()):
            raise ValueError(
                f"lora.target_modules: {t!r} matches no linear layer of the decoder of "
                f"{type(model).__name__}; its linear layers are {found} (or use 'auto'; "
                "embeddings and the LM head go in lora.trained_modules)"
            )
    return list(opts.targets)


def _lora_config(model: nn.Module, opts: LoraConfig, **extra: Any):
    """PEFT's ``LoraConfig`` for ``opts`` on ``model``'s decoder, after checking that every
    ``trained_modules`` name names a module of it."""
    from peft import LoraConfig

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in opts.trained_modules if m not in names]
    if missing:
        raise ValueError(
            f"lora.trained_modules: {missing} name no module of {type(model).__name__} "
            "(e.g. embed_tokens, lm_head)"
        )
    return LoraConfig(
        r=opts.rank,
        lora_alpha=opts.alpha,
        lora_dropout=opts.dropout,
        target_modules=resolve_targets(model, opts),
        bias="none",
        **extra,
    )


def apply_lora(model: nn.Module, opts: LoraConfig) -> nn.Module:
    """Wrap ``model`` in a PEFT LoRA model (base weights frozen); call before ``parallelize``."""
    from peft import get_peft_model

    cfg = _lora_config(
        model, opts, modules_to_save=list(opts.trained_modules) or None, task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` (FutureWarning on 5.2x)
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        return get_peft_model(model, cfg)


def apply_backbone_lora(net: nn.Module, opts: LoraConfig) -> nn.Module:
    """LoRA adapters on the decoder of a model that wraps an HF backbone, in place (a reward
    model's :class:`~lightrft.models.reward.RewardNet`: its ``base`` body, pooler and head).

    PEFT injects its LoRA layers into the decoder's linear layers without wrapping the model, so
    the parameter names stay the HF checkpoint's (plus PEFT's ``.base_layer.`` / ``.lora_A.``
    parts, which weight merging strips). Trainable afterwards: the adapters, every parameter
    outside the decoder's backbone (the head and the pooler, which are new; not the pretrained LM
    head of a ``likelihood`` reward model), and the ``trained_modules`` (trained in full in
    place); the backbone's own weights are frozen. Call before ``parallelize``.
    """
    from peft import inject_adapter_in_model

    base = net.base
    inject_adapter_in_model(_lora_config(base, opts), base)
    base_params = {id(p) for p in base.parameters()}
    if getattr(net, "pooling", None) == "likelihood":
        # The head is the pretrained LM head, not a new one: frozen like the backbone (a tied
        # head trains with the embedding when that is a trained module).
        base_params |= {id(p) for p in net.head.parameters()}
    full = {
        id(p)
        for name, m in base.named_modules()
        if name.rsplit(".", 1)[-1] in opts.trained_modules
        for p in m.parameters()
    }
    for name, p in net.named_parameters():
        p.requires_grad_(is_adapter_param(name) or id(p) not in base_params or id(p) in full)
    return net


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its LoRA adapters (and trained-module copies) switched off: the frozen
    base model, i.e. the reference policy. A no-op for a model without adapters.

    PEFT's own ``disable_adapter()`` also toggles ``requires_grad`` of the parameters registered
    at that moment; under FSDP2 those may be the unsharded copies of a block kept unsharded after
    forward, so the sharded adapter weights would stay frozen (untrained, and missing from
    checkpoints). Only the layers' ``_disable_adapters`` flags are flipped here, which is all
    their forward reads.
    """
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, flag in zip(layers, before, strict=True):
            m._disable_adapters = flag


def export_adapter(model: nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write the PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``
    + tokenizer) of a plain or FSDP2-sharded LoRA model; collective, rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightrft.models.export import export_hf_state_dict

    # The full state dict under PEFT's own names (collective; rank 0 writes it).
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    sd = get_model_state_dict(model, options=opts)
    return export_hf_state_dict(model, sd, tokenizer, out_dir, save_embedding_layers=False)


def load_export(
    path: str | Path,
    *,
    base: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
):
    """Any export of a run, in one call, in eval mode: a full HF directory (``final/`` of a full
    fine-tune, ``final_merged/`` of LoRA) as :func:`lightrft.models.load_model` loads it, or a
    LoRA adapter directory (``final/`` of a LoRA run: ``adapter_config.json`` and no
    ``config.json``) as a PEFT model on its base, in inference mode.

    ``base``: the adapter's base model directory; default the ``base_model_name_or_path`` the
    adapter records (the run's ``model.path``, relative to the directory the run started in when
    it was given relative).
    """
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file() or (path / "config.json").is_file():
        return load_model(path, dtype=dtype, device=device).eval()
    if base is None:
        base = json.loads(cfg_file.read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{cfg_file} names no base model: pass base=<the base model dir>")
        if not Path(base).exists():
            raise FileNotFoundError(
                f"{path}: its base model {base!r} (adapter_config.json base_model_name_or_path) "
                "does not exist here: pass base=<the base model dir>"
            )
    from peft import PeftModel

    base_model = load_model(base, dtype=dtype, device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        return PeftModel.from_pretrained(base_model, str(path)).eval()
