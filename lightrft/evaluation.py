"""Evaluation: sample k responses per prompt, score them, and report pass@k, maj@k, mean@k.

The estimators are pure functions (hand-checkable). :func:`evaluate_items` is the loop a recipe
runs on its share of the prompts: generate with any engine, score with any reward, extract
answers for the vote; :func:`summarize` turns the records of all ranks into the summary, so one
and N processes report the same numbers for the same samples. With an environment each sample
is a multi-turn episode played by :class:`~lightrft.environments.Episodes` (what GRPO's rollout
plays): the final answers are scored and voted on, and the summary adds the ``env/*`` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from statistics import fmean
from typing import Any

from lightrft.data.prompts import conversation
from lightrft.distributed import DistInfo, all_gather_objects
from lightrft.engine import Continuation
from lightrft.environments import Environment, Episode, Episodes, episode_metrics
from lightrft.rewards.base import Sample
from lightrft.rewards.math_answer import majority_vote


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021,
    arXiv:2107.03374): ``1 - C(n-c, k) / C(n, k)``, computed as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    # With n - c < k the product runs through i = k, whose factor is 0: pass@k is 1.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 if the majority answer of the first ``k`` samples is correct, else 0.0.

    Answers vote by :func:`~lightrft.rewards.math_answer.answer_key` (equal numbers vote
    together; ties go to the answer seen first); the majority answer is correct if the first
    sample that gave it is. No answer at all scores 0.
    """
    if not 1 <= k <= len(answers) or len(answers) != len(correct):
        raise ValueError(f"maj@{k} needs k <= {len(answers)} answers and one verdict per answer")
    label, _ = majority_vote(answers[:k])  # the first answer of the winning key
    return 0.0 if label is None else float(bool(correct[list(answers).index(label)]))


def mean_at_k(values: Sequence[float], k: int) -> float:
    """The mean of the first ``k`` values (mean@k: accuracy averaged over k samples)."""
    if not 1 <= k <= len(values):
        raise ValueError(f"mean@{k} needs k <= {len(values)} values")
    return math.fsum(values[:k]) / k


@dataclass
class EvalRecord:
    """One prompt's samples and their scores (a row of the per-sample JSONL)."""

    index: int
    prompt: Any
    reference: Any
    samples: list[str]
    answers: list[str | None]
    rewards: list[float]
    correct: list[bool]
    lengths: list[int]
    parts: dict[str, list[float]] = field(default_factory=dict)  # reward function -> rewards
    episodes: list[Episode] | None = None  # with an environment: each sample's episode

    def to_json(self) -> dict[str, Any]:
        """The JSONL row; with an environment, ``episodes`` holds every sample's turns (sampled
        ids, text, tool calls, observation messages and ids, errors) and its stats."""
        out = asdict(replace(self, episodes=None))
        del out["episodes"]  # a single-turn row stays as it was
        if self.episodes is not None:
            out["episodes"] = [e.record() for e in self.episodes]
        return out


def evaluate_items(
    items: Sequence[Mapping[str, Any]],
    indices: Sequence[int],
    generate: Callable[[list[list[int]], Continuation | None], list[Any]],
    reward_fn: Callable[..., Any],
    n: int,
    accuracy: str | None = None,
    extract: Callable[[str], str | None] | None = None,
    environment: Callable[[], Environment] | None = None,
    tokenizer: Any = None,
) -> list[EvalRecord]:
    """Generate ``n`` samples for each item (``prompt_ids``, ``prompt``, ``reference``,
    ``label``; ``messages`` and ``media`` give the reward its conversations), score them and
    extract their answers.

    Args:
        items, indices: the prompts of this rank and their indices in the dataset.
        generate: ``(prompt token ids, continuation)`` -> completions ordered by (prompt,
            sample), ``n`` each (an engine's ``generate`` with the sampling parameters bound);
            the continuation is None without an environment.
        reward_fn: a :class:`~lightrft.rewards.CombinedReward` (or anything called as one on
            a list of :class:`~lightrft.rewards.Sample` and returning a ``RewardOutput``).
        accuracy: the reward function whose positive reward means "correct" (``None``: the
            total).
        extract: response -> answer for maj@k (``None``: the response's normalised text).
        environment: builds one environment per sample (multi-turn): the first prompt comes
            from its ``reset`` (tools in the template's system block), each sample's final
            answer (its last assistant turn) is scored and voted on, and reward models read the
            conversation before it, as in GRPO's rollout. Needs ``tokenizer``.
    """
    episodes = None
    prompt_ids = [list(it["prompt_ids"]) for it in items]
    if environment is not None:
        if tokenizer is None:
            raise ValueError("evaluate_items: an environment needs the tokenizer")
        episodes = Episodes(environment, items, n, tokenizer)
        prompt_ids = episodes.prompt_ids
    # generate() and reward_fn() run even without items: an engine's wake-up can be a collective
    # every rank joins, and so are a sharded reward model's forwards.
    completions = generate(prompt_ids, episodes.continuation if episodes else None)
    if len(completions) != n * len(items):
        raise RuntimeError(
            f"the engine returned {len(completions)} completions for {len(items)} prompts x {n}"
        )
    rep = [it for it in items for _ in range(n)]
    if episodes is None:
        played = None
        texts = [c.text or "" for c in completions]
        chats = [conversation(it.get("messages"), it.get("media")) for it in rep]
    else:
        played = episodes.finish(completions)
        texts = [e.final_text for e in played]
        chats = [e.conversation() for e in played]
    prompts, refs = [it["prompt"] for it in rep], [it.get("reference") for it in rep]
    out = reward_fn(Sample.batch(prompts, texts, refs, [it.get("label") for it in rep], chats))
    scores = (out.parts[accuracy] if accuracy else out.total).tolist()
    totals = out.total.tolist()
    records = []
    for j, (it, idx) in enumerate(zip(items, indices, strict=True)):
        sl = slice(j * n, (j + 1) * n)
        samples = texts[sl]
        records.append(
            EvalRecord(
                index=int(idx),
                prompt=it["prompt"],
                reference=it.get("reference"),
                samples=samples,
                answers=[extract(s) if extract else s.strip() or None for s in samples],
                rewards=[float(r) for r in totals[sl]],
                correct=[float(s) > 0 for s in scores[sl]],
                lengths=[len(c.token_ids) for c in completions[sl]],
                parts={k: [float(v) for v in p.tolist()[sl]] for k, p in out.parts.items()},
                episodes=None if played is None else played[sl],
            )
        )
    return records


