"""Rollout sources: where a GRPO-family step's samples come from.

A recipe calls one small interface, whatever the rollout mode (:class:`RolloutSource`):

    source = open_source(opts, ...)           # first in setup (a generating process joins)
    source.build(strategy, parts, dataset)    # once the models are loaded
    source.start(step, epoch, evaluate=...)   # after resume
    rollout = source.next(step, timer)        # the step's samples, drawn, scored, shaped
    source.publish(version, updated=..., evaluate=...)  # the trained weights to the engine
    source.drain()                            # evaluations due now are recorded
    source.close()

- :class:`ColocatedSource`: the engine in this process, beside the trainer (every rank draws
  its prompts, the batch is gathered); :class:`~lightrft.rollout.partial.PartialSource`: the
  same under a token budget per step; :class:`DynamicSampling` wraps either and draws again
  until enough groups carry signal.
- :class:`~lightrft.rollout.remote.AsyncSource`: a process of its own generates ahead of the
  trainers (``rollout.asynchronous``); it runs a colocated source over its own engine.

Multi-turn episodes are a transform of requests and completions (:class:`SingleTurn`, or the
``environment:`` section's :class:`MultiTurn`), which every source applies. The recipe hands a
source its :class:`Parts`: the engine, the rewards and the held-out evaluation it chose.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from lightrft import config
from lightrft.algorithms import DynamicSamplingAccumulator, overlong_penalty
from lightrft.data import build_dataloader, collate_prompts, conversation, epoch_batches
from lightrft.distributed import DistInfo
from lightrft.engine import SamplingParams
from lightrft.environments import (
    Episodes,
    build_environment,
    check_environment,
    episode_metrics,
    stop_at_turn_end,
)
from lightrft.rewards import Sample
from lightrft.rollout.batch import RolloutBatch
from lightrft.rollout.engine import ColocatedEngine
from lightrft.rollout.metrics import RewardSideMetrics, rollout_metrics
from lightrft.training import PhaseTimer


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One step's samples, complete when a source returns them: ``batch`` the samples to train
    on (after dynamic sampling), ``drawn`` every sample drawn (``kept`` set), ``metrics`` what
    the source logs of them (``reward/*``, ``rollout/*``, ``env/*``)."""

    batch: RolloutBatch
    drawn: RolloutBatch
    metrics: dict[str, float]


class RolloutSource(Protocol):
    """What a recipe calls; ``loader`` (the prompt loader, checkpointed) and ``epoch`` are the
    source's position in the prompts (both there after :meth:`build`)."""

    loader: Any
    epoch: int

    def build(self, strategy: Any, parts: Callable[[], Parts], dataset: Callable) -> None: ...
    def start(self, step: int, epoch: int, *, evaluate: bool) -> None: ...
    def next(self, step: int, timer: PhaseTimer) -> Rollout: ...
    def publish(self, version: int, *, updated: bool, evaluate: bool) -> None: ...
    def drain(self) -> None: ...
    def close(self) -> None: ...


@dataclasses.dataclass
class Answers:
    """What a generate call's completions answer: each sample's response text and conversation
    (what the rewards read), per-turn rewards and episodes (multi-turn only)."""

    texts: list[str]
    chats: list[Any]
    turn_rewards: list[float] | None = None
    episodes: list[Any] | None = None


class SingleTurn:
    """The plain transform: a prompt is one request, a completion's text its answer."""

    environment, tools = None, None

    def sampling(self, params: SamplingParams, tokenizer: Any) -> SamplingParams:
        return params

    def play(self, prompts: dict[str, list], n: int, tokenizer: Any) -> tuple:
        """The requests' prompt ids, the engine's continuation, and how to read completions."""
        return prompts["prompt_ids"], None, _single

    def metrics(self, drawn: RolloutBatch) -> dict[str, float]:
        return {}


def _single(completions: list, chats: list) -> Answers:
    return Answers([c.text or "" for c in completions], chats)


