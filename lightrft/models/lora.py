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
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from lightrft.sections import LoraConfig


def _linear_names(model: nn.Module) -> dict[str, str]:
    """Full name -> last name part of every ``nn.Linear`` inside the decoder blocks."""
    from lightrft.models.parallel import decoder_layers

    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    return {
        name: name.rsplit(".", 1)[-1]
        for name, mod in model.named_modules()
        if name.startswith(prefix + ".") and isinstance(mod, nn.Linear)
    }


def resolve_targets(model: nn.Module, opts: LoraConfig) -> list[str]:
    """The module names LoRA adapts: every decoder linear layer (``auto``) or the configured
    names, each of which must name at least one linear layer of the decoder."""
    linears = _linear_names(model)
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


def _ignore_old_torchao() -> None:
    """PEFT (0.17-0.21) raises ImportError while building any LoRA layer when torchao < 0.16 is
    installed, which torchtune 0.6.1 requires. Its torchao path only serves torchao-quantized
    base weights, which we never build: tell PEFT torchao is absent."""
    import importlib.metadata

    from packaging.version import Version

    try:
        old = Version(importlib.metadata.version("torchao")) < Version("0.16")
    except importlib.metadata.PackageNotFoundError:
        return
    if old:
        import peft.import_utils
        import peft.tuners.lora.torchao
        import peft.utils.quantization_utils

        for mod in (peft.import_utils, peft.tuners.lora.torchao, peft.utils.quantization_utils):
            if hasattr(mod, "is_torchao_available"):
                mod.is_torchao_available = lambda: False


def _lora_config(model: nn.Module, opts: LoraConfig, **extra: Any):
    """PEFT's ``LoraConfig`` for ``opts`` on ``model``'s decoder, after checking that every
    ``trained_modules`` name names a module of it."""
    from peft import LoraConfig

    _ignore_old_torchao()
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
        p.requires_grad_(".lora_" in name or id(p) not in base_params or id(p) in full)
    return net


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (possibly FSDP2-sharded: the class changes, the
    ``peft_config`` attribute stays)."""
    return isinstance(getattr(model, "peft_config", None), dict)


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
    from lightrft.distributed import barrier, is_main
    from lightrft.models.export import replace_dir

    out = Path(out_dir)
    sd = _peft_state_dict(model)
    if is_main():
        tmp = out.with_name(out.name + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp, state_dict=sd, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out)
    barrier()
    return out


def _peft_state_dict(model: nn.Module) -> dict:
    """The full state dict under PEFT's own names (collective; empty on ranks > 0)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    sd = get_model_state_dict(model, options=opts)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return sd
