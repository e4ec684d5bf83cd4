"""The loaders of the recipes that train on a data set (SFT, reward model, offline DPO)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightrft.data import StepCollator, build_dataloader
from lightrft.distributed import DistInfo


def step_loaders(
    dataset: Any,
    eval_dataset: Any,
    collate: Callable,
    d: Any,
    *,
    seed: int,
    dist: DistInfo,
    what: str,
    length: Callable[[Any], int] | None = None,
) -> tuple[Any, Any]:
    """``(loader, eval_loader)`` of a batch section ``d`` (:class:`~lightrft.sections.BatchConfig`)
    on this rank (``dist``: its data-parallel view). A training batch is one optimizer step's
    items, cut into micro-batches by :class:`~lightrft.data.StepCollator` (``length``: an item's
    tokens); the held-out loader (None without ``eval_dataset``) gives micro-batches. A
    ``dataset`` shorter than one step is refused, naming it (``what``: its items)."""
    accum = d.gradient_accumulation_steps
    kw = dict(seed=seed, rank=dist.rank, world_size=dist.world_size)
    loader = build_dataloader(
        dataset,
        batch_size=d.batch_size * accum,
        collate_fn=StepCollator(
            collate, d.batch_size, d.micro_batch_tokens, packing=d.packing, length=length
        ),
        drop_last=True,
        **kw,
    )
    eval_loader = None
    if eval_dataset is not None:
        eval_loader = build_dataloader(
            eval_dataset,
            batch_size=d.batch_size,
            shuffle=False,
            collate_fn=collate,
            **kw,
        )
    if len(loader) == 0:
        raise ValueError(
            f"dataset {d.dataset._component_} gives {len(dataset)} {what}, fewer than one step "
            f"needs: batch_size={d.batch_size} x gradient_accumulation_steps={accum} on each of "
            f"{dist.world_size} data-parallel rank(s); lower them, or add data"
        )
    return loader, eval_loader
