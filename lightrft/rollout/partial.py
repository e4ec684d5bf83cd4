"""Partial rollouts: a per-step token budget for generation, with the samples it cuts carried
into the next step (the idea of Kimi k1.5, arXiv:2501.12599, section 2.6.2).

A step generates until its budget of sampled tokens is spent; a sample not finished by then keeps
its tokens and their log-probs and goes on at the next step under the newer weights. Its tokens
are re-prefilled, not its KV cache kept: after a weight update the old keys and values belong to
the old policy, and the engine's :class:`~lightrft.engine.protocol.Resume` makes the continued
sample draw exactly what it would have drawn in one go (its own random stream, at its own
position), so nothing else changes.

Each token remembers the policy version that sampled it, and its log-prob is that policy's (the
behaviour log-prob): the importance correction (TIS, or ``old_logprobs: engine``) works per token,
so a sample whose tokens come from several versions is corrected token by token.

Groups: advantages compare the ``n`` samples of a prompt, so a group is trained on only when all
of its samples have finished: in the step its last sample finishes. Until then its finished
samples wait beside the unfinished ones. :class:`PartialRollouts` keeps the groups in flight, in
the order they started (the oldest are continued first), and :class:`PartialSource` tops them
up with new prompts to ``prompts_per_step`` groups each step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lightrft.engine.protocol import Completion, Resume, SamplingParams
from lightrft.rollout.engine import ColocatedEngine
from lightrft.rollout.source import ColocatedSource, SingleTurn


@dataclasses.dataclass
class Sample:
    """One sample of a group in flight: its response so far, the log-prob of each token under
    the policy that sampled it, and that policy's version per token."""

    sample_index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # None while unfinished
    text: str = ""
    carried: int = 0  # tokens it held when this step's generation began

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class Group:
    """One prompt's ``n`` samples in flight. ``prompt``: the prompt loader's fields of this
    prompt (``prompt_ids``, ``prompt``, ``reference``, ...); ``sampling``: how its ``n`` samples
    are drawn, seed included (kept across steps, so a continued sample draws from its own
    stream); ``key``: the group's name in the rollout batch (that of the step it started in)."""

    prompt: dict[str, Any]
    sampling: SamplingParams
    key: tuple
    samples: list[Sample]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def started(self) -> bool:
        return any(s.finished or s.token_ids for s in self.samples)


