"""DeepSpeed ZeRO-1/2/3 (± CPU offload) for the trained model (``strategy: deepspeed``, the
``deepspeed`` extra). The model loads whole on every rank and ``deepspeed.initialize``
partitions it; the engine owns backward, the optimizer step and the checkpoint of the model and
its optimizer. Frozen models beside it stay FSDP2 (:meth:`Strategy.load_beside`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightrft.models import deepspeed as ds
from lightrft.strategy.base import Strategy


class DeepSpeedStrategy(Strategy):
    """The model whole on every rank until ``deepspeed.initialize`` partitions it."""

    def loading(self) -> dict[str, Any]:
        return {"mesh": None, "shard": False}

    def setup(self, model, optim, *, micro_batch_size, accum) -> torch.optim.Optimizer:
        sizes = dict(micro_batch_size=micro_batch_size, accum=accum)
        optimizer = super().setup(model, optim, **sizes)
        self.engine = ds.initialize(
            model, optimizer, self.cfg.deepspeed, **sizes, clip_grad_norm=optim.clip_grad_norm
        )
        return optimizer

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already normalised for the whole step: no division by an accumulation
        # count (DeepSpeed's unmanaged accumulation).
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"models": self.engine}  # it writes the model and its optimizer in its own format

    def sync_weights(self, engine: Any, *, skip_frozen: bool = False) -> None:
        ds.sync_weights(self.engine, engine)

    def export(self, processor: Any, out_dir: str | Path, *, adapter: bool = True) -> Path:
        return ds.export_hf_engine(self.engine, processor, out_dir)
