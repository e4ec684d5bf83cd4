"""The DeepSpeed ZeRO backend (``strategy: deepspeed``): imported only when a recipe chooses it.

The recipe keeps owning what it owns under FSDP2: the optimizer (its ``optimizer``
``_component_``, built on the trainable parameters and handed to ``deepspeed.initialize``), the
LR schedule (ours, stepped on that optimizer), the step (a backward per micro-batch, then one
``engine.step()``: DeepSpeed's unmanaged gradient accumulation, so the number of micro-batches
may vary from step to step as token budgets make it), the clipping threshold (DeepSpeed's
``gradient_clipping``) and the loss normalisation (the recipe's loss is already divided for the
whole step, so the engine's backward does not divide it again). The strategy object
(:class:`lightrft.strategy.DeepSpeedStrategy`) runs the engine's backward and step; checkpoints
go through ``lightrft.training.Checkpointer``, which lets an engine write its own files.

    strategy: deepspeed
    deepspeed:
      stage: 2                  # 1 | 2 | 3 (ZeRO stage)
      offload_optimizer: false  # true: optimizer state and step on the CPU
      offload_param: false      # stage 3 only: parameters on the CPU between uses
      config: {}                # optional: further DeepSpeed config keys, merged in

A ``deepspeed.config`` key that the recipe sets itself (batch sizes, accumulation, clipping,
optimizer, scheduler, ZeRO stage / offload) is refused, naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.distributed import is_main
from lightrft.models.export import export_hf_state_dict
from lightrft.models.names import hf_name, strip_wrappers
from lightrft.sections import DeepSpeedConfig


def ds_config(
    opts: DeepSpeedConfig,
    *,
    micro_batch_size: int,
    accum: int,
    world_size: int,
    clip_grad_norm: float | None,
) -> dict:
    """The DeepSpeed config dict for ``opts`` and the recipe's own settings (pure)."""
    zero: dict[str, Any] = {"stage": opts.stage}
    for key in ("offload_optimizer", "offload_param"):
        if getattr(opts, key):
            zero[key] = {"device": "cpu"}
    if opts.stage == 3:
        # Our export gathers the weights itself (GatheredParameters, module by module): a
        # checkpoint need not consolidate a 16-bit copy on every save.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro_batch_size * accum * world_size,
        "gradient_clipping": float(clip_grad_norm or 0.0),
        # The recipe owns the step: backward per micro-batch, engine.step() once after the last
        # (token-budget micro-batches vary in number, so DeepSpeed must not count them).
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if opts.offload_optimizer:
        # The config's optimizer _component_ is used as given (DeepSpeed refuses a non-DeepSpeed
        # optimizer under offload unless told): deepspeed.ops.adam.DeepSpeedCPUAdam is the fast
        # choice there, torch.optim.AdamW works too.
        cfg["zero_force_ds_cpu_optimizer"] = False
    cfg.update(opts.config)
    return cfg


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opts: DeepSpeedConfig,
    *,
    micro_batch_size: int,
    accum: int,
    clip_grad_norm: float | None,
):
    """Wrap ``model`` and ``optimizer`` (built by the strategy on the trainable parameters) in a
    DeepSpeed engine; returns it. ``engine.module`` is the model (its parameters partitioned under
    ZeRO-3); ``engine.optimizer`` wraps ``optimizer``, whose param groups our scheduler steps."""
    if not torch.cuda.is_available():  # DeepSpeed reads its accelerator at import
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(
            "strategy=deepspeed needs a process group: launch with torchrun "
            "(lightrft run --nproc_per_node N ...), also for one process"
        )
    if dist.get_backend() == "gloo":
        # DeepSpeed's comm layer JIT-compiles a shared-memory all-reduce op (~40-90 s on first
        # use, cached in ~/.cache/torch_extensions) for CPU inference all-reduces; training
        # over gloo never calls it. Its compatibility table is one dict that is probed on first
        # access and kept: marking the op incompatible there skips the build.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    config = ds_config(
        opts,
        micro_batch_size=micro_batch_size,
        accum=accum,
        world_size=dist.get_world_size(),
        clip_grad_norm=clip_grad_norm,
    )
    if opts.stage == 3:
        # Our fused LM-head log-probs read lm_head.weight outside lm_head's own forward call
        # (models.forward: in a hook on it, whose result the root returns; a likelihood reward
        # model: in the root's forward): registered as the root's external parameter, ZeRO-3
        # keeps it gathered for the whole root forward and routes its gradient back.
        head = getattr(model, "get_output_embeddings", lambda: None)()
        if head is not None:
            deepspeed.zero.register_external_parameter(model, head.weight)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    # The recipes call the module, not the engine: do what engine.forward does first (ZeRO
    # counts the micro-step there; without it ZeRO-3 overwrites, not accumulates, the gradients
    # of a step's earlier micro-batches).
    new_micro_step = getattr(engine.optimizer, "clear_backward_seen_flag", None)
    if new_micro_step is not None:
        model.register_forward_pre_hook(lambda module, args: new_micro_step())
    return engine


def gathered_modules(engine: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The engine's module's parameters, one module at a time, as ``(name, whole tensor)``
    (collective: ZeRO-3 partitions are gathered with ``GatheredParameters`` for the duration of
    one item, so at most one module's weights are whole at once; ZeRO-1/2 weights are whole
    already). A tied parameter comes once, under its first name. Use each item before the next."""
    import deepspeed

    seen: set[int] = set()
    for mod_name, mod in engine.module.named_modules():
        params = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        if not params:
            continue
        seen.update(id(p) for _, p in params)
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            yield [(f"{mod_name}.{n}" if mod_name else n, p.detach()) for n, p in params]


def export_hf_engine(engine: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write the engine's model as an HF directory (collective; rank 0 writes): the full state
    dict of the engine's module on CPU, HF names (every rank gathers ZeRO-3 partitions module by
    module; rank 0 keeps the copies, others hand ``{}`` to the writer)."""
    module = engine.module
    main = is_main()
    out: dict[str, torch.Tensor] = {}
    for params in gathered_modules(engine):
        if main:
            out.update((strip_wrappers(n), t.to("cpu", copy=True)) for n, t in params)
    if main:
        first: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            name = strip_wrappers(name)
            out[name] = out[first.setdefault(id(p), name)]  # a tied name: the first copy
        kept = module.state_dict(keep_vars=True).keys()  # persistent buffers; built once
        for name, buf in module.named_buffers():
            if name in kept:
                out[strip_wrappers(name)] = buf.detach().to("cpu", copy=True)
    return export_hf_state_dict(module, out, tokenizer, out_dir)


def sync_weights(engine: Any, rollout: Any) -> None:
    """Copy the trained weights into the rollout engine module by module (collective: call on
    every rank; ``rollout`` may be None on a rank that only takes part in the gathers), then
    reset its prefix cache. The DeepSpeed counterpart of ``lightrft.engine.sync_weights``."""
    for params in gathered_modules(engine):
        if rollout is not None:
            rollout.load_weights([(hf_name(n), t) for n, t in params])
    if rollout is not None:
        rollout.reset_prefix_cache()
