"""Which rollout source a GRPO-family run uses, from its config: the one place that reads the
modes (:func:`open_source` in a trainer, :func:`serve_rollouts` in an asynchronous run's
generating process, :func:`generates_here` to tell which this process is), and the parts a
source draws with (:func:`build_parts`: engine, rewards, the held-out :func:`evaluate`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from lightrft import config
from lightrft.config import Section, option, section
from lightrft.distributed import DistInfo
from lightrft.engine import Continuation
from lightrft.evaluation import evaluate_dataset, summarize
from lightrft.models.multimodal import load_processors
from lightrft.rewards import build_reward, reward_names
from lightrft.rollout.engine import ColocatedEngine
from lightrft.rollout.partial import PartialSource
from lightrft.rollout.remote import AsyncSource, serve
from lightrft.rollout.remote import generates_here as generates_here  # for the recipe
from lightrft.rollout.source import (
    ColocatedSource,
    DynamicSampling,
    MultiTurn,
    Parts,
    RolloutSource,
    SingleTurn,
)


def open_source(opts: Any, dist: Any, *, record_eval: Callable, checkpointer: Any) -> RolloutSource:
    """The source of a GRPO-family config ``opts`` (``rollout``, ``engine``, ``algorithm``,
    ``run``, ``max_steps``), unbuilt (:meth:`~RolloutSource.build` follows): fed by a
    generating process of its own (``rollout.asynchronous``; trainer rank 0 joins it here), or
    colocated; ``record_eval(step, metrics)`` takes each held-out evaluation."""
    if opts.rollout.asynchronous:
        return AsyncSource(opts, dist, record_eval, checkpointer)
    return colocated(opts, dist, record_eval)


def colocated(opts: Any, dist: Any, record_eval: Callable | None) -> RolloutSource:
    """A source over the engine in this process (also the generating process's): under a
    token budget (``rollout.partial``), or wrapped in dynamic sampling."""
    ro, shaping = opts.rollout, opts.algorithm.shaping
    if ro.partial.token_budget is not None:
        return PartialSource(opts, dist, record_eval)
    source = ColocatedSource(opts, dist, record_eval)
    if shaping.dynamic:
        return DynamicSampling(source, ro.prompts_per_step, ro.n, shaping.dynamic_sampling.draws)
    return source


@section
class HeldOutEvalConfig(Section):
    """``eval:``: greedy accuracy on ``eval_dataset`` at the start, every N steps, at the end
    (:func:`evaluate`)."""

    every: int | None = option(None, ge=1, doc="evaluate every this many steps")
    at_start: bool | None = option(None, doc="evaluate before the first step; default true")
    temperature: float | None = option(None, ge=0, doc="default 0: greedy")
    max_tokens: int | None = option(None, ge=1, doc="default rollout.max_tokens")
    accuracy_reward: str | None = option(None, doc="the reward function whose > 0 is correct")

    def resolved(self, opts: Any) -> HeldOutEvalConfig:
        """The section with its defaults, checked against ``opts``' ``eval_dataset``,
        ``reward`` and ``rollout``."""
        if self.is_set() and opts.eval_dataset is None:
            raise ValueError("the eval section needs an eval_dataset")
        names = reward_names(opts.reward)  # a CombinedReward's parts
        if self.accuracy_reward is not None and self.accuracy_reward not in names:
            raise ValueError(
                f"eval.accuracy_reward={self.accuracy_reward!r} is not a reward function; they "
                f"are {names}"
            )
        return dataclasses.replace(
            self,
            at_start=self.at_start is not False,
            temperature=float(self.temperature or 0.0),
            max_tokens=self.max_tokens or opts.rollout.max_tokens,
        )


def build_parts(
    opts: Any,
    dist: DistInfo,
    processor: Any,
    tokenizer: Any,
    strategy: Any,
    turns: SingleTurn | MultiTurn,
) -> Parts:
    """What a process that draws samples holds (:class:`Parts`): the engine (its own inference
    copy of the weights; ``strategy`` None: a generating process's, which never sleeps), the
    sampling, the reward function of ``reward:``, the request transform and the held-out
    evaluation of ``eval_dataset:``."""
    engine = opts.engine.build(opts.model.path, tokenizer, device=dist.device, seed=opts.run.seed)
    level = opts.engine.sleep_level if strategy is not None else 0
    sampling = turns.sampling(opts.rollout.sampling(), tokenizer)
    reward_fn = build_reward(opts.reward)
    names = list(getattr(reward_fn, "functions", {}) or [])
    overlong = opts.algorithm.shaping.overlong
    engine = ColocatedEngine(engine, strategy, level)
    parts = Parts(engine, tokenizer, sampling, reward_fn, names, turns, overlong, None)
    if opts.eval_dataset is not None:
        held_out = config.instantiate(opts.eval_dataset, processor)
        parts.evaluate = functools.partial(evaluate, opts, parts, held_out, dist)
    return parts


def evaluate(opts: Any, parts: Parts, dataset: Any, dist: DistInfo) -> dict[str, float]:
    """The ``eval:`` section's held-out evaluation of the engine's weights: greedy
    (``eval.temperature`` 0) generation, scored and summarised by the same code as the eval
    recipe (:func:`~lightrft.evaluation.evaluate_dataset`); each rank takes every world_size-th
    prompt and the records of all ranks are summarised together. With an environment the
    held-out prompts are played with the tools, as in training, and the final answers scored."""
    ev, names = opts.eval, parts.reward_names
    params = dataclasses.replace(
        parts.sampling,
        n=1,
        temperature=ev.temperature,
        first_token_temperature=None,
        max_tokens=ev.max_tokens,
        seed=opts.run.seed,
    )

    def generate(prompt_ids: list[list[int]], items: list, continuation: Continuation | None):
        media = [it.get("media") for it in items]
        completions = parts.engine.generate(prompt_ids, params, media, continuation)
        parts.engine.sleep()  # the engine's memory goes back before scoring
        return completions

    records = evaluate_dataset(
        dataset,
        generate,
        parts.reward_fn,
        1,
        dist,
        accuracy=ev.accuracy_reward or (names[0] if names else None),
        environment=parts.turns.environment,
        tokenizer=parts.tokenizer,
    )
    s = summarize(records, [1])
    out = {
        "eval/accuracy": s["pass@1"],
        "eval/reward": s["reward"],
        "eval/response_length": s["response_length"],
        "eval/samples": s["prompts"],
    }
    for k in names:
        out[f"eval/reward/{k}"] = s[f"reward/{k}"]
    # With an environment: the held-out episodes' env/* means (tool use, errors by kind).
    out.update({f"eval/{k}": v for k, v in s.items() if k.startswith("env/")})
    return out


def evaluates_at_start(opts: Any) -> bool:
    """The initial policy is evaluated (a resumed run's was already)."""
    return opts.eval_dataset is not None and bool(opts.eval.at_start) and not opts.run.resume


def evaluates_after(opts: Any, step: int) -> bool:
    """The policy after ``step`` is evaluated in the loop (the last step's at the end)."""
    every = opts.eval.every
    due = opts.eval_dataset is not None and every and step % every == 0
    return bool(due) and step != opts.max_steps


def serve_rollouts(opts: Any) -> None:
    """The generating process of an asynchronous run (:func:`~lightrft.rollout.remote.serve`):
    its own engine (which never sleeps), rewards and prompts; it evaluates the initial policy
    when the run does."""
    m = opts.model
    device = torch.device(opts.run.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dist = DistInfo(0, 1, 0, device)

    def source() -> tuple[Any, Callable | None]:
        processor, tokenizer = load_processors(
            m.path, trust_remote_code=m.trust_remote_code, template_args=m.chat_template_args
        )
        parts = build_parts(opts, dist, processor, tokenizer, None, SingleTurn())
        out = colocated(opts, dist, None)
        out.build(None, lambda: parts, lambda: config.instantiate(opts.dataset, processor))
        return out, parts.evaluate

    serve(source, opts, evaluate_initial=evaluates_at_start(opts))
