"""Where a preference recipe's pairs come from (recipes/dpo.py), one interface for both kinds:

    pairs = open_pairs(opts, dist, processor, tokenizer, paired)  # data first, no model yet
    pairs.build(strategy)      # the policy is loaded: online, the engine beside it
    pairs.start(step, epoch)   # after resume
    got = pairs.next(step)     # StepPairs: this rank's micro-batches of one optimizer step
    pairs.publish(step)        # the trained weights to the engine (online)
    pairs.evaluate()           # held-out greedy accuracy of the engine's weights (online)

- :class:`OfflinePairs`: a :class:`~lightrft.data.PreferenceDataset`'s pairs, epoch by epoch.
- :class:`OnlinePairs` (the ``online:`` section; online, iterative DPO): each step the rollout
  engine samples ``online.rollout.n`` answers to each of ``prompts_per_step`` prompts of
  ``dataset``, ``online.reward`` scores them (verifier, reward model, judge) and
  :func:`~lightrft.algorithms.preference.best_worst_pairs` makes each prompt's pair; the metrics
  count the prompts that gave none (``online/no_pair``). It draws with a
  :class:`~lightrft.rollout.source.ColocatedSource`, as GRPO does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightrft import config
from lightrft.algorithms.config import ShapingConfig
from lightrft.algorithms.preference import PairRuleConfig, best_worst_pairs
from lightrft.config import Component, Section, option, section
from lightrft.data import StepCollator, step_batches
from lightrft.data.preference import item_tokens
from lightrft.distributed import even_micro_batches
from lightrft.engine.config import RolloutConfig
from lightrft.rollout.build import HeldOutEvalConfig, build_parts
from lightrft.rollout.engine import RolloutEngineConfig
from lightrft.rollout.source import ColocatedSource, SingleTurn
from lightrft.training import PhaseTimer
from lightrft.training.loaders import step_loaders
from lightrft.training.preference import IndexedPreferences, PairCollator


@section
class OnlineConfig(Section):
    """``online:`` (online DPO): ``dataset`` holds prompts; each step's pairs are sampled."""

    reward: Component = option(doc="a CombinedReward or one reward function, model or judge")
    rollout: RolloutConfig = option(doc="prompts_per_step, n >= 2 samples each, max_tokens")
    engine: RolloutEngineConfig = option(default_factory=RolloutEngineConfig, doc="")
    pairs: PairRuleConfig = option(default_factory=PairRuleConfig, doc="")

    def check(self, opts: Any) -> None:
        """Refuse, by key, what online DPO cannot run with (``opts``: the DPO config)."""
        ro, d = self.rollout, opts.data
        if ro.n < 2:
            raise ValueError(
                f"online.rollout.n={ro.n}: online DPO pairs the best of a prompt's samples "
                "against its worst; set online.rollout.n >= 2"
            )
        if ro.asynchronous or ro.partial.token_budget is not None:
            key = "asynchronous" if ro.asynchronous else "partial.token_budget"
            raise ValueError(f"online.rollout.{key}: online DPO draws with the colocated engine")
        if opts.reference is not None and opts.reference.precompute:
            raise ValueError(
                "reference.precompute: online DPO samples its pairs each step, there is no data "
                "set to precompute; set reference.precompute=false"
            )
        if d.gradient_accumulation_steps != 1:
            raise ValueError(
                "gradient_accumulation_steps: an online DPO step trains on the pairs of its "
                "online.rollout.prompts_per_step prompts; leave it at 1"
            )
        for key in ("dataset", "eval_dataset"):
            if "Preference" in str(getattr(getattr(d, key), "_component_", "")):
                raise ValueError(
                    f"{key}: online DPO samples its own answers to prompts; use "
                    "lightrft.data.PromptDataset (or set online: null for offline pairs)"
                )
        self.engine.check_device(opts.run.device, self.engine.sleep_level)


@dataclasses.dataclass(frozen=True)
class _Algorithm:
    shaping: ShapingConfig = dataclasses.field(default_factory=ShapingConfig)


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """What a rollout source reads of a GRPO config, from a DPO config's sections."""

    model: Any
    run: Any
    reward: Component
    rollout: RolloutConfig
    engine: RolloutEngineConfig
    eval_dataset: Component | None
    eval: HeldOutEvalConfig = dataclasses.field(default_factory=HeldOutEvalConfig)
    algorithm: _Algorithm = dataclasses.field(default_factory=_Algorithm)


@dataclasses.dataclass(frozen=True)
class StepPairs:
    """One optimizer step's pairs on this rank: its micro-batches (:class:`PairCollator`
    batches; the first ``n_real`` carry weight; none: no pair on any rank) and metrics."""

    micro: list[dict[str, Any]]
    n_real: int
    metrics: dict[str, float]


