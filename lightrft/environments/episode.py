"""Multi-turn rollouts on the engine's continuation: one environment per trajectory.

:class:`Episodes` is what a recipe's rollout holds for one ``engine.generate`` call with an
environment: it builds one :class:`~lightrft.environments.base.Environment` per trajectory from
the config's factory, renders each prompt's first turn (:meth:`Episodes.prompt_ids`, the tools
in the template's system block), and answers the engine's :class:`~lightrft.engine.protocol.Turn`
s (:meth:`Episodes.continuation`): decode the turn's sampled ids (for parsing only; the ids
themselves stay in the trajectory), ``env.step(text)``, and the observation's ids rendered by the
chat template, or None when the episode is done. Each trajectory's turns are kept as an
:class:`Episode`: the final answer's text for the verifiers, the whole conversation for reward
models, per-turn rewards, :class:`~lightrft.environments.base.EpisodeStats` and the record the
trajectory files write.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightrft.engine.protocol import Completion, SamplingParams, Turn
from lightrft.environments.base import (
    Environment,
    EpisodeStats,
    Message,
    aggregate_stats,
)
from lightrft.environments.render import (
    assistant_end_token,
    initial_prompt_ids,
    observation_ids,
    require_tool_support,
)
from lightrft.models.multimodal import checkpoint_is_multimodal


@dataclass
class TurnRecord:
    """One assistant turn and the environment's answer to it.

    ``observation_ids`` are the ids appended after the turn; ``observation_dropped``: the
    observation did not fit the trajectory's token budget (the engine ends the row ``"length"``
    without it). The fields, in this order, are what a trajectory file keeps of the turn."""

    token_ids: list[int]
    text: str
    observation: list[Message] = field(default_factory=list)
    observation_ids: list[int] = field(default_factory=list)
    observation_dropped: bool = False
    reward: float | None = None
    tool_calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class Episode:
    """One trajectory's environment side: its first messages, its turns and its stats."""

    messages: list[Message]
    turns: list[TurnRecord] = field(default_factory=list)
    stats: EpisodeStats = field(default_factory=EpisodeStats)
    final_text: str = ""

    def conversation(self) -> list[Message]:
        """The chat before the final answer: first messages, then each earlier assistant turn
        and its observation (what a reward model reads, with the final answer as response)."""
        out = [dict(m) for m in self.messages]
        for turn in self.turns:
            if not turn.observation or turn.observation_dropped:
                break
            out.append({"role": "assistant", "content": turn.text})
            out.extend(dict(m) for m in turn.observation)
        return out

    def record(self) -> dict[str, Any]:
        """What a trajectory file keeps of the episode: every turn with its sampled ids,
        text, observation (messages and ids), reward, tool calls and errors."""
        s = self.stats
        return {
            "messages": self.messages,
            "turns": [dataclasses.asdict(t) for t in self.turns],
            "final_text": self.final_text,
            "stats": {**dataclasses.asdict(s), "errors": {str(k): v for k, v in s.errors.items()}},
        }


