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

import functools
import sys
import time
from typing import Literal

import torch
from omegaconf import DictConfig

from lightrft import config
from lightrft.algorithms.reward_losses import PreferenceStats, preference_loss, safety_sign_loss
from lightrft.config import Section, option, section
from lightrft.data import step_batches
from lightrft.data.preference import PreferenceCollator, item_tokens
from lightrft.distributed import all_reduce_sum
from lightrft.models.lora import apply_backbone_lora
from lightrft.models.multimodal import load_processors
from lightrft.models.reward import POOLINGS, load_reward_net_parallel, set_reward_config
from lightrft.sections import BatchConfig, TrainedModelConfig, check_model_path
from lightrft.strategy import build_strategy
from lightrft.training import ProgressBar, lr_scheduler, peak_memory, reset_peak_memory
from lightrft.training.export import ExportSpec
from lightrft.training.loaders import step_loaders
from lightrft.training.run import TrainingConfig, TrainingRun, training_run


@section
class RewardNetConfig(TrainedModelConfig):
    """``model:``: the backbone (a causal LM or *ForSequenceClassification directory), its
    heads and how it pools a sequence into scores."""

    heads: list[str] = option(("reward",), doc="named heads, one score each")
    cost_heads: list[str] = option((), doc="heads that are Safe-RLHF cost models")
    pooling: Literal[POOLINGS] = option("last", doc="likelihood: the LM head scores")
    probe_layer: int | None = option(None, ge=1, doc="read this decoder block's output (1-based)")

    def resolve(self, at: str) -> RewardNetConfig:
        heads = self.heads
        if not heads or len(set(heads)) != len(heads) or any(not h or "/" in h for h in heads):
            raise ValueError(
                f"model.heads must be distinct non-empty names without '/', got {list(heads)}"
            )
        unknown = [h for h in self.cost_heads if h not in heads]
        if unknown:
            raise ValueError(
                f"model.cost_heads: {unknown[0]!r} is not in model.heads {list(heads)}"
            )
        if self.pooling == "likelihood" and (
            len(heads) != 1 or self.cost_heads or self.probe_layer is not None
        ):
            raise ValueError(
                "model.pooling=likelihood scores with the LM head: one head (model.heads), no "
                "model.cost_heads and no model.probe_layer"
            )
        return self


@section
class LossConfig(Section):
    """``loss:``: the preference loss and its extra terms."""

    type: Literal["bradley_terry", "log_exp", "hps"] = option("bradley_terry", doc="pairwise loss")
    center_coef: float = option(0.0, ge=0, doc="coef * mean((r_c + r_r)^2)")
    safety_coef: float = option(1.0, ge=0, doc="cost heads' sign term")
    nll_coef: float = option(0.0, ge=0, doc="pooling=likelihood: coef * the chosen NLL")


@section
class RewardModelConfig(TrainingConfig):
    """The whole config: the shared sections, the reward net and the loss."""

    model: RewardNetConfig = option(doc="the reward model")
    loss: LossConfig = option(default_factory=LossConfig, doc="")
    data: BatchConfig = option(flat=True)

    def resolve(self, at: str) -> RewardModelConfig:
        super().resolve(at)
        if self.loss.nll_coef and self.model.pooling != "likelihood":
            raise ValueError(
                f"loss.nll_coef applies to model.pooling=likelihood only (got pooling="
                f"{self.model.pooling!r}): a classifier's score is no log-likelihood"
            )
        self.optim.lr_scheduler.check_steps(self.data.max_steps)
        check_model_path(self.model.path, prepare=self.run.prepare)
        return self


# What `lightrft validate` and `run` check before anything loads (lightrft.config.parse).
CONFIG_SCHEMA = RewardModelConfig.schema()
build_options = RewardModelConfig.read


