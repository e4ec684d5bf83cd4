"""The base of every training strategy (see :mod:`lightrft.strategy`): the mesh for frozen
models and the interface recipes call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.distributed import DistInfo
from lightrft.models.parallel import build_mesh
from lightrft.sections import StrategyConfig


class Strategy:
    """The base of every strategy: the mesh for frozen models and the interface recipes call."""

    def __init__(self, cfg: StrategyConfig, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._mesh, self._mesh_built = None, False

    @property
    def mesh(self):
        """The FSDP2 device mesh (None in one process); built on first use."""
        if not self._mesh_built:
            self._mesh = build_mesh(self.cfg.shard_size, self.cfg.replicate_size, self.dist.device)
            self._mesh_built = True
        return self._mesh

    @property
    def lora(self):
        return self.cfg.lora

    # -- loading ------------------------------------------------------------------------

    def loading(self) -> dict[str, Any]:
        """Keyword arguments of ``load_parallel`` / ``load_reward_net_parallel`` for the
        trained model."""
        raise NotImplementedError

    def frozen_loading(self) -> dict[str, Any]:
        """The same for a model beside it (reference, critic): FSDP2-sharded."""
        return {"mesh": self.mesh}

    def adapt(self, model: nn.Module, apply: Any = None) -> nn.Module:
        """The trained model's last step before sharding: LoRA adapters (``apply``: how to put
        them on this kind of model; default the causal-LM one) when configured."""
        return model

    # -- training -----------------------------------------------------------------------

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batch_size: int,
        accum: int,
        clip_grad_norm: float | None,
    ) -> None:
        """Take the trained model and its optimizer (built on its trainable parameters)."""
        self.model, self.optimizer, self.clip_grad_norm = model, optimizer, clip_grad_norm

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward; the loss is already normalised for the whole step."""
        raise NotImplementedError

    def step(self) -> float:
        """End the optimizer step: clip, step, zero the gradients; the norm before clipping."""
        raise NotImplementedError

    def checkpoint_state(self) -> dict[str, Any]:
        """``models`` (and ``optimizers``) as :meth:`Checkpointer.save` takes them."""
        raise NotImplementedError

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The trained model as the frozen reference policy (LoRA: adapters off); without
        LoRA a recipe loads a frozen copy (:attr:`needs_reference_copy`)."""
        yield

    @property
    def needs_reference_copy(self) -> bool:
        """Whether a KL reference needs its own frozen copy of the initial weights."""
        return True

    # -- engine and export --------------------------------------------------------------

    def sync_weights(self, engine: Any, *, skip_frozen: bool = False) -> None:
        """The trained weights into a rollout engine (collective)."""
        raise NotImplementedError

    def export(self, processor: Any, out_dir: str | Path, *, adapter: bool = True) -> Path:
        """The final HF directory (collective). With LoRA: the adapter directory (and the
        merged model beside it with ``lora.export_merged``), or with ``adapter=False`` the
        merged model alone (what a reward model exports)."""
        raise NotImplementedError
