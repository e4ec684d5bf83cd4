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

import dataclasses
import sys
import time
from typing import Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from lightrft import config
from lightrft.config import Component
from lightrft.data import StepCollator, build_dataloader, pack_or_pad_collator
from lightrft.data.modality import is_multimodal
from lightrft.distributed import (
    all_reduce_sum,
    barrier,
    destroy,
    even_micro_batches,
    init_distributed,
)
from lightrft.kernels import causal_lm_cross_entropy
from lightrft.models import (
    checkpoint_is_audio_language,
    checkpoint_is_vision_language,
    load_processor,
    load_tokenizer,
    set_towers_trainable,
)
from lightrft.models.deepspeed import DEEPSPEED_SCHEMA, DeepSpeedOptions, deepspeed_options
from lightrft.models.loading import DTYPES
from lightrft.models.lora import (
    LORA_SCHEMA,
    LoraOptions,
    apply_lora,
    lora_options,
)
from lightrft.models.parallel import MeshOptions, build_mesh, mesh_config, strategy_option
from lightrft.models.sharded import load_parallel
from lightrft.training import (
    Checkpointer,
    MetricLogger,
    Preemption,
    ProgressBar,
    backward,
    check_output_dir,
    check_resume,
    export_trained,
    optimizer_step,
    peak_memory,
    reset_peak_memory,
    warmup_cosine_scheduler,
)