class RewardModelRecipe:
    """Build everything in ``setup``, then ``train``; the run contract is ``run``'s."""

    def __init__(self, cfg: DictConfig, opts: RewardModelConfig, run: TrainingRun):
        self.cfg, self.opts, self.run, self.dist = cfg, opts, run, run.dist

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        o, m, d = self.opts, self.opts.model, self.opts.data
        check_model_path(m.path, loading=True)  # it exists now, whatever prepare wrote
        # A vision-language backbone: the datasets take its processor (images + text) and the
        # export saves it; everything else is the text path.
        self.processor, self.tokenizer = load_processors(
            m.path, trust_remote_code=m.trust_remote_code, template_args=m.chat_template_args
        )
        # Data first: a bad record or an unknown head label fails before the model loads.
        self.dataset = self._dataset(d.dataset)
        collate = PreferenceCollator(
            self.tokenizer.pad_token_id, m.heads, packing=d.packing, max_tokens=d.max_tokens_per_row
        )
        # One loader batch is one optimizer step's items on this rank, collated into its
        # micro-batches: batch_size items each, or by the token budget (shortest first).
        eval_dataset = None if d.eval_dataset is None else self._dataset(d.eval_dataset)
        self.loader, self.eval_loader = step_loaders(
            self.dataset,
            eval_dataset,
            collate,
            d,
            seed=o.run.seed,
            dist=self.dist,
            what="items",
            length=functools.partial(item_tokens, padded=not d.packing),
        )
        self.total_steps = d.total_steps(len(self.loader))

        # Under torchrun each rank builds the classifier on the meta device and reads only its
        # shards (FSDP2, HSDP with shard_size / replicate_size); DeepSpeed gets the whole model
        # on every rank. LoRA adapters go on the backbone before sharding.
        self.strategy = build_strategy(o.strategy, self.dist)
        self.model = load_reward_net_parallel(
            m.path,
            heads=m.heads,
            pooling=m.pooling,
            # Plain-text pairs carry no end-of-turn: the likelihood pooling scores the EOS after
            # the response too, as RewardModel does on the policy's plain-text responses.
            end_token_id=(
                self.tokenizer.eos_token_id
                if m.pooling == "likelihood" and not self.dataset.chat_template
                else None
            ),
            probe_layer=m.probe_layer,
            dtype=m.dtype,
            device=self.dist.device,
            trust_remote_code=m.trust_remote_code,
            prepare=lambda net: self.strategy.adapt(net, apply_backbone_lora),
            activation_checkpointing=m.activation_checkpointing,
            compile=m.compile,
            **self.strategy.loading(),
        )
        # Per head: -1 turns a cost into a "higher is preferred" score; 1 marks cost heads.
        self.head_sign = torch.tensor(
            [-1.0 if h in m.cost_heads else 1.0 for h in m.heads], device=self.dist.device
        )  # [heads]
        self.optimizer = self.strategy.setup(
            self.model, o.optim, micro_batch_size=d.batch_size, accum=d.gradient_accumulation_steps
        )
        self.scheduler = lr_scheduler(self.optimizer, o.optim.lr_scheduler, self.total_steps)
        self.step, self.epoch, self.last_eval_step = 0, 0, None
        self.eval_stats: dict[str, dict[str, float]] = {}
        state = self.run.resume(**self._state())
        if state is not None:
            self.step, self.epoch = state.step, state.extra["epoch"]
        self.logger = self.run.open_logger(self.step, self.dataset.stats)

    def _dataset(self, node: DictConfig):
        ds = config.instantiate(node, self.processor)
        for i, head in enumerate(ds.heads):
            if head is not None and head not in self.opts.model.heads:
                raise ValueError(
                    f"{ds.where(i)}: the pair is labelled for head {head!r}, which is not in "
                    f"model.heads {list(self.opts.model.heads)}"
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
            media=batch.get("media"),
        )  # [N, heads]
        head = batch["head"].to(dev)  # [B]
        valid = cand >= 0
        raw = out[cand.clamp(min=0), head[:, None].expand_as(cand)]  # [B, K]
        signed = raw * self.head_sign[head][:, None]  # [B, K]
        return raw, signed, valid

    def _loss(self, batch: dict[str, torch.Tensor], divisor: float) -> torch.Tensor:
        """Sum of the items' losses divided by ``divisor``."""
        o, dev = self.opts.loss, self.dist.device
        raw, signed, valid = self._scores(batch)
        margin = batch["margin"].to(dev)  # [B]
        per_item = preference_loss(
            signed,
            valid,
            kind=o.type,
            margin=margin if bool((margin != 0).any()) else None,
            center_coef=o.center_coef,
        )  # [B]
        if o.nll_coef:  # likelihood pooling: raw[:, 0] is the chosen response's mean log-prob
            per_item = per_item - o.nll_coef * raw[:, 0]
        if self.opts.model.cost_heads and o.safety_coef:
            is_cost = (self.head_sign[batch["head"].to(dev)] < 0).to(raw.dtype)  # [B]
            safe = batch["safe"].to(dev) * valid  # [B, K]
            per_item = per_item + o.safety_coef * is_cost * safety_sign_loss(raw, safe)
        return per_item.sum() / divisor

    def train_step(self, micro: list, n_real: int) -> tuple[float, float, int]:
        """One optimizer step: (loss, grad norm, sequences scored on this rank)."""
        # Normalise by the items of the whole step on all ranks; FSDP averages gradients over
        # ranks, so multiply back by the world size.
        n_items = all_reduce_sum(sum(len(b["head"]) for b in micro[:n_real])).item()
        divisor = n_items / self.dist.world_size
        loss_sum, seqs = 0.0, 0
        for i, b in enumerate(micro):
            loss = self._loss(b, divisor) * (1.0 if i < n_real else 0.0)
            self.strategy.backward(loss)
            loss_sum += loss.item() * divisor
            seqs += int((b["candidates"] >= 0).sum()) if i < n_real else 0
        grad_norm = self.strategy.step()
        self.scheduler.step()
        return all_reduce_sum(loss_sum).item() / n_items, grad_norm, seqs

    def train(self) -> None:
        bar = ProgressBar(self.total_steps, initial=self.step, desc="reward_model")
        if self.step == 0:
            self._log_eval()
        seqs_seen, t0 = 0, time.perf_counter()
        reset_peak_memory(self.dist.device)
        uneven = self.opts.data.micro_batch_tokens is not None
        batches = step_batches(self.loader, self.epoch, uneven=uneven, device=self.dist.device)
        for step in self.run.steps(self.step, self.total_steps, save=self._save):
            self.epoch, micro, n_real = next(batches)
            loss, grad_norm, seqs = self.train_step(micro, n_real)
            self.step, seqs_seen = step, seqs_seen + seqs
            if self.run.should_log(step, self.total_steps):
                elapsed = time.perf_counter() - t0
                sps = all_reduce_sum(seqs_seen).item() / max(elapsed, 1e-9)
                self.logger.log(
                    step,
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
            if self.opts.data.eval_every and step % self.opts.data.eval_every == 0:
                self._log_eval()
        bar.close()
        if self.last_eval_step != self.step:
            self._log_eval()
        spec = self._export_spec()
        set_reward_config(self.model, spec.reward)
        self.strategy.export(self.processor, self.run.output_dir / "final", adapter=spec.adapter)

    def _export_spec(self) -> ExportSpec:
        """How this model is exported, at ``final/`` and by ``lightrft export`` from a
        checkpoint: whole (LoRA: merged), the directory RewardModel loads, with its heads,
        pooling and the held-out statistics measured last (``lightrft_reward``)."""
        reward = self.model.reward_config(self.eval_stats)
        return ExportSpec.of(
            "reward_net", self.opts.model, self.opts.strategy, adapter=False, reward=reward
        )

    def _state(self) -> dict:
        return {
            **self.strategy.checkpoint_state(),
            "schedulers": self.scheduler,
            "dataloaders": self.loader,
        }

    def _save(self) -> None:
        self.run.save(
            self.step,
            **self._state(),
            extra={"epoch": self.epoch},
            export=self._export_spec().to_json(),
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
        stats = PreferenceStats(self.opts.model.heads)
        self.model.eval()
        for batch in self.eval_loader:
            stats.add(*self._scores(batch), batch["head"])
        self.model.train()
        out, self.eval_stats = stats.metrics(all_reduce_sum(stats.sums))
        return out


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: RewardModelConfig) -> None:
    with training_run(cfg, opts.run) as run:
        recipe = RewardModelRecipe(cfg, opts, run)
        recipe.setup(cfg)
        recipe.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
