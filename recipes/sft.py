"""Supervised fine-tuning (SFT): the warm start before RL.

    lightrft run sft --config tiny/arith_sft
    lightrft run --nproc_per_node 8 sft --config <config> optimizer.lr=1e-5

Loss on completion (assistant) tokens only, summed over tokens and divided by the number of loss
tokens of the whole optimizer step (all micro-batches, all ranks), so gradient accumulation and
data parallelism give the gradient of one big batch. The cross-entropy comes from the fused linear
log-prob kernel over the final hidden states: the [tokens x vocab] logits never exist.

One self-contained file: copy it (`lightrft cp sft my_sft.py`), edit it, run the copy.
"""

from __future__ import annotations

import sys
import time
from typing import Literal

import torch
from omegaconf import DictConfig, OmegaConf

from lightrft import config
from lightrft.config import Component
from lightrft.data import build_dataloader, pack_or_pad_collator
from lightrft.kernels import causal_lm_cross_entropy
from lightrft.models import load_causal_lm, load_tokenizer, parallelize
from lightrft.training import (
    Checkpointer,
    MetricLogger,
    ProgressBar,
    check_output_dir,
    clip_grad_norm,
    export_hf,
    peak_memory,
    reset_peak_memory,
    warmup_cosine_scheduler,
)
from lightrft.training.distributed import all_reduce_sum, barrier, destroy, init_distributed

CONFIG_SCHEMA = {
    "output_dir": str,
    "seed": int | None,
    "device": Literal["cpu", "cuda"] | None,
    "prepare": list[Component] | None,  # run once on rank 0 before anything loads
    "model": {
        "path": str,
        "dtype": Literal["float32", "bfloat16", "float16"] | None,
        "trust_remote_code": bool | None,
        "activation_checkpointing": bool | None,
        "compile": bool | None,
    },
    "dataset": Component,
    "eval_dataset": Component | None,
    "packing": bool | None,  # several samples per row, positions reset per sample
    "max_tokens_per_row": int | None,  # packing only; default: one row per micro-batch
    "batch_size": int,  # samples (or packed rows) per rank per micro-batch
    "gradient_accumulation_steps": int | None,
    "epochs": int,
    "max_steps": int | None,
    "optimizer": Component,
    "lr_scheduler": {"warmup_steps": int | None, "min_lr_ratio": float | None},
    "clip_grad_norm": float | None,
    "log_every": int | None,
    "eval_every": int | None,
    "save_every": int | None,
    "keep_last": int | None,
    "resume": bool | None,
    "metrics": {
        "tensorboard": bool | None,
        "wandb": bool | dict | None,
    },  # wandb: True or init kwargs
}


