"""Supervised fine-tuning (SFT): the warm start before RL.

    lightrft run sft --config tiny/arith_sft
    lightrft run --nproc_per_node 8 sft --config <config> optimizer.lr=1e-5

Loss on completion (assistant) tokens only, summed over tokens and divided by the number of loss
tokens of the whole optimizer step (all micro-batches, all ranks), so gradient accumulation and
data parallelism give the gradient of one big batch. The cross-entropy comes from the fused linear
log-prob kernel over the final hidden states: the [tokens x vocab] logits never exist.

The shared sections (run, model, strategy, optimizer, batches) and the run contract (output
directory, resume, preemption, teardown) come from the library; this file is the training.
One self-contained file: copy it (`lightrft cp sft my_sft.py`), edit it, run the copy.
"""

from __future__ import annotations

import sys
import time

import torch
from omegaconf import DictConfig

from lightrft import config
from lightrft.config import option, section
from lightrft.data import pack_or_pad_collator, step_batches
from lightrft.distributed import all_reduce_sum
from lightrft.models.forward import causal_lm_cross_entropy
from lightrft.models.multimodal import check_towers, load_processors
from lightrft.sections import (
    BatchConfig,
    PolicyModelConfig,
    check_model_path,
    check_sequence_parallel_checkpoint,
)
from lightrft.strategy import build_strategy
from lightrft.training import ProgressBar, lr_scheduler, peak_memory, reset_peak_memory
from lightrft.training.export import ExportSpec
from lightrft.training.loaders import step_loaders
from lightrft.training.run import TrainingConfig, TrainingRun, training_run


@section
class SFTConfig(TrainingConfig):
    """The whole config: the shared sections, all from the library."""

    model: PolicyModelConfig = option(doc="the model to fine-tune")
    data: BatchConfig = option(flat=True)

    def resolve(self, at: str) -> SFTConfig:
        super().resolve(at)
        self.optim.lr_scheduler.check_steps(self.data.max_steps)
        check_model_path(self.model.path, prepare=self.run.prepare)
        check_towers(self.model)
        check_sequence_parallel_checkpoint(self.strategy.sequence_parallel, self.model.path)
        return self


# What `lightrft validate` and `run` check before anything loads (lightrft.config.parse).
CONFIG_SCHEMA = SFTConfig.schema()
build_options = SFTConfig.read


