"""The default strategy: FSDP2 (``fully_shard`` over a DeviceMesh; HSDP with ``shard_size`` /
``replicate_size``; plain tensors in one process), optionally with LoRA adapters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightrft.engine.sync import sync_weights
from lightrft.models.lora import adapters_disabled, apply_lora
from lightrft.strategy.base import Strategy
from lightrft.training.export import export_trained
from lightrft.training.optim import optimizer_step


class FSDP2Strategy(Strategy):
    """FSDP2 (+ LoRA): the trained model is sharded like every other model of the run;
    ``offload: params`` keeps its shards, gradients and optimizer state in CPU memory."""

    def __init__(self, cfg, dist):
        super().__init__(cfg, dist)
        self.offload = cfg.offload == "params"
        if self.offload and not torch.distributed.is_initialized():
            # Refused before any model loads: FSDP2 (and so its offload) needs a process group.
            raise ValueError(
                "offload=params needs FSDP2 sharding, which needs a process group: launch the "
                "recipe with torchrun (lightrft run --nproc_per_node 1 ... on one device), or "
                "set offload=none"
            )

    def loading(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "offload": self.offload}

    def adapt(self, model, apply=None):
        if self.cfg.lora is None:
            return model
        return (apply or apply_lora)(model, self.cfg.lora)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        return optimizer_step(self.model, self.optimizer, self.clip_grad_norm)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"models": self.model, "optimizers": self.optimizer}

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        with adapters_disabled(self.model):  # a no-op for a full model
            yield

    @property
    def needs_reference_copy(self) -> bool:
        return self.cfg.lora is None

    def sync_weights(self, engine: Any, *, skip_frozen: bool = False) -> None:
        sync_weights(self.model, engine, skip_frozen=skip_frozen)

    def export(self, processor: Any, out_dir: str | Path, *, adapter: bool = True) -> Path:
        return export_trained(self.model, processor, out_dir, self.cfg.lora, adapter=adapter)