class Episodes:
    """The environments of one generate call: ``n`` trajectories per prompt item.

    Args:
        factory: builds a fresh environment (the config's ``environment:`` component).
        items: the prompt items (dataset records) in request order.
        n: trajectories per item.
        tokenizer: the policy's tokenizer (its chat template renders prompts and observations).
    """

    def __init__(
        self,
        factory: Callable[[], Environment],
        items: Sequence[Mapping[str, Any]],
        n: int,
        tokenizer: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()  # one tokenizer, continuations on several threads
        self.envs: dict[tuple[int, int], Environment] = {}
        self.episodes: dict[tuple[int, int], Episode] = {}
        self.prompt_ids: list[list[int]] = []
        for i, item in enumerate(items):
            for j in range(n):
                env = build_environment(factory)
                messages = env.reset(item)
                if j and messages != self.episodes[i, 0].messages:
                    raise ValueError(
                        f"{type(env).__name__}.reset gave different first messages for the same "
                        "item: the trajectories of a GRPO group must share their prompt"
                    )
                self.envs[i, j] = env
                self.episodes[i, j] = Episode(messages=messages, stats=env.stats)
            # the group's first messages: each trajectory's are equal to them
            self.prompt_ids.append(
                initial_prompt_ids(tokenizer, messages, self.envs[i, 0].schemas or None)
            )

    def continuation(self, turn: Turn) -> list[int] | None:
        """The engine's continuation: step the trajectory's environment with the turn's text;
        its observation's ids, or None when the episode is done."""
        key = (turn.request_index, turn.sample_index)
        env, episode = self.envs[key], self.episodes[key]
        with self.lock:
            text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        calls_before = env.stats.tool_calls
        step = env.step(text)
        record = TurnRecord(
            token_ids=list(turn.token_ids),
            text=text,
            reward=step.reward,
            errors={str(k): v for k, v in step.errors.items()},
            tool_calls=env.stats.tool_calls - calls_before,
        )
        episode.turns.append(record)
        episode.stats = env.stats
        if step.done:
            return None
        record.observation = [dict(m) for m in step.observation]
        with self.lock:
            ids = observation_ids(self.tokenizer, step.observation, env.schemas or None)
        if len(ids) > turn.max_observation_tokens:
            record.observation_dropped = True  # the engine drops it and ends the row "length"
        else:
            record.observation_ids = ids
        return ids

    def finish(self, completions: Sequence[Completion]) -> list[Episode]:
        """Each completion's episode, in completion order, with its final answer's text: the
        last assistant turn's sampled ids (a turn the budget cut included), decoded. Its
        ``stats.turns`` become the trajectory's assistant turns (the budget's cut one too,
        which the environment never saw)."""
        out = []
        for c in completions:
            episode = self.episodes[c.request_index, c.sample_index]
            start = c.turn_spans[-1][0] if c.turn_spans else 0
            episode.stats.turns = len(c.turn_spans) if c.turn_spans else 1
            with self.lock:
                episode.final_text = self.tokenizer.decode(
                    c.token_ids[start:], skip_special_tokens=True
                )
            out.append(episode)
        return out


def build_environment(factory: Callable[[], Any]) -> Environment:
    """A fresh environment from the factory, refusing anything that is not an Environment."""
    env = factory()
    if not isinstance(env, Environment):
        raise TypeError(
            f"environment: the component built a {type(env).__name__}, not an "
            "lightrft.environments.Environment"
        )
    return env


def check_environment(
    environment: Mapping[str, Any] | None, model_path: str, *, trust_remote_code: bool = False
) -> None:
    """The rules of a recipe's ``environment:`` section that need the model, in one function so
    that the recipes that take the section (GRPO, eval) refuse the same inputs with the same
    messages: refuse an ``environment:`` section the model at ``model_path`` cannot play: a
    vision- or audio-language model (multi-turn rollouts take text models), and, when ``tools``
    are configured, a chat template without tool support or with a tool-call format this
    library does not parse. Each ``ValueError`` names the key.

    Read from the checkpoint's ``config.json`` and tokenizer, before any model loads; a path
    without a local ``config.json`` yet (a hub id, or one a ``prepare`` step writes) is not
    checked, so recipes call this again in setup, once ``prepare`` has run. Unknown keys, a tool
    that cannot be imported and ``max_turns < 1`` are the component checker's
    (:mod:`lightrft.config`), which every recipe's schema runs on the section."""
    if environment is None or not (Path(model_path) / "config.json").exists():
        return
    if checkpoint_is_multimodal(model_path):
        raise ValueError(
            f"environment: multi-turn rollouts take a text model; {model_path} is "
            "vision- or audio-language"
        )
    if environment.get("tools"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        try:
            require_tool_support(tok)
        except ValueError as e:
            raise ValueError(f"environment.tools: {e}") from None


def stop_at_turn_end(
    params: SamplingParams, tokenizer: Any, tools: Sequence[dict[str, Any]] | None
) -> SamplingParams:
    """``params`` with the chat template's assistant end token (``<|im_end|>``) among its stop
    ids: a turn must stop there for the engine to hand it to the continuation."""
    end = tokenizer.convert_tokens_to_ids(assistant_end_token(tokenizer, tools))
    if end in params.stop_token_ids:
        return params
    return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, end])


def episode_metrics(
    episodes: Sequence[Episode], response_tokens: int, sampled_tokens: int
) -> dict[str, float]:
    """``env/*`` means over the step's trajectories (turns, tool calls, errors per kind,
    truncated share, tool latency; :func:`aggregate_stats`), the mean summed per-turn reward,
    and the share of response tokens that are observations."""
    m = aggregate_stats([e.stats for e in episodes], prefix="env/")
    m["env/turn_reward"] = sum(e.stats.reward for e in episodes) / max(len(episodes), 1)
    observed = response_tokens - sampled_tokens
    m["env/observation_token_frac"] = observed / max(response_tokens, 1)
    return m