class MultiTurn:
    """Multi-turn episodes: an environment per trajectory (``environment``: the factory of the
    config's ``environment:`` component), played through the engine's continuation
    (:class:`~lightrft.environments.Episodes`); ``tools``: the schemas the first prompt names."""

    def __init__(self, environment: Callable[[], Any]) -> None:
        self.environment = environment
        self.tools = build_environment(environment).schemas or None  # one built to check it

    def sampling(self, params: SamplingParams, tokenizer: Any) -> SamplingParams:
        return stop_at_turn_end(params, tokenizer, self.tools)  # a turn ends at its end token

    def play(self, prompts: dict[str, list], n: int, tokenizer: Any) -> tuple:
        count = len(prompts["prompt_ids"])
        items = [{k: v[i] for k, v in prompts.items()} for i in range(count)]
        episodes = Episodes(self.environment, items, n, tokenizer)

        def answers(completions: list, chats: list) -> Answers:
            # Verifiers score the final answer (the last assistant turn); reward models read
            # the whole conversation before it, with the answer as the response.
            done = episodes.finish(completions)
            texts, chats = [e.final_text for e in done], [e.conversation() for e in done]
            return Answers(texts, chats, [e.stats.reward for e in done], done)

        return episodes.prompt_ids, episodes.continuation, answers

    def metrics(self, drawn: RolloutBatch) -> dict[str, float]:
        sampled = int(drawn.response_mask.sum())
        return episode_metrics(drawn.episodes, int(drawn.response_lens.sum()), sampled)


def turns_for(component: Any, model: Any) -> SingleTurn | MultiTurn:
    """The transform of a config's ``environment:`` section (None: single turn), checked
    against ``model``'s checkpoint (a checkpoint a ``prepare`` step wrote exists now)."""
    if component is None:
        return SingleTurn()
    check_environment(component, model.path, trust_remote_code=model.trust_remote_code)
    return MultiTurn(functools.partial(config.instantiate, component))


@dataclasses.dataclass
class Parts:
    """What a process that draws samples holds, built by the recipe: the engine beside its
    weights, the policy's tokenizer, the sampling, the reward function (a CombinedReward or one
    function) and its parts' names, the request transform, the overlong shaping section and the
    held-out evaluation of the engine's current weights (None: no eval set)."""

    engine: ColocatedEngine
    tokenizer: Any
    sampling: SamplingParams
    reward_fn: Callable
    reward_names: list[str]
    turns: SingleTurn | MultiTurn
    overlong: Any
    evaluate: Callable[[], dict[str, float]] | None


def prompt_loader(dataset: Any, batch_size: int, seed: int, rank: int, world: int) -> Any:
    """The resumable, shuffled loader of ``rank``'s prompts (``batch_size`` per draw)."""
    return build_dataloader(dataset, batch_size=batch_size, shuffle=True, seed=seed,
                            collate_fn=collate_prompts, rank=rank, world_size=world,
                            drop_last=True)  # fmt: skip


