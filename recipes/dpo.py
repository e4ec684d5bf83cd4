"""Preference optimisation: DPO and its family (cDPO, robust DPO, IPO, SimPO, ORPO, KTO).

    lightrft run dpo --config tiny/add_dpo            # offline: the pairs of a data set
    lightrft run dpo --config tiny/add_dpo_online     # online: pairs sampled each step
    lightrft run --nproc_per_node 8 dpo --config <config> loss.type=ipo loss.beta=0.5

Preference pairs (lightrft.data.PreferenceDataset: text, images, audio, video) train the policy
with a loss of lightrft.algorithms.PREFERENCE_LOSSES on sequence log-probs of the responses (the
fused log-prob kernel; summed, or length-normalised as the paper does). The reference is the
start model with LoRA adapters off, or a frozen copy of ``reference.path`` (default: the start);
``reference.precompute`` computes its log-probs once per data set, cached with a key of the
model's files and the data's tokens. KTO reads a pair as a desirable and an undesirable example,
its reference point from mismatched (prompt, response) pairs. Metrics as TRL names them
(``rewards/chosen|rejected|margins|accuracies``, ``logps/chosen|rejected``). A rejected response
identical to the chosen one is dropped and counted by the dataset (``data/identical``).
With an ``online:`` section (online, iterative DPO) the pairs come from the policy itself: each
step the rollout engine samples answers to ``dataset``'s prompts, ``online.reward`` scores them
and each prompt's best answer is paired with its worst (``online/no_pair``: prompts without a
pair); the trained weights go back to the engine. lightrft.rollout.pairs serves either kind.

One self-contained file: copy it (`lightrft cp dpo my_dpo.py`), edit it, run the copy.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from omegaconf import DictConfig

from lightrft import config
from lightrft.algorithms.preference import (
    PREFERENCE_LOSSES,
    PreferenceLossConfig,
    ReferenceConfig,
    kto_loss,
    metric_means,
    preference_metrics,
)
from lightrft.config import option, section
from lightrft.distributed import all_reduce_sum
from lightrft.models.multimodal import check_towers, load_processors
from lightrft.rollout.pairs import OnlineConfig, open_pairs
from lightrft.sections import BatchConfig, PolicyModelConfig, check_model_path
from lightrft.strategy import build_strategy
from lightrft.training import ProgressBar, lr_scheduler, peak_memory, reset_peak_memory
from lightrft.training.export import ExportSpec
from lightrft.training.metrics import reduce_metrics
from lightrft.training.preference import (
    IndexedPreferences,
    PairCollator,
    precompute_reference,
    reference_cache_key,
)
from lightrft.training.preference import kto_reference_point as kto_z
from lightrft.training.preference import sequence_logprobs as seq_logps
from lightrft.training.run import TrainingConfig, TrainingRun, training_run


@section
class DPOConfig(TrainingConfig):
    """The whole config: the shared sections, the loss and the reference."""

    model: PolicyModelConfig = option(doc="the policy to train")
    loss: PreferenceLossConfig = option(default_factory=PreferenceLossConfig, doc="")
    reference: ReferenceConfig | None = option(None, doc="null: the start model")
    data: BatchConfig = option(flat=True)
    online: OnlineConfig | None = option(None, doc="null: dataset's pairs; else sampled")

    def resolve(self, at: str) -> DPOConfig:
        super().resolve(at)
        self.loss.check(self.reference)  # beta > 0, the loss's options, its reference
        if self.online is not None:  # online DPO: n >= 2 samples per prompt, ...
            self.online.check(self)
        if self.strategy.sequence_parallel > 1:
            raise ValueError("strategy.sequence_parallel: the dpo recipe runs without it (1)")
        self.optim.lr_scheduler.check_steps(self.data.max_steps)
        check_model_path(self.model.path, prepare=self.run.prepare)
        check_towers(self.model)
        return self


CONFIG_SCHEMA = DPOConfig.schema()
SHOWN = ("eval/accuracy", "eval/rewards/margins")  # printed at each evaluation
build_options = DPOConfig.read


class DPORecipe:
    """Build everything in ``setup``, then ``train``; the run contract is ``run``'s."""

    def __init__(self, cfg: DictConfig, opts: DPOConfig, run: TrainingRun):
        self.cfg, self.opts, self.run, self.dist = cfg, opts, run, run.dist
        lo = opts.loss
        self.spec = PREFERENCE_LOSSES[lo.type]
        self.kw = lo.options()  # unset: the paper's defaults in the loss's signature
        self.norm = (
            self.spec.length_normalize if lo.length_normalize is None else lo.length_normalize
        )
        self.nll_coef = self.spec.nll_coef if lo.nll_coef is None else lo.nll_coef

    def setup(self, cfg: DictConfig) -> None:
        o, m, d = self.opts, self.opts.model, self.opts.data
        check_model_path(m.path, loading=True)
        self.processor, self.tokenizer = load_processors(
            m.path, trust_remote_code=m.trust_remote_code, template_args=m.chat_template_args
        )
        # Data first: a bad record fails before any model loads (online: prompts, in build).
        self.pairs = open_pairs(o, self.dist, self.processor, self.tokenizer, self.spec.paired)
        self.strategy = build_strategy(o.strategy, self.dist)
        self.strategy.check_model(m.path, trust_remote_code=m.trust_remote_code)
        self.export_spec = ExportSpec.of("causal_lm", m, o.strategy)
        self.model = self.strategy.load_policy(m)
        ref = o.reference
        self.ref_path = m.path if ref is None or ref.path is None else ref.path
        # LoRA with the start as reference: the policy with its adapters off; else a frozen copy.
        self.ref = None
        if self.spec.reference and (self.strategy.needs_reference_copy or self.ref_path != m.path):
            self.ref = self.strategy.load_beside(self.ref_path, m)
        self.optimizer = self.strategy.setup(
            self.model, o.optim, micro_batch_size=d.batch_size, accum=d.gradient_accumulation_steps
        )
        self.pairs.build(self.strategy)  # online: the engine beside the policy, the prompts
        self.total_steps = d.total_steps(len(self.pairs.loader))
        self.scheduler = lr_scheduler(self.optimizer, o.optim.lr_scheduler, self.total_steps)
        # After strategy.setup: under LoRA the reference is the set-up policy, adapters off.
        self.caches = {}  # split -> the reference's table
        if ref is not None and ref.precompute:  # a reference section: the loss uses one
            self.caches["train"] = self._precompute(self.pairs.dataset, "train")
            if self.pairs.eval_dataset is not None:
                self.caches["eval"] = self._precompute(self.pairs.eval_dataset, "eval")
            self.ref = None  # its work is done: free it
        self.step, epoch, self.last_eval_step = 0, 0, None
        state = self.run.resume(**self._state())
        if state is not None:
            self.step, epoch = state.step, state.extra["epoch"]
        self.pairs.start(self.step, epoch)
        self.logger = self.run.open_logger(self.step, self.pairs.stats)

    @torch.no_grad()
    def ref_logps(self, batch: dict, split: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's ``(sums, counts)`` of every sequence of ``batch``: from the
        precomputed table of its data set's ``split``, else a forward of the frozen reference."""
        table = self.caches.get(split)
        if table is not None:
            cand, valid = batch["candidates"], batch["candidates"] >= 0  # [B, K]
            out = torch.zeros(int(cand.max()) + 1, 2)  # [N, 2]: each sequence's (sum, count)
            out[cand[valid]] = table[batch["index"]][:, : cand.shape[1]][valid]  # [B, K, 2] rows
            return out[:, 0].to(self.dist.device), out[:, 1].to(self.dist.device)
        model = self.ref if self.ref is not None else self.model
        was = model.training
        model.eval()
        with self.strategy.reference() if self.ref is None else contextlib.nullcontext():
            out = seq_logps(model, batch, self.dist.device)
        model.train(was)
        return out

    def _precompute(self, ds: IndexedPreferences, name: str) -> torch.Tensor:
        """The reference's table for ``ds``, cached at ``<output_dir>/reference_logps.<name>.pt``
        under a key of the reference's files, the data's tokens, the dtype and LoRA."""
        m, lora = self.opts.model, self.opts.strategy.lora is not None
        return precompute_reference(
            ds, PairCollator(self.tokenizer.pad_token_id), self.ref_logps,
            batch_size=self.opts.data.batch_size, dist=self.dist,
            path=self.run.output_dir / f"reference_logps.{name}.pt",
            key=reference_cache_key(self.ref_path, ds, m.dtype, lora),
        )  # fmt: skip

    # ------------------------------------------------------------------ steps

    def losses(self, batch: dict, split: str = "train") -> dict[str, torch.Tensor]:
        """Per-batch sums: loss over pairs (or examples), chosen NLL and token count, metrics."""
        sums, counts = seq_logps(self.model, batch, self.dist.device)  # [N] each
        ref_s, ref_c = self.ref_logps(batch, split) if self.spec.reference else (None, None)
        cand = batch["candidates"].to(sums.device)  # [B(+KL), K]
        real = cand[: batch["n_items"]]  # [B, K]
        bi, ki = (real[:, 1:] >= 0).nonzero(as_tuple=True)
        ci, ri = real[bi, 0], real[bi, ki + 1]  # [P]: each pair's chosen and rejected
        lo, kw = self.opts.loss, self.kw

        def logps(s, c):
            return s / c.clamp(min=1) if self.norm else s

        pol = logps(sums, counts)
        ref = logps(ref_s, ref_c) if ref_s is not None else None
        des = batch["desirable"][: batch["n_items"]].to(cand.device)  # [B, K]
        if self.spec.paired:
            args = (pol[ci], pol[ri]) + ((ref[ci], ref[ri]) if ref is not None else ())
            loss, rc, rr = self.spec.fn(*args, beta=lo.beta, **kw)
            stats = preference_metrics(rc, rr, pol[ci], pol[ri])
        else:  # KTO: every candidate is an example; z from the mismatched sequences
            ex, good = real[real >= 0], des[real >= 0]
            z = kto_z(pol, ref, cand[batch["n_items"] :])  # all ranks
            loss, rew = kto_loss(pol[ex], ref[ex], good, z, beta=lo.beta, **kw)
            stats = preference_metrics(rew[good], rew[~good], pol[ex][good], pol[ex][~good],
                                       paired=False)  # fmt: skip
        chosen = real[:, 0][des[:, 0]]  # the NLL's answers: chosen or desirable
        n_units = float(len(ci)) if self.spec.paired else float((real >= 0).sum())
        return {"loss": loss.sum(), "units": torch.tensor(n_units), "nll": -sums[chosen].sum(),
                "nll_tokens": counts[chosen].sum().detach(), **stats}  # fmt: skip

    def train_step(self, micro: list, n_real: int) -> tuple[float, float, dict]:
        """One optimizer step: (loss, grad norm, metrics); none where no prompt gave a pair."""
        if not micro:  # the weights, optimizer and schedule stay as they are
            return 0.0, 0.0, {"train/skipped": 1.0}
        # Normalise by the pairs (KTO: examples) and chosen tokens of the whole step on all
        # ranks; FSDP averages gradients over ranks, so multiply back by the world size.
        units, chosen_tokens = 0.0, 0.0
        for b in micro[:n_real]:
            real = b["candidates"][: b["n_items"]]  # [B, K]
            units += float((real[:, 1:] >= 0).sum() if self.spec.paired else (real >= 0).sum())
            seg, scored = b["segment_ids"][:, 1:], b["scored"][:, 1:]  # [R, T-1]
            chosen = real[:, 0][b["desirable"][: b["n_items"], 0]]
            chosen_tokens += float(torch.isin(seg[scored], chosen).sum())
        units, chosen_tokens = all_reduce_sum(torch.tensor([units, chosen_tokens])).clamp(min=1)
        world, sums = self.dist.world_size, {}
        for i, b in enumerate(micro):
            r = self.losses(b)
            loss = r["loss"] / units + self.nll_coef * r["nll"] / chosen_tokens
            w = 1.0 if i < n_real else 0.0  # copies evening the ranks' counts weigh nothing
            self.strategy.backward(loss * world * w)
            for k, v in {**r, "total": loss}.items():  # every rank the same keys: reduced
                sums[k] = sums.get(k, 0.0) + w * float(v.detach())
        grad_norm = self.strategy.step()
        self.scheduler.step()
        tot = reduce_metrics(sums, "sum")
        metrics = metric_means(tot, "train/")
        metrics["train/pref_loss"] = tot["loss"] / max(tot["units"], 1.0)
        metrics["train/nll"] = tot["nll"] / max(tot["nll_tokens"], 1.0)
        return tot["total"], grad_norm, metrics

    def train(self) -> None:
        bar = ProgressBar(self.total_steps, initial=self.step, desc="dpo")
        if self.step == 0:
            self._log_eval()
        t0, logged_step = time.perf_counter(), self.step
        reset_peak_memory(self.dist.device)
        for step in self.run.steps(self.step, self.total_steps, save=self._save):
            got = self.pairs.next(step)  # offline: the data set's; online: sampled, scored
            loss, grad_norm, metrics = self.train_step(got.micro, got.n_real)
            self.pairs.publish(step)  # online: the trained weights into the engine
            self.step = step
            if self.run.should_log(step, self.total_steps):
                elapsed = time.perf_counter() - t0
                self.logger.log(step, {
                    "train/loss": loss, "train/grad_norm": grad_norm,
                    "train/lr": self.scheduler.get_last_lr()[0], "train/epoch": self.pairs.epoch,
                    "time/step": elapsed / (step - logged_step), **metrics, **got.metrics,
                    **peak_memory(self.dist.device),
                })  # fmt: skip
                t0, logged_step = time.perf_counter(), step
            bar.update(1, loss=loss)
            if self.opts.data.eval_every and step % self.opts.data.eval_every == 0:
                self._log_eval()
        bar.close()
        if self.last_eval_step != self.step:
            self._log_eval()
        self.strategy.export(self.processor, self.run.output_dir / "final")

    def _state(self) -> dict:
        return {**self.strategy.checkpoint_state(), "schedulers": self.scheduler,
                "dataloaders": self.pairs.loader}  # fmt: skip

    def _save(self) -> None:
        self.run.save(self.step, **self._state(), extra={"epoch": self.pairs.epoch},
                      export=self.export_spec.to_json())  # fmt: skip

    def _log_eval(self) -> None:
        # Online: held-out greedy accuracy of the engine's weights; eval pairs: TRL's metrics.
        metrics = {**self.pairs.evaluate(), **(self.evaluate() if self.pairs.eval_loader else {})}
        if metrics:
            self.logger.log(self.step, metrics)
            shown = [f"{k} {metrics[k]:.4f}" for k in SHOWN if k in metrics]
            if self.dist.is_main:
                print(f"step {self.step}: {', '.join(shown)}", flush=True)
        self.last_eval_step = self.step

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The loss and TRL's metrics on the held-out pairs (reference computed per batch)."""
        self.model.eval()
        sums: dict[str, float] = {}
        for b in self.pairs.eval_loader:
            for k, v in self.losses(b, "eval").items():
                sums[k] = sums.get(k, 0.0) + float(v)
        self.model.train()
        tot = reduce_metrics(sums, "sum")
        out = metric_means(tot, "eval/")
        out["eval/loss"] = tot["loss"] / max(tot["units"], 1.0)
        return out


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: DPOConfig) -> None:
    with training_run(cfg, opts.run) as run:
        recipe = DPORecipe(cfg, opts, run)
        recipe.setup(cfg)
        recipe.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