CONFIG_SCHEMA = {
    "output_dir": str,
    "seed": int | None,
    "device": Literal["cpu", "cuda"] | None,
    "strategy": str | None,  # fsdp2 (default) | deepspeed (docs/strategies.md)
    "deepspeed": DEEPSPEED_SCHEMA,  # strategy=deepspeed only: ZeRO stage, offload
    "shard_size": int | None,  # HSDP: shard within groups of this many ranks (docs/strategies.md)
    "replicate_size": int | None,  # HSDP: number of replica groups
    "prepare": list[Component] | None,  # run once on rank 0 before anything loads
    "model": {
        "path": str,
        "dtype": Literal[tuple(DTYPES)] | None,
        "trust_remote_code": bool | None,
        "activation_checkpointing": bool | None,
        "compile": bool | None,
        "train_vision_tower": bool | None,  # vision-language models: default frozen
        "train_audio_tower": bool | None,  # audio-language models: default frozen
    },
    "lora": LORA_SCHEMA,  # absent / null: full fine-tune (docs/strategies.md)
    "dataset": Component,
    "eval_dataset": Component | None,
    "packing": bool | None,  # several samples per row, positions reset per sample
    "max_tokens_per_row": int | None,  # packing only; default: one row per micro-batch
    "batch_size": int,  # samples (or packed rows) per rank per micro-batch
    "gradient_accumulation_steps": int | None,  # a step: batch_size x this many samples per rank
    "micro_batch_tokens": int | None,  # token budget: a step's samples by length, cut by tokens
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
    "overwrite": bool | None,
    "resume_override_lr": bool | None,
    "metrics": {
        "tensorboard": bool | None,
        "wandb": bool | dict | None,
    },  # wandb: True or init kwargs
}


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` when present and not null, else ``default``: null means "use the default"."""
    if node is None:
        return default
    value = node.get(key)
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class SFTOptions:
    """Everything the recipe reads from the config, every default applied, every cross-field
    rule checked (built by :func:`build_options`; ``_component_`` nodes stay in ``cfg``)."""

    output_dir: str
    model_path: str
    batch_size: int  # samples (or packed rows) per rank per micro-batch
    epochs: int
    seed: int = 0
    device: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    train_vision_tower: bool = False
    train_audio_tower: bool = False
    packing: bool = False
    max_tokens_per_row: int | None = None
    accum: int = 1  # gradient_accumulation_steps
    micro_batch_tokens: int | None = None  # token budget per micro-batch; None: rows only
    max_steps: int | None = None
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_grad_norm: float | None = None
    log_every: int = 1
    eval_every: int | None = None
    save_every: int | None = None
    keep_last: int = 2
    resume: bool = False
    overwrite: bool = False
    resume_override_lr: bool = False
    tensorboard: bool = True
    wandb: bool | dict = False
    lora: LoraOptions | None = None
    strategy: str = "fsdp2"
    deepspeed: DeepSpeedOptions | None = None  # set exactly when strategy == "deepspeed"
    mesh: MeshOptions = MeshOptions()


def build_options(cfg: DictConfig) -> SFTOptions:
    """The config as a frozen :class:`SFTOptions`: defaults and cross-field checks, no side
    effect. ``lightrft validate`` and ``lightrft run`` both call it."""
    model, sched, metrics = cfg.model, cfg.get("lr_scheduler"), cfg.get("metrics")
    opts = SFTOptions(
        output_dir=cfg.output_dir,
        model_path=model.path,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        seed=_get(cfg, "seed", 0),
        device=_get(cfg, "device"),
        dtype=_get(model, "dtype", "float32"),
        trust_remote_code=_get(model, "trust_remote_code", False),
        activation_checkpointing=_get(model, "activation_checkpointing", False),
        compile=_get(model, "compile", False),
        train_vision_tower=_get(model, "train_vision_tower", False),
        train_audio_tower=_get(model, "train_audio_tower", False),
        packing=_get(cfg, "packing", False),
        max_tokens_per_row=_get(cfg, "max_tokens_per_row"),
        accum=_get(cfg, "gradient_accumulation_steps", 1),
        micro_batch_tokens=_get(cfg, "micro_batch_tokens"),
        max_steps=_get(cfg, "max_steps"),
        warmup_steps=_get(sched, "warmup_steps", 0),
        min_lr_ratio=_get(sched, "min_lr_ratio", 0.0),
        clip_grad_norm=_get(cfg, "clip_grad_norm"),
        log_every=_get(cfg, "log_every", 1),
        eval_every=_get(cfg, "eval_every"),
        save_every=_get(cfg, "save_every"),
        keep_last=_get(cfg, "keep_last", 2),
        resume=_get(cfg, "resume", False),
        overwrite=_get(cfg, "overwrite", False),
        resume_override_lr=_get(cfg, "resume_override_lr", False),
        tensorboard=_get(metrics, "tensorboard", True),
        wandb=_get(metrics, "wandb", False),
        lora=lora_options(cfg.get("lora")),
        strategy=strategy_option(cfg.get("strategy")),
        mesh=mesh_config(cfg.get("shard_size"), cfg.get("replicate_size")),
    )
    opts = dataclasses.replace(
        opts, deepspeed=deepspeed_options(cfg.get("deepspeed"), opts.strategy)
    )
    for key, value in (
        ("batch_size", opts.batch_size),
        ("epochs", opts.epochs),
        ("gradient_accumulation_steps", opts.accum),
        ("log_every", opts.log_every),
        ("max_steps", opts.max_steps),
        ("eval_every", opts.eval_every),
        ("save_every", opts.save_every),
        ("keep_last", opts.keep_last),
        ("max_tokens_per_row", opts.max_tokens_per_row),
        ("micro_batch_tokens", opts.micro_batch_tokens),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    if opts.max_tokens_per_row is not None and not opts.packing:
        raise ValueError("max_tokens_per_row applies only with packing=true")
    if opts.warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {opts.warmup_steps}")
    if opts.max_steps is not None and opts.warmup_steps > opts.max_steps:
        raise ValueError(
            f"lr_scheduler.warmup_steps={opts.warmup_steps} is more than max_steps="
            f"{opts.max_steps}: the schedule would never reach its peak"
        )
    if not 0 <= opts.min_lr_ratio <= 1:
        raise ValueError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {opts.min_lr_ratio}")
    if not str(opts.output_dir).strip():
        raise ValueError("output_dir is not set: give the run a directory (output_dir=...)")
    _check_vision_tower(opts)
    if opts.deepspeed is not None:
        for key, value in (
            ("lora", opts.lora),
            ("shard_size", opts.mesh.shard_size),
            ("replicate_size", opts.mesh.replicate_size),
        ):
            if value is not None:
                raise ValueError(
                    f"{key} is not supported with strategy=deepspeed yet; remove it or use "
                    "strategy=fsdp2"
                )
    checkpoints = Checkpointer(opts.output_dir, keep_last=opts.keep_last)  # reads only
    if opts.resume and checkpoints.latest() is None:
        raise ValueError(
            f"resume=true but no checkpoint found in {checkpoints.root}; a run stopped before "
            "its first checkpoint starts over with overwrite=true"
        )
    if opts.resume and opts.overwrite:
        raise ValueError("resume=true and overwrite=true contradict each other; choose one")
    if opts.resume:
        check_resume(opts.output_dir, opts.lora is not None, ("model",))
    return opts


def _check_vision_tower(opts: SFTOptions) -> None:
    """``model.train_vision_tower`` needs a vision-language model, ``model.train_audio_tower``
    an audio-language one (read from config.json; a checkpoint a ``prepare`` step writes is
    checked again in setup, before loading)."""
    if opts.train_vision_tower and checkpoint_is_vision_language(opts.model_path) is False:
        raise ValueError(
            f"model.train_vision_tower=true but {opts.model_path} is not a vision-language model "
            "(its config.json has no vision_config)"
        )
    if opts.train_audio_tower and checkpoint_is_audio_language(opts.model_path) is False:
        raise ValueError(
            f"model.train_audio_tower=true but {opts.model_path} is not an audio-language model "
            "(its config.json has no audio_config)"
        )


class SFTRecipe:
    """Build everything from the validated options in ``setup``, train, clean up."""

    def __init__(self, cfg: DictConfig, opts: SFTOptions):
        self.cfg, self.opts = cfg, opts
        self.seed = opts.seed
        self.batch_size = opts.batch_size
        self.accum = opts.accum
        self.epochs = opts.epochs
        self.max_steps = opts.max_steps
        self.log_every = opts.log_every
        self.eval_every = opts.eval_every
        self.max_grad_norm = opts.clip_grad_norm
        # Side effects start here, after build_options has accepted the config.
        self.output_dir = check_output_dir(
            opts.output_dir, resume=opts.resume, overwrite=opts.overwrite
        )
        self.dist = init_distributed(opts.device)
        self.checkpointer = Checkpointer(
            self.output_dir, keep_last=opts.keep_last, every_n_steps=opts.save_every
        )

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        torch.manual_seed(self.seed)
        if self.dist.is_main:
            for node in cfg.get("prepare") or []:
                config.instantiate(node)
        barrier()
        o = self.opts
        _check_vision_tower(o)  # the checkpoint exists now, whatever prepare wrote

        def prepare(model: torch.nn.Module) -> torch.nn.Module:
            # Before sharding: freeze (or not) the vision / audio towers, add LoRA adapters.
            if is_multimodal(model.config):
                set_towers_trainable(model, vision=o.train_vision_tower, audio=o.train_audio_tower)
            return apply_lora(model, o.lora) if o.lora else model

        # Under torchrun each rank builds the model on the meta device and reads only its
        # shards (lightrft.models.sharded); one process loads it whole.
        # DeepSpeed: the whole model on every rank, partitioned by deepspeed.initialize below.
        ds = o.deepspeed is not None
        self.model = load_parallel(
            o.model_path,
            dtype=o.dtype,
            device=self.dist.device,
            trust_remote_code=o.trust_remote_code,
            prepare=prepare,
            mesh=None if ds else build_mesh(o.mesh, self.dist.device),
            activation_checkpointing=o.activation_checkpointing,
            compile=o.compile,
            shard=False if ds else None,
        )
        # A vision- or audio-language model's datasets take its processor (images / audio +
        # text); the collator and export use the tokenizer / processor the same way for all.
        if is_multimodal(self.model.config):
            self.processor = load_processor(o.model_path, trust_remote_code=o.trust_remote_code)
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = load_tokenizer(o.model_path, trust_remote_code=o.trust_remote_code)
            self.processor = self.tokenizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, trainable)
        # strategy=deepspeed: the engine owns backward / step / zero_grad; self.model stays the
        # HF module (its forward runs under the engine's ZeRO hooks).
        self.ds_engine = None
        if ds:
            from lightrft.models import deepspeed as lds

            self.ds_engine = lds.initialize(
                self.model,
                self.optimizer,
                o.deepspeed,
                micro_batch_size=self.batch_size,
                accum=self.accum,
                clip_grad_norm=self.max_grad_norm,
            )

        self.dataset = config.instantiate(cfg.dataset, self.processor)
        collate = pack_or_pad_collator(
            self.tokenizer,
            packing=o.packing,
            max_tokens=o.max_tokens_per_row,
        )
        # One loader batch is one optimizer step's samples on this rank, collated into its
        # micro-batches: batch_size rows each, or by the token budget (shortest first).
        self.loader = build_dataloader(
            self.dataset,
            batch_size=self.batch_size * self.accum,
            shuffle=True,
            seed=self.seed,
            collate_fn=StepCollator(
                collate, self.batch_size, o.micro_batch_tokens, packing=o.packing
            ),
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            drop_last=True,
        )
        self.eval_loader = None
        if cfg.get("eval_dataset") is not None:
            eval_ds = config.instantiate(cfg.eval_dataset, self.processor)
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
        steps_per_epoch = len(self.loader)
        if steps_per_epoch == 0:
            raise ValueError(
                f"dataset {cfg.dataset._component_} gives {len(self.dataset)} samples, fewer "
                f"than one step needs: batch_size={self.batch_size} x "
                f"gradient_accumulation_steps={self.accum} on each of {self.dist.world_size} "
                "rank(s); lower them, or add data"
            )
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = steps_per_epoch * self.epochs
        if self.max_steps is not None:
            self.total_steps = min(self.total_steps, self.max_steps)
        self.scheduler = warmup_cosine_scheduler(
            self.optimizer,
            warmup_steps=o.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=o.min_lr_ratio,
        )

        self.step, self.epoch, self.last_eval_step = 0, 0, None
        if o.resume:
            state = self.checkpointer.load_latest(
                **self._trained(),
                schedulers=self.scheduler,
                dataloaders=self.loader,
                required=True,
                config=OmegaConf.to_container(cfg, resolve=True),
                override_lr=o.resume_override_lr,
            )
            self.step, self.epoch = state.step, state.extra["epoch"]
        self.logger = MetricLogger(
            self.output_dir,
            tensorboard=o.tensorboard,
            wandb=o.wandb,
            config=OmegaConf.to_container(cfg, resolve=True),
            resume_step=self.step if o.resume else None,
        )
        stats = getattr(self.dataset, "stats", None)
        if stats and not o.resume:
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
            images=batch.get("images"),  # ImageInputs of the batch's samples, in token order
            audios=batch.get("audios"),  # AudioInputs of the batch's samples, in token order
        )

    def _steps(self):
        """The current epoch's steps from the (resumable) dataloader position: this rank's
        micro-batches and how many are real. With a token budget the counts differ across ranks:
        the ranks with fewer repeat their last one with zero weight (``even_micro_batches``)."""
        self.loader.set_epoch(self.epoch)
        for micro in self.loader:
            if self.opts.micro_batch_tokens is not None:
                yield even_micro_batches(micro, self.dist.device)
            else:
                yield micro, len(micro)

    def train(self) -> None:
        model, opt = self.model, self.optimizer
        bar = ProgressBar(self.total_steps, initial=self.step, desc="sft")
        if self.step == 0:
            self._log_eval()
        tokens_seen, t0, logged_step = 0, time.perf_counter(), self.step
        reset_peak_memory(self.dist.device)
        with Preemption() as preempt:
            while self.step < self.total_steps and self.epoch < self.epochs:
                for micro, n_real in self._steps():
                    # Normalise by the loss tokens of the whole step on all ranks; FSDP averages
                    # gradients over ranks, so multiply back by the world size.
                    n_tokens = all_reduce_sum(sum(_loss_tokens(b) for b in micro[:n_real])).item()
                    divisor = max(n_tokens, 1.0) / self.dist.world_size
                    loss_sum = 0.0
                    for i, b in enumerate(micro):
                        loss = self._loss(b, divisor) * (1.0 if i < n_real else 0.0)
                        backward(loss, self.ds_engine)
                        loss_sum += loss.item() * divisor
                        tokens_seen += int(b["input_ids"].numel()) if i < n_real else 0
                    grad_norm = optimizer_step(model, opt, self.max_grad_norm, self.ds_engine)
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
                            "time/step": elapsed / (self.step - logged_step),
                            "train/epoch": self.epoch,
                            **peak_memory(self.dist.device),
                        }
                        self.logger.log(self.step, metrics)
                        tokens_seen, t0, logged_step = 0, time.perf_counter(), self.step
                    bar.update(1, loss=loss)
                    if self.eval_every and self.step % self.eval_every == 0:
                        self._log_eval()
                    if self.checkpointer.should_save(self.step):
                        self._save()
                    if preempt.stop_requested():
                        if not self.checkpointer.should_save(self.step):
                            self._save()
                        preempt.exit(self.checkpointer.latest())
                    if self.step >= self.total_steps:
                        break
                else:
                    self.epoch += 1
                    continue
                break
        bar.close()
        if self.last_eval_step != self.step:
            self._log_eval()
        if self.ds_engine is not None:
            from lightrft.models.deepspeed import export_hf_engine

            export_hf_engine(self.ds_engine, self.processor, self.output_dir / "final")
        else:
            export_trained(self.model, self.processor, self.output_dir / "final", self.opts.lora)

    def _trained(self) -> dict[str, Any]:
        """What a checkpoint holds of the trained model: the model and its optimizer, or under
        strategy=deepspeed the engine (which writes both in its own format)."""
        if self.ds_engine is not None:
            return {"models": self.ds_engine}
        return {"models": self.model, "optimizers": self.optimizer}

    def _save(self) -> None:
        self.checkpointer.save(
            self.step,
            **self._trained(),
            schedulers=self.scheduler,
            dataloaders=self.loader,
            extra={"epoch": self.epoch},
            config=OmegaConf.to_container(self.cfg, resolve=True),
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

    def cleanup(self, clean: bool = True) -> None:
        self.logger.close()
        destroy(clean)


def _loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: SFTOptions) -> None:
    recipe = SFTRecipe(cfg, opts)
    recipe.setup(cfg)
    try:
        recipe.train()
    except BaseException:
        recipe.cleanup(clean=False)  # no barrier: a peer may be stuck or gone
        raise
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
