"""The base of every training strategy (see :mod:`lightrft.strategy`): the mesh for frozen
models, the interface recipes call and, as its implementation, the default strategy: FSDP2
(``fully_shard`` over a DeviceMesh; HSDP with ``shard_size`` / ``replicate_size``; plain tensors
in one process), optionally with LoRA adapters."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.config import instantiate
from lightrft.distributed import DistInfo, all_reduce_sum
from lightrft.engine.sync import sync_weights
from lightrft.models.lora import adapters_disabled, apply_lora
from lightrft.models.multimodal import check_towers, set_towers_trainable
from lightrft.models.parallel import build_mesh
from lightrft.models.sharded import load_parallel
from lightrft.models.ulysses import Ulysses, check_model, sp_groups
from lightrft.sections import OptimConfig, PolicyModelConfig, StrategyConfig
from lightrft.training.export import export_trained
from lightrft.training.optim import optimizer_step


class Strategy:
    """The base of every strategy (the mesh for frozen models, the interface recipes call) and
    the default one, FSDP2 (+ LoRA): the trained model is sharded like every other model of the
    run; ``offload: params`` keeps its shards, gradients and optimizer state in CPU memory."""

    def __init__(self, cfg: StrategyConfig, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.offload = cfg.offload == "params"
        if self.offload and not torch.distributed.is_initialized():
            # Refused before any model loads: FSDP2 (and so its offload) needs a process group.
            raise ValueError(
                "offload=params needs FSDP2 sharding, which needs a process group: launch the "
                "recipe with torchrun (lightrft run --nproc_per_node 1 ... on one device), or "
                "set offload=none"
            )

    @functools.cached_property
    def mesh(self):
        """The FSDP2 device mesh (None in one process); built on first use."""
        return build_mesh(self.cfg.shard_size, self.cfg.replicate_size, self.dist.device)

    # -- sequence parallelism -------------------------------------------------------------

    @functools.cached_property
    def sequence_parallel(self):
        """This rank's :class:`~lightrft.models.ulysses.Ulysses` SP group (``sequence_parallel:
        N`` > 1), else None; built on first use (collective: every rank asks at once). Pass it
        to the log-prob / loss funnel (``sequence_parallel=``)."""
        n = self.cfg.sequence_parallel
        if n == 1:
            return None
        group, rank = sp_groups(n)
        return Ulysses(group, n, rank)

    @property
    def data_dist(self) -> DistInfo:
        """The data-parallel view of this rank: the ranks of one SP group read the same samples,
        so data is split over ``world / sequence_parallel`` replicas (``dist`` without SP)."""
        n = self.cfg.sequence_parallel
        d = self.dist
        return DistInfo(d.rank // n, d.world_size // n, d.local_rank, d.device)

    @property
    def writes_shared(self) -> bool:
        """Whether this rank contributes the rows its SP group computed together to a sum
        over ranks (the group's first rank; every rank without SP)."""
        return self.dist.rank % self.cfg.sequence_parallel == 0

    def data_sum(self, value: float | torch.Tensor) -> float:
        """The sum over ranks of a value of this rank's samples (a token count), each SP
        group counted once: its ranks hold the same samples (collective)."""
        return all_reduce_sum(value, self.dist.device).item() / self.cfg.sequence_parallel

    def check_model(self, path: str, *, trust_remote_code: bool = False) -> None:
        """Refuse, before loading, a model this strategy cannot train (from its HF config
        only): sequence parallelism needs a supported attention and heads it can split."""
        if self.cfg.sequence_parallel == 1:
            return
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        check_model(config, self.cfg.sequence_parallel)

    # -- loading ------------------------------------------------------------------------

    def loading(self) -> dict[str, Any]:
        """Keyword arguments of ``load_parallel`` / ``load_reward_net_parallel`` for the
        trained model."""
        return {"mesh": self.mesh, "offload": self.offload}

    def load_policy(self, m: PolicyModelConfig) -> nn.Module:
        """The trained policy of a ``model:`` section, loaded as :meth:`loading` says: its
        vision / audio towers trainable as the section says, then :meth:`adapt` (LoRA). A tower
        the checkpoint lacks is refused first (again: a ``prepare`` step may have written it)."""
        check_towers(m)

        def prepare(model: nn.Module) -> nn.Module:
            set_towers_trainable(model, vision=m.train_vision_tower, audio=m.train_audio_tower)
            return self.adapt(model)

        return load_parallel(
            m.path, dtype=m.dtype, device=self.dist.device, trust_remote_code=m.trust_remote_code,
            prepare=prepare, activation_checkpointing=m.activation_checkpointing,
            compile=m.compile, **self.loading(),
        )  # fmt: skip

    def load_beside(self, path: str, m: PolicyModelConfig, prepare: Any = None, **kw: Any):
        """A model beside the policy (reference, teacher, critic) in ``m``'s dtype, FSDP2-sharded
        over :attr:`mesh` whatever the strategy; without ``prepare``: frozen, in eval mode."""
        model = load_parallel(
            path, dtype=m.dtype, device=self.dist.device, trust_remote_code=m.trust_remote_code,
            prepare=prepare or (lambda x: x.requires_grad_(False)), **kw, mesh=self.mesh,
        )  # fmt: skip
        return model if prepare is not None else model.eval()

    def adapt(self, model: nn.Module, apply: Any = None) -> nn.Module:
        """The trained model's last step before sharding: LoRA adapters (``apply``: how to put
        them on this kind of model; default the causal-LM one) when configured."""
        return model if self.cfg.lora is None else (apply or apply_lora)(model, self.cfg.lora)

    # -- training -----------------------------------------------------------------------

    def setup(
        self, model: nn.Module, optim: OptimConfig, *, micro_batch_size: int, accum: int
    ) -> torch.optim.Optimizer:
        """Take the trained model and build its optimizer (``optim.optimizer`` on its trainable
        parameters; :meth:`step` clips at ``optim.clip_grad_norm``); returns the optimizer."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.model, self.optimizer = model, instantiate(optim.optimizer, trainable)
        self.clip_grad_norm = optim.clip_grad_norm
        _ = self.sequence_parallel  # the SP groups: collective, so made here on every rank
        return self.optimizer

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward; the loss is already normalised for the whole step."""
        loss.backward()

    def step(self) -> float:
        """End the optimizer step: clip, step, zero the gradients; the norm before clipping."""
        return optimizer_step(self.model, self.optimizer, self.clip_grad_norm)

    def checkpoint_state(self) -> dict[str, Any]:
        """``models`` (and ``optimizers``) as :meth:`Checkpointer.save` takes them."""
        return {"models": self.model, "optimizers": self.optimizer}

    def reference(self) -> contextlib.AbstractContextManager:
        """The trained model as the frozen reference policy (LoRA: adapters off); without
        LoRA a recipe loads a frozen copy (:attr:`needs_reference_copy`)."""
        return adapters_disabled(self.model)  # a no-op for a full model

    @property
    def needs_reference_copy(self) -> bool:
        """Whether a KL reference needs its own frozen copy of the initial weights."""
        return self.cfg.lora is None

    # -- engine and export --------------------------------------------------------------

    def sync_weights(self, engine: Any, *, skip_frozen: bool = False) -> None:
        """The trained weights into a rollout engine (collective)."""
        sync_weights(self.model, engine, skip_frozen=skip_frozen)

    def export(self, processor: Any, out_dir: str | Path, *, adapter: bool = True) -> Path:
        """The final HF directory (collective). With LoRA: the adapter directory (and the
        merged model beside it with ``lora.export_merged``), or with ``adapter=False`` the
        merged model alone (what a reward model exports)."""
        return export_trained(self.model, processor, out_dir, self.cfg.lora, adapter=adapter)