def evaluate_dataset(
    dataset: Sequence[Mapping[str, Any]],
    generate: Callable[[list[list[int]], list[Mapping[str, Any]], Continuation | None], list],
    reward_fn: Callable,
    n: int,
    dist: DistInfo,
    *,
    limit: int | None = None,
    **options: Any,
) -> list[EvalRecord]:
    """:func:`evaluate_items` over a dataset split across ranks (collective): each rank takes
    every world_size-th of the first ``limit`` prompts; every rank gets all records, in dataset
    order. ``generate(prompt_ids, items, continuation)``: the items ride along for their
    media; ``options``: :func:`evaluate_items`' keyword arguments (``accuracy``, ``extract``,
    ``environment``, ``tokenizer``)."""
    total = len(dataset) if limit is None else min(len(dataset), limit)
    mine = list(range(dist.rank, total, dist.world_size))
    items = [dataset[i] for i in mine]
    records = evaluate_items(
        items, mine, lambda ids, cont: generate(ids, items, cont), reward_fn, n, **options
    )
    return sorted((r for part in all_gather_objects(records) for r in part), key=lambda r: r.index)


def summarize(records: Sequence[EvalRecord], ks: Sequence[int]) -> dict[str, float]:
    """Dataset-level metrics over all records (every rank's, in any order): ``pass@k``,
    ``maj@k``, ``mean@k`` for each k in ``ks`` (k <= samples per prompt), the mean reward and
    response length, and the number of prompts and samples; with episodes, the ``env/*``
    means over every sample (:func:`~lightrft.environments.episode_metrics`)."""
    records = sorted(records, key=lambda r: r.index)
    if not records:
        raise ValueError("nothing to summarise: no records")
    n = min(len(r.samples) for r in records)
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k={bad[0]} is not in [1, {n}] (samples per prompt)")
    out: dict[str, float] = {"prompts": float(len(records)), "samples_per_prompt": float(n)}
    for k in ks:
        out[f"pass@{k}"] = fmean(pass_at_k(n, sum(r.correct[:n]), k) for r in records)
        out[f"maj@{k}"] = fmean(maj_at_k(r.answers, r.correct, k) for r in records)
        out[f"mean@{k}"] = fmean(mean_at_k([float(c) for c in r.correct], k) for r in records)
    out["reward"] = fmean(fmean(r.rewards) for r in records)
    for name in records[0].parts:
        out[f"reward/{name}"] = fmean(math.fsum(r.parts[name]) / n for r in records)
    out["response_length"] = fmean(sum(r.lengths) / len(r.lengths) for r in records)
    if records[0].episodes is not None:
        played = [e for r in records for e in r.episodes[:n]]
        response = sum(sum(r.lengths[:n]) for r in records)
        # The observation ids the episodes appended are exactly the response's unsampled ids.
        observed = sum(len(t.observation_ids) for e in played for t in e.turns)
        out.update(episode_metrics(played, response, response - observed))
    return out


class EvalHistory:
    """A training run's held-out evaluations: ``(step, accuracy, reward)`` of each
    (``history``, checkpointed), the ``eval/env/*`` means of this process's (printed only), and
    the run's closing summary lines."""

    def __init__(self, history: Sequence[Sequence[Any]] = ()) -> None:
        self.history: list[tuple[int, float, float]] = [tuple(e) for e in history]
        self.env: list[tuple[int, dict[str, float]]] = []

    def add(self, step: int, m: Mapping[str, float]) -> None:
        self.history.append((step, m["eval/accuracy"], m["eval/reward"]))
        if "eval/env/tool_use_frac" in m:
            self.env.append((step, {k: v for k, v in m.items() if "/env/" in k}))

    def summary(self, name: str, final: Any) -> list[str]:
        """First and last accuracy and reward (and held-out tool use, with an environment)."""
        lines = []
        if self.history:
            first, last = self.history[0], self.history[-1]
            lines.append(
                f"{name}: eval/accuracy {first[1]:.3f} (step {first[0]}) -> {last[1]:.3f} "
                f"(step {last[0]}); eval/reward {first[2]:.3f} -> {last[2]:.3f}; "
                f"final model in {final}"
            )
        if self.env:
            (s0, e0), (s1, e1) = self.env[0], self.env[-1]
            errors = [
                f"{k.removeprefix('eval/env/errors/')} {e0[k]:.3f} -> {e1[k]:.3f}"
                for k in sorted(e1)
                if k.startswith("eval/env/errors/") and (e0.get(k) or e1[k])
            ]
            lines.append(
                f"{name}: held-out tool use (step {s0} -> {s1}): eval/env/tool_use_frac "
                f"{e0['eval/env/tool_use_frac']:.3f} -> {e1['eval/env/tool_use_frac']:.3f}; "
                f"errors per episode: {', '.join(errors) or 'none'}"
            )
        return lines
