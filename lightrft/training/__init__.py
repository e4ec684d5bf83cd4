"""Training utilities shared by the recipes: checkpoints, the final export, metrics, LR schedule.

Submodules are imported on first use of a name, so ``import lightrft.training`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "checkpoint",
    "CheckpointState": "checkpoint",
    "check_resume": "checkpoint",
    "export_trained": "export",
    "ExportSpec": "export",
    "MetricLogger": "metrics",
    "ProgressBar": "metrics",
    "PhaseTimer": "metrics",
    "Throughput": "metrics",
    "tokens_per_second": "metrics",
    "peak_memory": "metrics",
    "reset_peak_memory": "metrics",
    "reduce_metrics": "metrics",
    "MetricAccumulator": "metrics",
    "read_metrics": "metrics",
    "warmup_cosine_lr_ratio": "optim",
    "warmup_cosine_scheduler": "optim",
    "lr_scheduler": "optim",
    "clip_grad_norm": "optim",
    "cpu_offload_optimizer": "optim",
    "optimizer_step": "optim",
    "check_output_dir": "outputs",
    "Preemption": "preemption",
    "CheckpointSaveError": "checkpoint",
    "ALLOWED_CHANGES": "resume",
    "release_output_dir": "outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightrft.training' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightrft.training.{module}"), name)