class SFTRecipe:
    """Read and check the config, build everything in ``setup``, train, clean up."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.seed = cfg.get("seed", 0)
        self.batch_size = cfg.batch_size
        self.accum = cfg.get("gradient_accumulation_steps", 1)
        self.epochs = cfg.epochs
        self.max_steps = cfg.get("max_steps")
        self.log_every = cfg.get("log_every", 1)
        self.eval_every = cfg.get("eval_every")
        self.max_grad_norm = cfg.get("clip_grad_norm")
        for key, value in (
            ("batch_size", self.batch_size),
            ("epochs", self.epochs),
            ("gradient_accumulation_steps", self.accum),
            ("log_every", self.log_every),
        ):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or null, got {self.max_steps}")
        self.output_dir = check_output_dir(cfg.output_dir)
        self.dist = init_distributed(cfg.get("device"))
        self.checkpointer = Checkpointer(
            self.output_dir, keep_last=cfg.get("keep_last", 2), every_n_steps=cfg.get("save_every")
        )
        if cfg.get("resume", False) and self.checkpointer.latest() is None:
            raise ValueError(f"resume=true but no checkpoint found in {self.checkpointer.root}")

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        torch.manual_seed(self.seed)
        if self.dist.is_main:
            for node in cfg.get("prepare") or []:
                config.instantiate(node)
        barrier()
        self.tokenizer = load_tokenizer(
            cfg.model.path, trust_remote_code=cfg.model.get("trust_remote_code", False)
        )
        model = load_causal_lm(
            cfg.model.path,
            dtype=cfg.model.get("dtype", "float32"),
            device=self.dist.device,
            trust_remote_code=cfg.model.get("trust_remote_code", False),
        )
        self.model = parallelize(
            model,
            activation_checkpointing=cfg.model.get("activation_checkpointing", False),
            compile=cfg.model.get("compile", False),
        )
        self.optimizer = config.instantiate(cfg.optimizer, self.model.parameters())

        self.dataset = config.instantiate(cfg.dataset, self.tokenizer)
        collate = pack_or_pad_collator(
            self.tokenizer,
            packing=cfg.get("packing", False),
            max_tokens=cfg.get("max_tokens_per_row"),
        )
        self.loader = build_dataloader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=True,
            seed=self.seed,
            collate_fn=collate,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            drop_last=True,
        )
        self.eval_loader = None
        if cfg.get("eval_dataset") is not None:
            eval_ds = config.instantiate(cfg.eval_dataset, self.tokenizer)
            self.eval_loader = build_dataloader(
                eval_ds,
                batch_size=self.batch_size,
                shuffle=False,
                seed=self.seed,
                collate_fn=collate,
                rank=self.dist.rank,
                world_size=self.dist.world_size,
                drop_last=False,
            )
        steps_per_epoch = len(self.loader) // self.accum
        if steps_per_epoch == 0:
            raise ValueError(
                f"dataset {cfg.dataset._component_} gives {len(self.loader)} micro-batches per "
                f"rank per epoch, fewer than gradient_accumulation_steps={self.accum}: lower "
                "batch_size or gradient_accumulation_steps, or add data"
            )
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = steps_per_epoch * self.epochs
        if self.max_steps is not None:
            self.total_steps = min(self.total_steps, self.max_steps)
        sched = cfg.get("lr_scheduler") or {}
        self.scheduler = warmup_cosine_scheduler(
            self.optimizer,
            warmup_steps=sched.get("warmup_steps", 0),
            total_steps=self.total_steps,
            min_lr_ratio=sched.get("min_lr_ratio", 0.0),
        )

        self.step, self.epoch, self.last_eval_step = 0, 0, None
        if cfg.get("resume", False):
            state = self.checkpointer.load_latest(
                models=self.model,
                optimizers=self.optimizer,
                schedulers=self.scheduler,
                dataloaders=self.loader,
                required=True,
            )
            self.step, self.epoch = state.step, state.extra["epoch"]
        metrics_cfg = cfg.get("metrics") or {}
        self.logger = MetricLogger(
            self.output_dir,
            tensorboard=metrics_cfg.get("tensorboard", True),
            wandb=metrics_cfg.get("wandb", False) or False,
            config=OmegaConf.to_container(cfg, resolve=True),
            resume_step=self.step if cfg.get("resume", False) else None,
        )
        stats = getattr(self.dataset, "stats", None)
        if stats:
            self.logger.log(self.step, {f"data/{k}": v for k, v in stats.items()})

    # ------------------------------------------------------------------ steps

    def _loss(self, batch: dict[str, torch.Tensor], divisor: float) -> torch.Tensor:
        """Summed next-token NLL of the loss tokens divided by ``divisor``."""
        dev = self.dist.device
        input_ids = batch["input_ids"].to(dev)  # [B, T]
        targets = batch["labels"][:, 1:].to(dev)  # [B, T-1], -100 where no loss
        mask = batch.get("attention_mask")
        return causal_lm_cross_entropy(
            self.model,
            input_ids,
            targets=targets,
            num_tokens=divisor,
            position_ids=batch["position_ids"].to(dev),
            attention_mask=None if mask is None else mask.to(dev),
        )

    def _micro_batches(self):
        """Micro-batches of the current epoch from the (resumable) dataloader position."""
        self.loader.sampler.set_epoch(self.epoch)
        yield from self.loader

    def train(self) -> None:
        model, opt = self.model, self.optimizer
        bar = ProgressBar(self.total_steps, initial=self.step, desc="sft")
        if self.step == 0:
            self._log_eval()
        tokens_seen, t0 = 0, time.perf_counter()
        reset_peak_memory(self.dist.device)
        while self.step < self.total_steps and self.epoch < self.epochs:
            pending: list[dict] = []
            for batch in self._micro_batches():
                pending.append(batch)
                if len(pending) < self.accum:
                    continue
                # Normalise by the loss tokens of the whole step on all ranks; FSDP averages
                # gradients over ranks, so multiply back by the world size.
                n_tokens = all_reduce_sum(sum(_loss_tokens(b) for b in pending)).item()
                divisor = max(n_tokens, 1.0) / self.dist.world_size
                loss_sum = 0.0
                for b in pending:
                    loss = self._loss(b, divisor)
                    loss.backward()
                    loss_sum += loss.item() * divisor
                    tokens_seen += int(b["input_ids"].numel())
                pending = []
                grad_norm = (
                    clip_grad_norm(model, self.max_grad_norm)
                    if self.max_grad_norm
                    else float("nan")
                )
                opt.step()
                opt.zero_grad(set_to_none=True)
                self.scheduler.step()
                self.step += 1
                loss = all_reduce_sum(loss_sum).item() / max(n_tokens, 1.0)
                if self.step % self.log_every == 0 or self.step == self.total_steps:
                    elapsed = time.perf_counter() - t0
                    tps = all_reduce_sum(tokens_seen).item() / max(elapsed, 1e-9)
                    metrics = {
                        "train/loss": loss,
                        "train/grad_norm": grad_norm,
                        "train/lr": self.scheduler.get_last_lr()[0],
                        "train/tokens_per_s": tps,
                        "train/epoch": self.epoch,
                        **peak_memory(self.dist.device),
                    }
                    self.logger.log(self.step, metrics)
                    tokens_seen, t0 = 0, time.perf_counter()
                bar.update(1, loss=loss)
                if self.eval_every and self.step % self.eval_every == 0:
                    self._log_eval()
                if self.checkpointer.should_save(self.step):
                    self._save()
                if self.step >= self.total_steps:
                    break
            else:
                self.epoch += 1
                continue
            break
        bar.close()
        if self.last_eval_step != self.step:
            self._log_eval()
        export_hf(self.model, self.tokenizer, self.output_dir / "final")

    def _save(self) -> None:
        self.checkpointer.save(
            self.step,
            models=self.model,
            optimizers=self.optimizer,
            schedulers=self.scheduler,
            dataloaders=self.loader,
            extra={"epoch": self.epoch},
        )

    def _log_eval(self) -> None:
        if self.eval_loader is not None:
            loss = self.evaluate()
            self.logger.log(self.step, {"eval/loss": loss})
            if self.dist.is_main:
                print(f"step {self.step}: eval/loss {loss:.4f}", flush=True)
        self.last_eval_step = self.step

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        nll, count = 0.0, 0
        for batch in self.eval_loader:
            nll += self._loss(batch, divisor=1.0).item()
            count += _loss_tokens(batch)
        self.model.train()
        return all_reduce_sum(nll).item() / max(all_reduce_sum(count).item(), 1.0)

    def cleanup(self) -> None:
        self.logger.close()
        destroy()


def _loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@config.parse(schema=CONFIG_SCHEMA)
def recipe_main(cfg: DictConfig) -> None:
    recipe = SFTRecipe(cfg)
    recipe.setup(cfg)
    try:
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