class OfflinePairs:
    """The pairs of ``dataset`` (and ``eval_dataset``, :attr:`eval_loader`), a resumable loader
    whose batches are a step's micro-batches; refused before any model loads when it gives
    less than one step."""

    def __init__(self, opts: Any, dist: Any, processor: Any, tokenizer: Any, collate: PairCollator):
        d, self.dist = opts.data, dist
        raw = config.instantiate(d.dataset, processor)
        self.stats, eos = raw.stats, None if raw.chat_template else tokenizer.eos_token_id
        self.dataset, self.eval_dataset = IndexedPreferences(raw, eos), None
        if d.eval_dataset is not None:
            self.eval_dataset = IndexedPreferences(
                config.instantiate(d.eval_dataset, processor), eos
            )
        self.uneven = d.micro_batch_tokens is not None
        self.loader, self.eval_loader = step_loaders(
            self.dataset, self.eval_dataset, collate, d, seed=opts.run.seed, dist=dist,
            what="pairs", length=item_tokens,
        )  # fmt: skip

    def build(self, strategy: Any) -> None:
        pass

    def start(self, step: int, epoch: int) -> None:
        self.epoch = epoch
        self.batches = step_batches(self.loader, epoch, uneven=self.uneven, device=self.dist.device)

    def next(self, step: int) -> StepPairs:
        self.epoch, micro, n_real = next(self.batches)
        return StepPairs(micro, n_real, {})

    def publish(self, step: int) -> None:
        pass

    def evaluate(self) -> dict[str, float]:
        return {}


class OnlinePairs:
    """Each step's pairs sampled by the policy (module docstring); ``eval_dataset`` holds
    held-out prompts (:meth:`evaluate`: greedy accuracy, as GRPO's ``eval/accuracy``)."""

    eval_loader = eval_dataset = None

    def __init__(self, opts: Any, dist: Any, processor: Any, tokenizer: Any, collate: PairCollator):
        on, d = opts.online, opts.data
        self.view = SourceOptions(opts.model, opts.run, on.reward, on.rollout, on.engine,
                                  d.eval_dataset)  # fmt: skip
        self.view = dataclasses.replace(self.view, eval=HeldOutEvalConfig().resolved(self.view))
        self.dist, self.rule, self.timer = dist, on.pairs, PhaseTimer()
        self.source = ColocatedSource(self.view, dist, None)
        self.parts = lambda strategy: build_parts(self.view, dist, processor, tokenizer,
                                                  strategy, SingleTurn())  # fmt: skip
        self.prompts = lambda: config.instantiate(d.dataset, processor)
        self.collate = collate
        # A step's items into micro-batches of data.batch_size (data.micro_batch_tokens).
        self.step_collate = StepCollator(
            self.collate, d.batch_size, d.micro_batch_tokens, packing=d.packing, length=item_tokens
        )

    def build(self, strategy: Any) -> None:
        self.source.build(strategy, lambda: self.parts(strategy), self.prompts)
        self.loader = self.source.loader  # the prompts' position, checkpointed
        self.stats = getattr(self.loader.dataset, "stats", None)

    @property
    def epoch(self) -> int:
        return self.source.epoch

    def start(self, step: int, epoch: int) -> None:
        self.source.start(step, epoch, evaluate=False)

    def next(self, step: int) -> StepPairs:
        """Sample, score, pair; this rank takes every world_size-th pair (all ranks hold the
        gathered samples, so they agree on the pairs and on skipping a step without any)."""
        rollout = self.source.next(step, self.timer)
        b = rollout.batch
        pairs, unpaired = best_worst_pairs(b.rewards, b.groups, b.texts, self.rule.min_margin)
        mine = range(self.dist.rank, len(pairs), self.dist.world_size)
        items = [_pair_item(b, i, *pairs[i]) for i in mine]
        n = len(pairs)
        metrics = {**rollout.metrics, **self.timer.summary(), "online/pairs": float(n),
                   "online/no_pair": float(unpaired),
                   "online/no_pair_frac": unpaired / max(n + unpaired, 1)}  # fmt: skip
        if n == 0:
            return StepPairs([], 0, metrics)
        micro = self.step_collate(items) if items else [self.collate([_pair_item(b, 0, 0, 0)])]
        micro, n_real = even_micro_batches(micro, self.dist.device)
        return StepPairs(micro, n_real if items else 0, metrics)

    def publish(self, step: int) -> None:
        self.source.publish(step, updated=True, evaluate=False)

    def evaluate(self) -> dict[str, float]:
        return self.source.parts.evaluate() if self.source.parts.evaluate else {}


def _pair_item(b: Any, index: int, chosen: int, rejected: int) -> dict[str, Any]:
    """A :class:`PairCollator` item of rows ``chosen`` over ``rejected`` of a rollout batch."""
    prompt = b.prompt_ids[chosen, : b.prompt_lens[chosen]]
    seqs = [
        torch.cat([prompt, b.response_ids[k, : b.response_lens[k]]]) for k in (chosen, rejected)
    ]
    media = None if b.media is None else b.media[chosen]
    return {"sequences": seqs, "starts": [len(prompt)] * 2, "safe": [0, 0], "margin": 0.0,
            "head": None, "media": media, "index": index}  # fmt: skip


def open_pairs(opts: Any, dist: Any, processor: Any, tokenizer: Any, paired: bool):
    """The pairs of a DPO config: sampled each step (``online:`` set) or from ``dataset``."""
    d = opts.data
    collate = PairCollator(tokenizer.pad_token_id, packing=d.packing,
                           max_tokens=d.max_tokens_per_row, mismatched=not paired)  # fmt: skip
    kind = OfflinePairs if opts.online is None else OnlinePairs
    return kind(opts, dist, processor, tokenizer, collate)