class SFTRecipe:
    """Build everything in ``setup``, then ``train``; the run contract is ``run``'s."""

    def __init__(self, cfg: DictConfig, opts: SFTConfig, run: TrainingRun):
        self.cfg, self.opts, self.run, self.dist = cfg, opts, run, run.dist

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        o, m, d = self.opts, self.opts.model, self.opts.data
        check_model_path(m.path, loading=True)  # it exists now, whatever prepare wrote
        self.strategy = build_strategy(o.strategy, self.dist)
        self.strategy.check_model(m.path, trust_remote_code=m.trust_remote_code)
        # The ranks of one sequence-parallel group read the same samples.
        data = self.strategy.data_dist
        # The data first: a bad record is refused before the model loads. A vision- or
        # audio-language model's datasets take its processor (images / audio + text); the
        # collator and export use the tokenizer / processor the same way for all.
        self.processor, self.tokenizer = load_processors(
            m.path, trust_remote_code=m.trust_remote_code, template_args=m.chat_template_args
        )
        self.dataset = config.instantiate(d.dataset, self.processor)
        eval_dataset = config.instantiate(d.eval_dataset, self.processor)  # None without one

        # Towers trainable as model.train_vision_tower / train_audio_tower say, LoRA adapters;
        # under torchrun each rank reads only its shards (lightrft.models.sharded).
        self.model = self.strategy.load_policy(m)
        self.optimizer = self.strategy.setup(
            self.model, o.optim, micro_batch_size=d.batch_size, accum=d.gradient_accumulation_steps
        )

        collate = pack_or_pad_collator(
            self.tokenizer, packing=d.packing, max_tokens=d.max_tokens_per_row
        )
        # One loader batch is one optimizer step's samples on this rank, collated into its
        # micro-batches: batch_size rows each, or by the token budget (shortest first).
        self.loader, self.eval_loader = step_loaders(
            self.dataset, eval_dataset, collate, d, seed=o.run.seed, dist=data, what="samples"
        )
        self.total_steps = d.total_steps(len(self.loader))
        self.scheduler = lr_scheduler(self.optimizer, o.optim.lr_scheduler, self.total_steps)
        self.step, self.epoch, self.last_eval_step = 0, 0, None
        state = self.run.resume(**self._state())
        if state is not None:
            self.step, self.epoch = state.step, state.extra["epoch"]
        self.logger = self.run.open_logger(self.step, getattr(self.dataset, "stats", None))

    # ------------------------------------------------------------------ steps

    def _loss(self, batch: dict[str, torch.Tensor], divisor: float) -> torch.Tensor:
        """Summed next-token NLL of the loss tokens divided by ``divisor``."""
        dev = self.dist.device
        mask = batch.get("attention_mask")
        return causal_lm_cross_entropy(
            self.model,
            batch["input_ids"].to(dev),  # [B, T]
            targets=batch["labels"][:, 1:].to(dev),  # [B, T-1], -100 where no loss
            num_tokens=divisor,
            position_ids=batch["position_ids"].to(dev),
            attention_mask=None if mask is None else mask.to(dev),
            media=batch.get("media"),  # the batch's samples' images / audio, in token order
            sequence_parallel=self.strategy.sequence_parallel,  # this rank's share of the loss
        )

    def train_step(self, micro: list, n_real: int) -> tuple[float, float, int]:
        """One optimizer step: (loss, grad norm, tokens seen on this rank)."""
        # Normalise by the loss tokens of the whole step on all ranks; FSDP averages gradients
        # over ranks, so multiply back by the world size. With sequence parallelism each rank's
        # loss is its slice's share, and the shares of a group add up in the same reduction.
        n_tokens = self.strategy.data_sum(sum(_loss_tokens(b) for b in micro[:n_real]))
        divisor = max(n_tokens, 1.0) / self.dist.world_size
        loss_sum, tokens = 0.0, 0
        for i, b in enumerate(micro):
            loss = self._loss(b, divisor) * (1.0 if i < n_real else 0.0)
            self.strategy.backward(loss)
            loss_sum += loss.item() * divisor
            tokens += int(b["input_ids"].numel()) if i < n_real else 0
        grad_norm = self.strategy.step()
        self.scheduler.step()
        return all_reduce_sum(loss_sum).item() / max(n_tokens, 1.0), grad_norm, tokens

    def train(self) -> None:
        bar = ProgressBar(self.total_steps, initial=self.step, desc="sft")
        if self.step == 0:
            self._log_eval()
        tokens_seen, t0, logged_step = 0, time.perf_counter(), self.step
        reset_peak_memory(self.dist.device)
        uneven = self.opts.data.micro_batch_tokens is not None
        batches = step_batches(self.loader, self.epoch, uneven=uneven, device=self.dist.device)
        for step in self.run.steps(self.step, self.total_steps, save=self._save):
            self.epoch, micro, n_real = next(batches)
            loss, grad_norm, tokens = self.train_step(micro, n_real)
            self.step, tokens_seen = step, tokens_seen + tokens
            if self.run.should_log(step, self.total_steps):
                elapsed = time.perf_counter() - t0
                tps = self.strategy.data_sum(tokens_seen) / max(elapsed, 1e-9)
                self.logger.log(
                    step,
                    {
                        "train/loss": loss,
                        "train/grad_norm": grad_norm,
                        "train/lr": self.scheduler.get_last_lr()[0],
                        "train/tokens_per_s": tps,
                        "time/step": elapsed / (step - logged_step),
                        "train/epoch": self.epoch,
                        **peak_memory(self.dist.device),
                    },
                )
                tokens_seen, t0, logged_step = 0, time.perf_counter(), step
            bar.update(1, loss=loss)
            if self.opts.data.eval_every and step % self.opts.data.eval_every == 0:
                self._log_eval()
        bar.close()
        if self.last_eval_step != self.step:
            self._log_eval()
        self.strategy.export(self.processor, self.run.output_dir / "final")

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
            # What `lightrft export` needs to turn this checkpoint into the run's final/.
            export=ExportSpec.of("causal_lm", self.opts.model, self.opts.strategy).to_json(),
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
        return all_reduce_sum(nll).item() / max(self.strategy.data_sum(count), 1.0)


def _loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: SFTConfig) -> None:
    with training_run(cfg, opts.run) as run:
        recipe = SFTRecipe(cfg, opts, run)
        recipe.setup(cfg)
        recipe.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
