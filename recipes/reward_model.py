"""Reward-model training: a scalar (or multi-head) reward model from preference pairs.

    lightrft run reward_model --config tiny/rlhf_rm
    lightrft run --nproc_per_node 8 reward_model --config <config> optimizer.lr=5e-6

The model is the HF ``*ForSequenceClassification`` of the backbone's type (a causal LM checkpoint
gives its body; the head is new) wrapped in :class:`lightrft.models.reward.RewardNet`: pooling
(last real token, mean or attention; optionally a middle layer's hidden state) and one output per
named head. Every item of a micro-batch (a chosen response and one or more rejected ones) is scored
by the head it is labelled for, and only that head gets its gradient. A cost head (Safe-RLHF) is a
head listed in ``model.cost_heads``: its chosen response is the one with the lower cost, and the
safety-sign term pushes safe responses below 0 and unsafe ones above. ``model.pooling:
likelihood`` keeps the causal LM whole instead: the score is the mean log-probability of the
response tokens under its own LM head (plus the EOS after a plain-text response), optionally with
the chosen responses' NLL in the loss (``loss.nll_coef``).

The loss is summed over items and divided by the items of the whole optimizer step (all
micro-batches, all ranks), so accumulation and data parallelism give the gradient of one batch.
Evaluation on the held-out split logs pairwise accuracy, mean margin and reward mean / std per
head; the final export (``<output_dir>/final``) is an HF classifier directory (a causal LM one
for the likelihood pooling) whose ``config.json`` carries those statistics
(``lightrft_reward``), which ``lightrft.rewards.RewardModel(normalize=true)`` uses.

One self-contained file: copy it (`lightrft cp reward_model my_rm.py`), edit it, run the copy.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from lightrft import config
from lightrft.algorithms.reward_losses import (
    pairwise_stats,
    preference_loss,
    safety_sign_loss,
)
from lightrft.config import Component, ConfigError
from lightrft.data import StepCollator, build_dataloader
from lightrft.data.preference import PreferenceCollator
from lightrft.distributed import (
    all_reduce_sum,
    barrier,
    destroy,
    even_micro_batches,
    init_distributed,
)
from lightrft.models import load_tokenizer
from lightrft.models.deepspeed import DEEPSPEED_SCHEMA, DeepSpeedOptions, deepspeed_options
from lightrft.models.export import export_hf
from lightrft.models.loading import DTYPES
from lightrft.models.lora import (
    LORA_SCHEMA,
    LoraOptions,
    apply_backbone_lora,
    lora_options,
)
from lightrft.models.multimodal import checkpoint_is_multimodal, load_processor
from lightrft.models.parallel import strategy_option
from lightrft.models.reward import CONFIG_KEY, POOLINGS, load_reward_net_parallel
from lightrft.training import (
    Checkpointer,
    MetricLogger,
    ProgressBar,
    backward,
    check_output_dir,
    check_resume,
    export_merged,
    optimizer_step,
    peak_memory,
    reset_peak_memory,
    warmup_cosine_scheduler,
)

LossType = Literal["bradley_terry", "log_exp", "hps"]

CONFIG_SCHEMA = {
    "output_dir": str,
    "seed": int | None,
    "device": Literal["cpu", "cuda"] | None,
    "strategy": str | None,  # fsdp2 (default) | deepspeed (docs/strategies.md)
    "deepspeed": DEEPSPEED_SCHEMA,  # strategy=deepspeed only: ZeRO stage, offload
    "lora": LORA_SCHEMA,  # absent / null: the backbone trains in full (docs/strategies.md)
    "prepare": list[Component] | None,  # run once on rank 0 before anything loads
    "model": {
        "path": str,  # a causal LM or *ForSequenceClassification directory (or hub id)
        "dtype": Literal[tuple(DTYPES)] | None,
        "trust_remote_code": bool | None,
        "activation_checkpointing": bool | None,
        "compile": bool | None,
        "heads": list[str] | None,  # named heads; default ["reward"]
        "cost_heads": list[str] | None,  # heads that are Safe-RLHF cost models
        "pooling": Literal[tuple(POOLINGS)] | None,  # likelihood: the LM head scores
        "probe_layer": int | None,  # read this decoder block's output (1-based)
    },
    "loss": {
        "type": Literal["bradley_terry", "log_exp", "hps"] | None,
        "center_coef": float | None,  # coef * mean((r_c + r_r)^2)
        "safety_coef": float | None,  # cost heads' sign term
        "nll_coef": float | None,  # pooling=likelihood: coef * -r_chosen (the chosen NLL)
    },
    "dataset": Component,  # a lightrft.data.PreferenceDataset (tokenizer passed first)
    "eval_dataset": Component | None,
    "packing": bool | None,  # several sequences per row, positions reset per sequence
    "max_tokens_per_row": int | None,  # packing only; default: one row per micro-batch
    "batch_size": int,  # preference items per rank per micro-batch
    "gradient_accumulation_steps": int | None,  # a step: batch_size x this many items per rank
    "micro_batch_tokens": int | None,  # token budget: a step's items by length, cut by tokens
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
    "metrics": {"tensorboard": bool | None, "wandb": bool | dict | None},
}


@dataclass(frozen=True)
class RewardModelOptions:
    """Every setting of a run, with its default, checked before anything heavy happens."""

    output_dir: str
    seed: int = 0
    device: str | None = None
    model_path: str = ""
    dtype: str = "float32"
    trust_remote_code: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    heads: tuple[str, ...] = ("reward",)
    cost_heads: tuple[str, ...] = ()
    pooling: str = "last"
    probe_layer: int | None = None
    loss: str = "bradley_terry"
    center_coef: float = 0.0
    safety_coef: float = 1.0
    nll_coef: float = 0.0
    packing: bool = False
    max_tokens_per_row: int | None = None
    batch_size: int = 1
    accum: int = 1
    micro_batch_tokens: int | None = None  # token budget per micro-batch; None: items only
    epochs: int = 1
    max_steps: int | None = None
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_grad_norm: float | None = None
    log_every: int = 1
    eval_every: int | None = None
    save_every: int | None = None
    keep_last: int = 2
    resume: bool = False
    tensorboard: bool = True
    wandb: Any = False
    strategy: str = "fsdp2"
    deepspeed: DeepSpeedOptions | None = None  # set exactly when strategy == "deepspeed"
    lora: LoraOptions | None = None  # adapters on the backbone; head and pooler train in full


def _get(node: Any, key: str, default: Any) -> Any:
    """``node[key]``, or ``default`` where the key is absent or null (null means default)."""
    if node is None:
        return default
    value = node.get(key)
    return default if value is None else value


def build_options(cfg: DictConfig) -> RewardModelOptions:
    """The run's options from a schema-checked config; every cross-field check is here."""
    model, loss = cfg.get("model") or {}, cfg.get("loss") or {}
    sched, metrics = cfg.get("lr_scheduler") or {}, cfg.get("metrics") or {}
    heads = tuple(_get(model, "heads", ["reward"]))
    cost_heads = tuple(_get(model, "cost_heads", []))
    opts = RewardModelOptions(
        output_dir=cfg.output_dir,
        seed=_get(cfg, "seed", 0),
        device=cfg.get("device"),
        model_path=model.path,
        dtype=_get(model, "dtype", "float32"),
        trust_remote_code=_get(model, "trust_remote_code", False),
        activation_checkpointing=_get(model, "activation_checkpointing", False),
        compile=_get(model, "compile", False),
        heads=heads,
        cost_heads=cost_heads,
        pooling=_get(model, "pooling", "last"),
        probe_layer=model.get("probe_layer"),
        loss=_get(loss, "type", "bradley_terry"),
        center_coef=float(_get(loss, "center_coef", 0.0)),
        safety_coef=float(_get(loss, "safety_coef", 1.0)),
        nll_coef=float(_get(loss, "nll_coef", 0.0)),
        packing=_get(cfg, "packing", False),
        max_tokens_per_row=cfg.get("max_tokens_per_row"),
        batch_size=cfg.batch_size,
        accum=_get(cfg, "gradient_accumulation_steps", 1),
        micro_batch_tokens=cfg.get("micro_batch_tokens"),
        epochs=cfg.epochs,
        max_steps=cfg.get("max_steps"),
        warmup_steps=_get(sched, "warmup_steps", 0),
        min_lr_ratio=float(_get(sched, "min_lr_ratio", 0.0)),
        clip_grad_norm=cfg.get("clip_grad_norm"),
        log_every=_get(cfg, "log_every", 1),
        eval_every=cfg.get("eval_every"),
        save_every=cfg.get("save_every"),
        keep_last=_get(cfg, "keep_last", 2),
        resume=_get(cfg, "resume", False),
        tensorboard=_get(metrics, "tensorboard", True),
        wandb=_get(metrics, "wandb", False),
    )
    strategy = strategy_option(cfg.get("strategy"))
    opts = dataclasses.replace(
        opts,
        strategy=strategy,
        deepspeed=deepspeed_options(cfg.get("deepspeed"), strategy),
        lora=lora_options(cfg.get("lora")),
    )
    errors = []
    for key, value in (
        ("batch_size", opts.batch_size),
        ("epochs", opts.epochs),
        ("gradient_accumulation_steps", opts.accum),
        ("log_every", opts.log_every),
        ("keep_last", opts.keep_last),
    ):
        if value < 1:
            errors.append(f"{key} must be >= 1, got {value}")
    for key, value in (
        ("max_steps", opts.max_steps),
        ("eval_every", opts.eval_every),
        ("save_every", opts.save_every),
        ("max_tokens_per_row", opts.max_tokens_per_row),
        ("micro_batch_tokens", opts.micro_batch_tokens),
    ):
        if value is not None and value < 1:
            errors.append(f"{key} must be >= 1 or null, got {value}")
    if not heads or len(set(heads)) != len(heads) or any(not h or "/" in h for h in heads):
        errors.append(
            f"model.heads must be distinct non-empty names without '/', got {list(heads)}"
        )
    unknown = [h for h in cost_heads if h not in heads]
    if unknown:
        errors.append(f"model.cost_heads: {unknown[0]!r} is not in model.heads {list(heads)}")
    if opts.pooling not in POOLINGS:
        errors.append(f"model.pooling must be one of {POOLINGS}, got {opts.pooling!r}")
    if opts.pooling == "likelihood" and (
        len(heads) != 1 or cost_heads or opts.probe_layer is not None
    ):
        errors.append(
            "model.pooling=likelihood scores with the LM head: one head (model.heads), no "
            "model.cost_heads and no model.probe_layer"
        )
    if opts.nll_coef and opts.pooling != "likelihood":
        errors.append(
            f"loss.nll_coef applies to model.pooling=likelihood only (got pooling="
            f"{opts.pooling!r}): a classifier's score is no log-likelihood"
        )
    if opts.probe_layer is not None and opts.probe_layer < 1:
        errors.append(f"model.probe_layer must be >= 1 (a decoder block), got {opts.probe_layer}")
    if opts.max_tokens_per_row is not None and not opts.packing:
        errors.append("max_tokens_per_row applies only with packing=true")
    if opts.center_coef < 0 or opts.safety_coef < 0 or opts.nll_coef < 0:
        errors.append("loss.center_coef, loss.safety_coef and loss.nll_coef must be >= 0")
    if not 0.0 <= opts.min_lr_ratio <= 1.0:
        errors.append(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {opts.min_lr_ratio}")
    if opts.warmup_steps < 0:
        errors.append(f"lr_scheduler.warmup_steps must be >= 0, got {opts.warmup_steps}")
    if opts.max_steps is not None and opts.warmup_steps > opts.max_steps:
        errors.append(
            f"lr_scheduler.warmup_steps={opts.warmup_steps} is more than max_steps="
            f"{opts.max_steps}: the schedule would never reach its peak"
        )
    if opts.clip_grad_norm is not None and opts.clip_grad_norm <= 0:
        errors.append(f"clip_grad_norm must be > 0 or null, got {opts.clip_grad_norm}")
    if opts.lora is not None and opts.deepspeed is not None:
        errors.append("lora is not supported with strategy=deepspeed yet; use strategy=fsdp2")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    if opts.resume:
        check_resume(opts.output_dir, opts.lora is not None, ("model",))
    return opts


class RewardModelRecipe:
    """Read the options, build everything in ``setup``, train, clean up."""

    def __init__(self, cfg: DictConfig, opts: RewardModelOptions):
        self.cfg, self.opts = cfg, opts
        self.output_dir = check_output_dir(opts.output_dir)
        self.dist = init_distributed(opts.device)
        self.checkpointer = Checkpointer(
            self.output_dir, keep_last=opts.keep_last, every_n_steps=opts.save_every
        )
        if opts.resume and self.checkpointer.latest() is None:
            raise ValueError(f"resume=true but no checkpoint found in {self.checkpointer.root}")

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        o = self.opts
        torch.manual_seed(o.seed)
        if self.dist.is_main:
            for node in cfg.get("prepare") or []:
                config.instantiate(node)
        barrier()
        # A vision-language backbone: the datasets take its processor (images + text) and the
        # export saves it; everything else is the text path.
        if checkpoint_is_multimodal(o.model_path):
            self.processor = load_processor(o.model_path, trust_remote_code=o.trust_remote_code)
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = load_tokenizer(o.model_path, trust_remote_code=o.trust_remote_code)
            self.processor = self.tokenizer
        # Data first: a bad record or an unknown head label fails before the model loads.
        self.dataset = self._dataset(cfg.dataset)
        collate = PreferenceCollator(
            self.tokenizer.pad_token_id,
            o.heads,
            packing=o.packing,
            max_tokens=o.max_tokens_per_row,
        )
        loader_kw = dict(seed=o.seed, rank=self.dist.rank, world_size=self.dist.world_size)
        # One loader batch is one optimizer step's items on this rank, collated into its
        # micro-batches: batch_size items each, or by the token budget (shortest first).
        self.loader = build_dataloader(
            self.dataset,
            batch_size=o.batch_size * o.accum,
            collate_fn=StepCollator(
                collate,
                o.batch_size,
                o.micro_batch_tokens,
                packing=o.packing,
                length=_item_tokens if o.packing else _item_padded_tokens,
            ),
            shuffle=True,
            drop_last=True,
            **loader_kw,
        )
        self.eval_loader = None
        if cfg.get("eval_dataset") is not None:
            eval_ds = self._dataset(cfg.eval_dataset)
            self.eval_loader = build_dataloader(
                eval_ds,
                batch_size=o.batch_size,
                collate_fn=collate,
                shuffle=False,
                drop_last=False,
                **loader_kw,
            )
        self.steps_per_epoch = len(self.loader)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"dataset {cfg.dataset._component_} gives {len(self.dataset)} items, fewer than "
                f"one step needs: batch_size={o.batch_size} x gradient_accumulation_steps="
                f"{o.accum} on each of {self.dist.world_size} rank(s); lower them, or add data"
            )
        self.total_steps = self.steps_per_epoch * o.epochs
        if o.max_steps is not None:
            self.total_steps = min(self.total_steps, o.max_steps)

        # Under torchrun each rank builds the classifier on the meta device and reads only its
        # shards (FSDP2); DeepSpeed gets the whole model on every rank and partitions it in
        # deepspeed.initialize below. LoRA adapters go on the backbone before sharding.
        ds = o.deepspeed is not None
        self.model = load_reward_net_parallel(
            o.model_path,
            heads=o.heads,
            pooling=o.pooling,
            # Plain-text pairs carry no end-of-turn: the likelihood pooling scores the EOS after
            # the response too, as RewardModel does on the policy's plain-text responses.
            end_token_id=(
                self.tokenizer.eos_token_id
                if o.pooling == "likelihood" and not self.dataset.chat_template
                else None
            ),
            probe_layer=o.probe_layer,
            dtype=o.dtype,
            device=self.dist.device,
            trust_remote_code=o.trust_remote_code,
            prepare=(lambda net: apply_backbone_lora(net, o.lora)) if o.lora else None,
            activation_checkpointing=o.activation_checkpointing,
            compile=o.compile,
            shard=False if ds else None,
        )
        # Per head: -1 turns a cost into a "higher is preferred" score; 1 marks cost heads.
        dev = self.dist.device
        self.head_sign = torch.tensor(
            [-1.0 if h in o.cost_heads else 1.0 for h in o.heads], device=dev
        )  # [heads]
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, trainable)
        self.ds_engine = None  # strategy=deepspeed: the engine that steps the optimizer
        if ds:
            from lightrft.models import deepspeed as lds

            self.ds_engine = lds.initialize(
                self.model,
                self.optimizer,
                o.deepspeed,
                micro_batch_size=o.batch_size,
                accum=o.accum,
                clip_grad_norm=o.clip_grad_norm,
            )
        self.scheduler = warmup_cosine_scheduler(
            self.optimizer,
            warmup_steps=o.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=o.min_lr_ratio,
        )
        self.step, self.epoch, self.last_eval_step = 0, 0, None
        self.eval_stats: dict[str, dict[str, float]] = {}
        if o.resume:
            state = self.checkpointer.load_latest(
                **self._trained(),
                schedulers=self.scheduler,
                dataloaders=self.loader,
                required=True,
            )
            self.step, self.epoch = state.step, state.extra["epoch"]
        self.logger = MetricLogger(
            self.output_dir,
            tensorboard=o.tensorboard,
            wandb=o.wandb or False,
            config=OmegaConf.to_container(cfg, resolve=True),
            resume_step=self.step if o.resume else None,
        )
        self.logger.log(self.step, {f"data/{k}": v for k, v in self.dataset.stats.items()})

    def _dataset(self, node: DictConfig):
        ds = config.instantiate(node, self.processor)
        for i, head in enumerate(ds.heads):
            if head is not None and head not in self.opts.heads:
                raise ValueError(
                    f"{ds.where(i)}: the pair is labelled for head {head!r}, which is not in "
                    f"model.heads {list(self.opts.heads)}"
                )
        return ds

    # ------------------------------------------------------------------ steps

    def _scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Raw head outputs of each item's candidates ``[B, K]`` (its own head), the signed
        scores (higher = preferred) and the valid mask."""
        dev = self.dist.device
        cand = batch["candidates"].to(dev)  # [B, K]
        mask = batch.get("attention_mask")
        out = self.model(
            input_ids=batch["input_ids"].to(dev),
            position_ids=batch["position_ids"].to(dev),
            segment_ids=batch["segment_ids"].to(dev),
            num_sequences=int(cand.max()) + 1,
            attention_mask=None if mask is None else mask.to(dev),
            scored=batch["scored"].to(dev),
            images=batch.get("images"),
        )  # [N, heads]
        head = batch["head"].to(dev)  # [B]
        valid = cand >= 0
        raw = out[cand.clamp(min=0), head[:, None].expand_as(cand)]  # [B, K]
        signed = raw * self.head_sign[head][:, None]  # [B, K]
        return raw, signed, valid

    def _loss(self, batch: dict[str, torch.Tensor], divisor: float) -> torch.Tensor:
        """Sum of the items' losses divided by ``divisor``."""
        o, dev = self.opts, self.dist.device
        raw, signed, valid = self._scores(batch)
        margin = batch["margin"].to(dev)  # [B]
        per_item = preference_loss(
            signed,
            valid,
            kind=o.loss,
            margin=margin if bool((margin != 0).any()) else None,
            center_coef=o.center_coef,
        )  # [B]
        if o.nll_coef:  # likelihood pooling: raw[:, 0] is the chosen response's mean log-prob
            per_item = per_item - o.nll_coef * raw[:, 0]
        if o.cost_heads and o.safety_coef:
            is_cost = (self.head_sign[batch["head"].to(dev)] < 0).to(raw.dtype)  # [B]
            safe = batch["safe"].to(dev) * valid  # [B, K]
            per_item = per_item + o.safety_coef * is_cost * safety_sign_loss(raw, safe)
        return per_item.sum() / divisor

    def _steps(self):
        """The current epoch's steps from the (resumable) dataloader position: this rank's
        micro-batches and how many are real. With a token budget the counts differ across ranks:
        the ranks with fewer repeat their last one with zero weight (``even_micro_batches``)."""
        self.loader.sampler.set_epoch(self.epoch)
        for micro in self.loader:
            if self.opts.micro_batch_tokens is not None:
                yield even_micro_batches(micro, self.dist.device)
            else:
                yield micro, len(micro)

    def train(self) -> None:
        o, model, opt = self.opts, self.model, self.optimizer
        bar = ProgressBar(self.total_steps, initial=self.step, desc="reward_model")
        if self.step == 0:
            self._log_eval()
        seqs_seen, t0 = 0, time.perf_counter()
        reset_peak_memory(self.dist.device)
        while self.step < self.total_steps and self.epoch < o.epochs:
            for micro, n_real in self._steps():
                # Normalise by the items of the whole step on all ranks; FSDP averages
                # gradients over ranks, so multiply back by the world size.
                n_items = all_reduce_sum(sum(len(b["head"]) for b in micro[:n_real])).item()
                divisor = n_items / self.dist.world_size
                loss_sum = 0.0
                for i, b in enumerate(micro):
                    loss = self._loss(b, divisor) * (1.0 if i < n_real else 0.0)
                    backward(loss, self.ds_engine)
                    loss_sum += loss.item() * divisor
                    seqs_seen += int((b["candidates"] >= 0).sum()) if i < n_real else 0
                grad_norm = optimizer_step(model, opt, o.clip_grad_norm, self.ds_engine)
                self.scheduler.step()
                self.step += 1
                loss = all_reduce_sum(loss_sum).item() / n_items
                if self.step % o.log_every == 0 or self.step == self.total_steps:
                    elapsed = time.perf_counter() - t0
                    sps = all_reduce_sum(seqs_seen).item() / max(elapsed, 1e-9)
                    self.logger.log(
                        self.step,
                        {
                            "train/loss": loss,
                            "train/grad_norm": grad_norm,
                            "train/lr": self.scheduler.get_last_lr()[0],
                            "train/sequences_per_s": sps,
                            "train/epoch": self.epoch,
                            **peak_memory(self.dist.device),
                        },
                    )
                    seqs_seen, t0 = 0, time.perf_counter()
                bar.update(1, loss=loss)
                if o.eval_every and self.step % o.eval_every == 0:
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
        net = model.module if hasattr(model, "module") else model
        setattr(net._hf[0].config, CONFIG_KEY, net.reward_config(self.eval_stats))
        if self.ds_engine is not None:
            from lightrft.models.deepspeed import export_hf_engine

            export_hf_engine(self.ds_engine, self.processor, self.output_dir / "final")
        elif o.lora is not None:  # the adapters merged: a plain classifier directory
            export_merged(model, self.processor, self.output_dir / "final")
        else:
            export_hf(model, self.processor, self.output_dir / "final")

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
        )

    def _log_eval(self) -> None:
        if self.eval_loader is not None:
            metrics = self.evaluate()
            self.logger.log(self.step, metrics)
            if self.dist.is_main:
                print(f"step {self.step}: eval/accuracy {metrics['eval/accuracy']:.4f}", flush=True)
        self.last_eval_step = self.step

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Pairwise accuracy, mean margin and reward mean / std per head on the held-out split."""
        heads = self.opts.heads
        H = len(heads)
        # Per head: items, correct, margin sum, scored sequences, reward sum, reward sum of squares.
        sums = torch.zeros(6, H, dtype=torch.float64)
        self.model.eval()
        for batch in self.eval_loader:
            raw, signed, valid = self._scores(batch)
            acc, margin = pairwise_stats(signed.float(), valid)  # [B] each
            head = batch["head"]
            vals = raw.float().cpu() * valid.cpu()
            for h in range(H):
                sel = head == h
                sums[0, h] += sel.sum()
                sums[1, h] += acc.cpu()[sel].sum()
                sums[2, h] += margin.cpu()[sel].sum()
                sums[3, h] += valid.cpu()[sel].sum()
                sums[4, h] += vals[sel].sum()
                sums[5, h] += vals[sel].pow(2).sum()
        self.model.train()
        sums = all_reduce_sum(sums)
        out: dict[str, float] = {}
        self.eval_stats = {}
        for h, name in enumerate(heads):
            n, m = sums[0, h].item(), sums[3, h].item()
            if n == 0:
                continue
            mean = sums[4, h].item() / m
            std = max(sums[5, h].item() / m - mean * mean, 0.0) ** 0.5
            out[f"eval/accuracy/{name}"] = sums[1, h].item() / n
            out[f"eval/margin/{name}"] = sums[2, h].item() / n
            out[f"eval/reward_mean/{name}"] = mean
            out[f"eval/reward_std/{name}"] = std
            self.eval_stats[name] = {"mean": mean, "std": std, "pairs": int(n)}
        out["eval/accuracy"] = sums[1].sum().item() / max(sums[0].sum().item(), 1.0)
        return out

    def cleanup(self, clean: bool = True) -> None:
        self.logger.close()
        destroy(clean)


def _item_tokens(item: dict) -> int:
    """A preference item's tokens when packed: all its sequences."""
    return sum(len(s) for s in item["sequences"])


def _item_padded_tokens(item: dict) -> int:
    """A preference item's tokens when padded: its sequences x its longest (per item; the
    micro-batch's rows are then padded to the longest of all)."""
    return len(item["sequences"]) * max(len(s) for s in item["sequences"])


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: RewardModelOptions) -> None:
    recipe = RewardModelRecipe(cfg, opts)
    recipe.setup(cfg)
    try:
        recipe.train()
    except BaseException:
        recipe.cleanup(clean=False)  # no barrier: a peer may be stuck or gone
        raise
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
