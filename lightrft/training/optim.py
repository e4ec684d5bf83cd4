"""LR schedule (linear warmup + cosine decay) and gradient clipping that works on FSDP2 DTensors."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from lightrft.config import at_least, resolve
from lightrft.distributed import full_tensor


def warmup_cosine_lr_ratio(
    step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> float:
    """The LR multiplier for optimizer step ``step`` (0-based: the first update is step 0).

    Linear warmup ``(step + 1) / warmup_steps`` over the first ``warmup_steps`` updates (so the
    first update already moves the weights), then half a cosine from 1 down to ``min_lr_ratio`` at
    ``step == total_steps``, and ``min_lr_ratio`` after that (Loshchilov & Hutter, 2017, SGDR,
    without restarts). A pure function of ``step``, so a resumed run gets exactly the same LRs.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A ``LambdaLR`` following :func:`warmup_cosine_lr_ratio`; call ``.step()`` after each update.

    Its ``state_dict()`` holds only the step count and base LRs; the current LR lives in the
    optimizer's param groups, so restore both (as :class:`~lightrft.training.Checkpointer` does)
    to continue the schedule exactly.
    """
    at_least("total_steps", total_steps, 1)
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    fn = functools.partial(
        warmup_cosine_lr_ratio,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        min_lr_ratio=min_lr_ratio,
    )
    return LambdaLR(optimizer, fn)


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: Any, total_steps: int) -> LambdaLR:
    """The :func:`warmup_cosine_scheduler` of an ``lr_scheduler:`` section
    (:class:`~lightrft.sections.ScheduleConfig`) over ``total_steps``."""
    return warmup_cosine_scheduler(
        optimizer,
        warmup_steps=schedule.warmup_steps,
        total_steps=total_steps,
        min_lr_ratio=schedule.min_lr_ratio,
    )


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter] | torch.nn.Module,
    max_norm: float | None,
    *,
    norm_type: float = 2.0,
    foreach: bool | None = None,
) -> float:
    """Clip gradients to a global norm of ``max_norm`` and return the norm before clipping.

    Works for plain tensors and FSDP2 DTensor (sharded) gradients alike: the norm is reduced over
    all shards, so every rank gets the same value and scales by the same factor. ``max_norm=None``
    (or ``<= 0``) only measures the norm. Collective when gradients are sharded: call on every rank.
    A non-finite norm is returned as is (the recipe decides whether to skip the step).
    """
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=foreach)
    # With DTensor grads the norm is a DTensor holding per-shard partial norms: reduce it (on
    # the mesh's device: offloaded gradients live in CPU memory, which NCCL cannot reduce), and
    # scale the gradients where they live.
    if isinstance(total, DTensor):
        total = full_tensor(total).to(grads[0].device)
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return float(total)


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a DeepSpeed engine (``strategy: deepspeed``), without importing it."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
) -> float:
    """End an optimizer step after the step's last backward: clip to ``max_norm`` (None: only
    measure), step, zero the gradients; return the gradient norm before clipping. A DeepSpeed
    engine does all three itself (:class:`lightrft.strategy.DeepSpeedStrategy`)."""
    norm = clip_grad_norm(model, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def cpu_offload_optimizer(
    params: Iterable[torch.nn.Parameter], optimizer: str = "torch.optim.AdamW", **kwargs
) -> torch.optim.Optimizer:
    """torchao's ``CPUOffloadOptimizer`` (optimizer state and step on the CPU, CUDA/XPU params),
    with the inner optimizer named by a dotted path so a YAML config can choose it::

        optimizer:
          _component_: lightrft.training.cpu_offload_optimizer
          optimizer: torch.optim.AdamW
          lr: 1.0e-5
          fused: true            # any keyword of the inner optimizer
    """
    from torchao.optim import CPUOffloadOptimizer

    # A wrong path: resolve's ConfigError (a ValueError) names its part, as for a _component_.
    return CPUOffloadOptimizer(params, resolve(optimizer), **kwargs)