class ColocatedSource:
    """Samples drawn by the engine in this process; every rank draws its share of the step's
    prompts (``prompts_per_step / world``) and the batch is gathered, so every rank holds it."""

    def __init__(self, opts: Any, dist: DistInfo, record_eval: Callable | None) -> None:
        """``opts``: the run's config (``rollout``, ``run``); ``record_eval(step,
        metrics)`` takes each evaluation (None in a generating process: it sends them)."""
        self.dist, self.seed, self.record_eval = dist, opts.run.seed, record_eval
        self.per_rank = opts.rollout.prompts_per_step // dist.world_size
        self.reward_side = RewardSideMetrics()
        self.epoch, self.version, self.due = 0, 0, None
        self.prompts: Iterator | None = None

    def build(self, strategy: Any, parts: Callable[[], Parts], dataset: Callable[[], Any]) -> None:
        """Once the trainer's models are loaded: the engine, rewards and evaluation
        (``parts()``; the engine holds ``strategy``'s weights), then the prompts and this
        rank's shard of them."""
        self.parts = parts()
        data = dataset()
        if hasattr(data, "fit_to_engine"):  # the engine's prompt limit (every engine sets one)
            data.fit_to_engine(self.parts.engine.engine.max_model_len)
        self.loader = prompt_loader(
            data, self.per_rank, self.seed, self.dist.rank, self.dist.world_size
        )

    def start(self, step: int, epoch: int, *, evaluate: bool) -> None:
        """Draw from the loader's (resumed) position; a resumed run's weights into the engine;
        ``evaluate``: the initial policy's evaluation is due."""
        self.epoch = epoch
        self.prompts = epoch_batches(self.loader, epoch)
        if step and self.parts.engine.strategy is not None:
            self.parts.engine.strategy.sync_weights(self.parts.engine.engine)
        self.due = 0 if evaluate else None

    def next(self, step: int, timer: PhaseTimer) -> Rollout:
        drawn, stats = self.draw(step, 0, timer)
        return self.finish(drawn, list(range(len(drawn))), stats)

    def finish(self, drawn: RolloutBatch, keep: list[int], stats: dict[str, float]) -> Rollout:
        """The step's rollout from every sample drawn and the rows kept; the engine sleeps."""
        self.parts.engine.sleep()
        kept = torch.zeros(len(drawn), dtype=torch.bool)
        kept[keep] = True
        drawn = dataclasses.replace(drawn, kept=kept)
        batch = drawn.select(keep)
        metrics = {**stats, **self.reward_side.reduce()}
        metrics.update(rollout_metrics(drawn, batch, self.parts.reward_names))
        metrics.update(self.parts.turns.metrics(drawn))  # env/* (multi-turn)
        return Rollout(batch, drawn, metrics)

    def publish(self, version: int, *, updated: bool, evaluate: bool) -> None:
        """The trained weights into the engine (when the update changed them); ``evaluate``:
        their evaluation is due (run by :meth:`drain`)."""
        if updated:  # released weights are reloaded by the next generate
            self.parts.engine.sync()
            self.version += 1
        if evaluate:
            self.due = version

    def drain(self) -> None:
        """Run the evaluation that is due and record it."""
        if self.due is not None:
            step, self.due = self.due, None
            self.record_eval(step, self.parts.evaluate())

    def close(self) -> None:
        pass

    # -- one draw ------------------------------------------------------------------------------

    def request_params(self, count: int, step: int, draw: int) -> list[SamplingParams]:
        """One seed per request, a pure function of (seed, step, draw, the prompt's place in
        the step over all ranks): rank r of W holds the step's prompts r, r + W, ... (the
        loader's order), so it takes those seeds of one stream. A resumed run samples what the
        uninterrupted run sampled, also on another number of processes, and a run on W
        processes samples what one process would (one process draws the stream it always did).
        """
        world = self.dist.world_size
        gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 1_009 + draw) * 1_013)
        seeds = torch.randint(0, 2**62, (count * world,), generator=gen)
        seeds = seeds[self.dist.rank :: world].tolist()
        return [dataclasses.replace(self.parts.sampling, seed=s) for s in seeds]

    def generate(self, step: int, draw: int, timer: PhaseTimer) -> tuple:
        """This rank's prompts of one draw, generated: ``(prompts, completions, each row's
        group key, how to read the answers, stats)``."""
        self.epoch, prompts = next(self.prompts)  # this rank's, epoch after epoch
        with timer("rollout"):
            params = self.request_params(len(prompts["prompt_ids"]), step, draw)
            turns, n = self.parts.turns, self.parts.sampling.n
            prompt_ids, continuation, answers = turns.play(prompts, n, self.parts.tokenizer)
            completions = self.parts.engine.generate(
                prompt_ids, params, prompts.get("media"), continuation
            )
        groups = [(step, draw, self.dist.rank, c.request_index) for c in completions]
        return prompts, completions, groups, answers, {}

    def draw(self, step: int, draw: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict]:
        """One rollout draw: this rank's prompts, n samples each, scored and shaped; then
        gathered so every rank holds every sample (groups stay consecutive and whole)."""
        prompts, completions, groups, answers, stats = self.generate(step, draw, timer)
        rows = [c.request_index for c in completions]
        count = len(prompts.get("prompt_ids", []))
        meta = {k: [prompts[k][i] for i in rows] for k in ("prompt", "reference", "label", "where")}
        messages = prompts.get("messages") or [None] * count
        media = prompts.get("media") or [None] * count
        got = answers(completions, [conversation(messages[i], media[i]) for i in rows])
        with timer("scoring"):
            raw, parts, applied = self.score(meta, got)
            if got.turn_rewards is not None:  # per-turn rewards join the outcome reward
                raw = raw + torch.tensor(got.turn_rewards, dtype=torch.float64)
            overlong, rewards, ov = None, raw, self.parts.overlong
            if ov.buffer is not None:  # the section is set
                lengths = [len(c.token_ids) for c in completions]
                overlong = overlong_penalty(lengths, ov.max_len, ov.buffer, ov.factor).double()
                rewards = raw + overlong  # [B]
        batch = RolloutBatch.from_completions(
            completions,
            prompts,
            groups=groups,
            reward_raw=raw,
            rewards=rewards,
            overlong=overlong,
            reward_parts=parts,
            reward_applied=applied,
            episodes=got.episodes,
        )
        try:
            return batch.all_gather(), stats
        except RuntimeError as e:  # gloo / NCCL: a peer that died or hung fails it so
            raise RuntimeError(
                f"rollout step {step}: gathering every rank's samples failed ({type(e).__name__}: "
                f"{e}); a peer rank died or hung (a hung one is waited for collective_timeout_s): "
                "see its log; the run cannot go on without it"
            ) from e

    def score(self, meta: dict[str, list], got: Answers) -> tuple:
        """Rewards of this rank's samples: ``(total [B], parts, applied)``, float64 (the reward
        functions' floats as float32 values, widened). ``meta``: each sample's prompt,
        reference, label and where; ``got.chats``: its prompt as its chat with its images
        (:func:`~lightrft.data.conversation`), for reward models. Every rank has samples (its
        ``prompts_per_step / world`` >= 1 prompts; a partial step finishes a group)."""
        prompts = meta["prompt"]
        samples = Sample.batch(prompts, got.texts, meta["reference"], meta["label"], got.chats)
        out = self.parts.reward_fn(samples)
        out.check_finite(prompts, meta["where"])
        self.reward_side.add(out)
        return out.as_float64()


class DynamicSampling:
    """Dynamic sampling (DAPO, arXiv:2503.14476) around a source: draw again until
    ``prompts_per_step`` groups have reward variance (or ``max_draws`` draws), train on those."""

    def __init__(self, source: ColocatedSource, prompts_per_step: int, n: int, max_draws: int):
        self.source, self.groups, self.n, self.max_draws = source, prompts_per_step, n, max_draws

    def __getattr__(self, name: str) -> Any:  # the rest of the protocol is the source's
        return getattr(self.source, name)

    def next(self, step: int, timer: PhaseTimer) -> Rollout:
        acc = DynamicSamplingAccumulator(self.groups, self.n, max_draws=self.max_draws)
        draws: list[RolloutBatch] = []
        while not acc.done:
            d, _ = self.source.draw(step, len(draws), timer)
            start = sum(len(b) for b in draws)
            acc.add(list(range(start, start + len(d))), d.rewards.float())
            draws.append(d)
        keep, stats = acc.take()
        return self.source.finish(RolloutBatch.cat(draws), keep, stats)