class PartialRollouts:
    """The groups in flight between steps (oldest first) and one step's generation.

    ``token_budget``: tokens this rank samples per step (the engine refuses one below 1).
    """

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.groups: list[Group] = []

    def add(self, prompt: dict[str, Any], sampling: SamplingParams, key: tuple) -> None:
        """A new prompt's group of ``sampling.n`` samples (``sampling.seed`` set: a continued
        sample must draw from its own stream), generated after the groups in flight."""
        if sampling.seed is None:
            raise ValueError("a partial rollout's SamplingParams needs a seed")
        samples = [Sample(j) for j in range(sampling.n)]
        self.groups.append(Group(prompt, sampling, key, samples))

    def step(self, engine: ColocatedEngine, version: int) -> tuple[list[Group], dict[str, float]]:
        """Generate under the budget with the policy ``version``; the groups that finished
        (removed from flight, in the order they started) and what the step did, logged as
        ``rollout/<name>``:

        ``generated_tokens``: tokens sampled this step (the budget, plus less than one per row).
        ``carried_tokens`` / ``carried_samples``: tokens of the trained samples sampled in earlier
        steps, and how many trained samples hold some. ``max_policy_versions``: the most policy
        versions one trained sample's tokens come from (1: all from one). ``max_version_lag``: how
        many weight updates the oldest trained token is behind the current policy.
        ``unfinished_samples``: samples cut by the budget this step, continued at the next.
        ``waiting_groups``: groups carried into the next step. ``trained_groups``: groups that
        finished this step and are trained on.

        A step trains on at least one group: when a budget finishes none, generation goes on
        (same weights, another budget) until one finishes."""
        for g in self.groups:
            for s in g.samples:
                s.carried = len(s.token_ids)
        generated = unfinished = 0
        while self.groups and not any(g.finished for g in self.groups):
            spent, unfinished = self._generate(engine, version)
            generated += spent
        done = [g for g in self.groups if g.finished]
        self.groups = [g for g in self.groups if not g.finished]
        trained = [s for g in done for s in g.samples]
        lags = [version - min(s.versions, default=version) for s in trained]
        stats = {
            "generated_tokens": generated,
            "carried_tokens": sum(s.carried for s in trained),
            "carried_samples": sum(1 for s in trained if s.carried),
            "max_policy_versions": max((len(set(s.versions)) for s in trained), default=0),
            "max_version_lag": max(lags, default=0),
            "unfinished_samples": unfinished,
            "waiting_groups": len(self.groups),
            "trained_groups": len(done),
        }
        return done, {f"rollout/{k}": float(v) for k, v in stats.items()}

    def _generate(self, engine: ColocatedEngine, version: int) -> tuple[int, int]:
        """One engine call under the budget over every unfinished sample; returns the tokens
        sampled and the samples left unfinished.

        A group not yet started is one request of ``n`` samples (one prefill); every
        unfinished sample of a started group is a request of its own that resumes it."""
        owners: list[tuple[Group, Sample | None]] = []  # None: all of a new group's samples
        for g in self.groups:
            owners += [(g, s) for s in g.samples if not s.finished] if g.started else [(g, None)]
        prompt_ids = [list(g.prompt["prompt_ids"]) for g, _ in owners]
        media = [g.prompt.get("media") for g, _ in owners]
        params = [
            g.sampling if s is None else dataclasses.replace(g.sampling, n=1) for g, s in owners
        ]
        resumes = [
            None if s is None else Resume(s.sample_index, s.token_ids, s.logprobs)
            for _, s in owners
        ]
        completions = engine.generate(
            prompt_ids, params, media, resumes=resumes, token_budget=self.token_budget
        )
        generated = unfinished = 0
        for c in completions:
            g, one = owners[c.request_index]
            s = one if one is not None else g.samples[c.sample_index]
            new = len(c.token_ids) - len(s.token_ids)
            assert new >= 0 and list(c.token_ids[: len(s.token_ids)]) == s.token_ids
            generated += new
            s.token_ids, s.logprobs = list(c.token_ids), list(c.logprobs)
            s.versions += [version] * new
            s.text = c.text or ""
            s.finish_reason = None if c.finish_reason == "partial" else c.finish_reason
            unfinished += not s.finished
        return generated, unfinished

    @staticmethod
    def completions(
        groups: Sequence[Group],
    ) -> tuple[dict[str, list], list[Completion], list[tuple]]:
        """Finished groups as the prompt loader's batch (one entry per group), their samples as
        engine completions (``request_index``: the group's place) and each row's group key."""
        keys = list(groups[0].prompt) if groups else []
        prompts = {k: [g.prompt[k] for g in groups] for k in keys}
        completions = [
            Completion(
                request_index=i,
                sample_index=s.sample_index,
                prompt_token_ids=list(g.prompt["prompt_ids"]),
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                text=s.text,
            )
            for i, g in enumerate(groups)
            for s in g.samples
        ]
        return prompts, completions, [g.key for g in groups for _ in g.samples]


class PartialSource(ColocatedSource):
    """A colocated source under a token budget per step (``rollout.partial.token_budget``, all
    ranks together): the groups in flight are topped up to this rank's prompts per step with new
    prompts, generated under the budget, and the groups that finished are the step's samples."""

    def __init__(self, opts: Any, dist: Any, record_eval: Any) -> None:
        super().__init__(opts, dist, record_eval)
        self.partial = PartialRollouts(opts.rollout.partial.token_budget // dist.world_size)
        self.queue: list[dict[str, Any]] = []  # drawn prompts not yet in flight

    def generate(self, step: int, draw: int, timer: Any) -> tuple:
        added, params = 0, self.request_params(self.per_rank, step, 0)
        while len(self.partial.groups) < self.per_rank:
            if not self.queue:
                self.epoch, batch = next(self.prompts)
                count = len(batch["prompt_ids"])
                self.queue += [{k: v[i] for k, v in batch.items()} for i in range(count)]
            self.partial.add(self.queue.pop(0), params[added], (step, 0, self.dist.rank, added))
            added += 1
        with timer("rollout"):
            done, stats = self.partial.step(self.parts.engine, self.version)
        prompts, completions, groups = PartialRollouts.completions(done)
        return prompts, completions, groups, SingleTurn().play(prompts, 1, None)[2], stats
