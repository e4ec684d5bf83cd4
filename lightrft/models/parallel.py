"""Activation checkpointing -> torch.compile per block -> FSDP2, in that order (as torchtitan)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def find_module_list(root: nn.Module, paths: tuple[str, ...]) -> nn.ModuleList | None:
    """The first ``nn.ModuleList`` found at one of the dotted ``paths`` under ``root``."""
    for path in paths:
        mod = root
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, nn.ModuleList):
            return mod
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of an HF causal LM (``model.model.layers`` and kin), also
    inside a PEFT wrapper."""
    if isinstance(getattr(model, "peft_config", None), dict):
        model = model.get_base_model()
    layers = find_module_list(
        model,
        (
            "model.layers",
            "model.language_model.layers",
            "transformer.h",
            "gpt_neox.layers",
            "model.decoder.layers",
            "layers",
        ),
    )
    if layers is not None:
        return layers
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}; "
        "pass a model with a `model.layers` ModuleList"
    )


def _tower_blocks(model: nn.Module) -> list[nn.Module]:
    """The encoder-tower blocks (vision and audio) FSDP2 shards besides the decoder's."""
    from lightrft.models.vision import media_blocks

    return media_blocks(model)


def default_param_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 compute on accelerators, fp32 on CPU (CPU bf16 matmuls are slow and imprecise)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def parallelize(
    model: nn.Module,
    *,
    mesh=None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    shard: bool | None = None,
) -> nn.Module:
    """Prepare ``model`` for training in place and return it.

    1. activation checkpointing wraps each decoder block (recompute in backward);
    2. ``torch.compile`` compiles each block in place (names keep no ``_orig_mod.`` prefix);
    3. FSDP2 ``fully_shard`` shards each block, then the root, with a ``MixedPrecisionPolicy``;
       a vision- or audio-language model's tower blocks are sharded each as well.

    ``shard=None`` shards when a process group is initialised; a single plain process keeps
    ordinary tensors so the same recipe runs unchanged on a laptop.
    """
    layers = decoder_layers(model)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    if compile:
        for layer in layers:
            layer.compile(dynamic=True)
    if shard is None:
        shard = dist.is_available() and dist.is_initialized()
    if not shard:
        return model

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if param_dtype is None:
        param_dtype = default_param_dtype(next(model.parameters()).device)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A vision- or audio-language model's tower blocks are sharded one by one too (trained or
    # frozen: a frozen tower costs no gradients but its weights are as large). The tower runs
    # before the decoder, so its blocks are gathered and resharded like the decoder's.
    for block in _tower_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for i, layer in enumerate(layers):
        # The last block is gathered again right away by the root's backward: keep it unsharded.
        last = i == len(layers) - 1
        fully_shard(
            layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


STRATEGIES = ("fsdp2", "deepspeed")


def strategy_option(value: str | None, key: str = "strategy") -> str:
    """The config's training strategy (null: ``fsdp2``), checked before anything loads.

    ``fsdp2``: ``parallelize`` (FSDP2 under torchrun, plain tensors in one process).
    ``deepspeed``: needs the ``deepspeed`` extra; its ZeRO backend is not built yet, so it is
    refused here rather than silently trained with FSDP2.
    """
    strategy = value or "fsdp2"
    if strategy not in STRATEGIES:
        raise ValueError(f"{key}: unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    if strategy == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError(
                f"{key}=deepspeed needs the DeepSpeed extra: pip install 'lightrft[deepspeed]' "
                "(or use strategy=fsdp2, the default)"
            )
        raise ValueError(
            f"{key}=deepspeed: the DeepSpeed ZeRO backend is not available in this version "
            "yet; use strategy=fsdp2 (see docs/strategies.md)"
        )
    return strategy
