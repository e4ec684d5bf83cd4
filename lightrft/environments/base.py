"""The environment protocol: what a multi-turn rollout talks to between assistant turns.

One :class:`Environment` instance plays one episode (one trajectory): the rollout makes one per
row from the config's factory, calls :meth:`Environment.reset` with the dataset item to get the
first messages, then :meth:`Environment.step` with each assistant turn's text until a
:class:`Step` says ``done`` or ``max_turns`` assistant turns have been played.

``reset`` and ``step`` of every subclass are wrapped (``__init_subclass__``) so that a wrong
return type is refused with a message naming the class and the method, the turn budget is
enforced in one place, and :class:`EpisodeStats` counts turns and errors for every environment,
not only the tool-calling one.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from lightrft.config import Bound
from lightrft.data.templates import prompt_turns

Message = dict[str, Any]  # a chat message: {"role": ..., "content": ...}
OBSERVATION_ROLES = ("tool", "user")


class ErrorKind(str, enum.Enum):
    """Why a tool call did not give the model a normal result. Each becomes an error observation
    the model reads (never a crash) and is counted per episode. (``str, Enum`` rather than
    ``StrEnum``: Python 3.10 is supported.)"""

    def __str__(self) -> str:
        return self.value

    malformed_call = "malformed_call"  # not JSON, no name, arguments not an object, unclosed tag
    unknown_tool = "unknown_tool"
    bad_arguments = "bad_arguments"  # missing / unknown keys, wrong JSON type, not in the enum
    tool_exception = "tool_exception"  # the tool raised
    tool_timeout = "tool_timeout"  # past the per-call time limit (or the tool's own clock)
    tool_output_truncated = "tool_output_truncated"  # the result was cut to the bound
    non_text_result = "non_text_result"  # neither str nor JSON data


@dataclass
class Step:
    """An environment's answer to one assistant turn.

    Attributes:
        observation: messages for the model (role ``"tool"`` or ``"user"``), rendered by the
            model's chat template after the assistant turn; empty when ``done``.
        reward: an optional per-turn reward, summed into the trajectory's reward.
        done: the episode is over; the last assistant turn is the final answer.
        errors: counted error kinds of this turn.
    """

    observation: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    errors: dict[ErrorKind, int] = field(default_factory=dict)


@dataclass
class EpisodeStats:
    """What one episode did, for the rollout's metrics (:func:`aggregate_stats`).

    ``truncated``: the turn budget ended an episode the environment wanted to continue.
    """

    turns: int = 0
    tool_calls: int = 0
    errors: dict[ErrorKind, int] = field(default_factory=dict)
    tool_seconds: list[float] = field(default_factory=list)
    reward: float = 0.0  # sum of the per-turn rewards
    truncated: bool = False


def aggregate_stats(stats: Sequence[EpisodeStats], prefix: str = "env/") -> dict[str, float]:
    """Means over episodes (turns, tool calls, the share of episodes with a tool call, errors
    per kind, truncated share) and tool latency (mean and max seconds per call)."""
    n = max(len(stats), 1)
    out = {
        f"{prefix}turns": sum(s.turns for s in stats) / n,
        f"{prefix}tool_calls": sum(s.tool_calls for s in stats) / n,
        f"{prefix}tool_use_frac": sum(s.tool_calls > 0 for s in stats) / n,
        f"{prefix}truncated": sum(s.truncated for s in stats) / n,
    }
    for kind in ErrorKind:
        out[f"{prefix}errors/{kind}"] = sum(s.errors.get(kind, 0) for s in stats) / n
    seconds = [t for s in stats for t in s.tool_seconds]
    out[f"{prefix}tool_seconds_mean"] = sum(seconds) / len(seconds) if seconds else 0.0
    out[f"{prefix}tool_seconds_max"] = max(seconds, default=0.0)
    return out


class Environment:
    """Base class of environments. Subclasses implement :meth:`step` (and :meth:`reset` when the
    first messages are not the item's prompt) and call ``super().__init__(max_turns=...)``.

    Args:
        max_turns: assistant turns per episode (1: a single-turn episode).
    """

    def __init__(self, max_turns: Annotated[int, Bound(ge=1)] = 1) -> None:
        check_max_turns(max_turns, type(self).__name__)
        self.max_turns = max_turns
        self.stats = EpisodeStats()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, checked in (("reset", _checked_reset), ("step", _checked_step)):
            if name in cls.__dict__:
                setattr(cls, name, checked(cls.__dict__[name], cls.__name__))

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schemas of the environment's tools, which the chat template renders into
        the first prompt's system block; none by default."""
        return []

    def reset(self, item: Mapping[str, Any]) -> list[Message]:
        """The first messages of an episode; by default the item's chat (``messages``, as
        :class:`~lightrft.data.prompts.PromptDataset` keeps it) or its ``prompt`` as one user
        message."""
        self.stats = EpisodeStats()
        messages = item.get("messages")
        prompt = messages if messages is not None else item.get("prompt")
        if prompt is None:
            raise ValueError(
                f"{type(self).__name__}.reset: the item has neither 'messages' nor 'prompt' "
                f"(keys: {sorted(item)})"
            )
        return prompt_turns(prompt)

    def step(self, assistant_text: str) -> Step:
        """Answer one assistant turn."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(assistant_text)")


def check_max_turns(max_turns: Any, owner: str) -> None:
    """Refuse a turn budget that is not a positive int, naming the key."""
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        hint = " (call super().__init__(max_turns=...))" if max_turns is None else ""
        raise ValueError(f"{owner}: max_turns must be an int >= 1, got {max_turns!r}{hint}")


def _check_messages(value: Any, where: str) -> None:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise TypeError(
            f"{where} must return a list of message dicts, got a {type(value).__name__}"
        )
    for m in value:
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise TypeError(f"{where} returned a message without a 'role' str or 'content': {m!r}")


def _checked_reset(fn, cls_name: str):
    @functools.wraps(fn)
    def reset(self: Environment, item: Mapping[str, Any]) -> list[Message]:
        check_max_turns(getattr(self, "max_turns", None), cls_name)
        out = fn(self, item)
        self.stats = EpisodeStats()  # a subclass's reset need not call super()
        _check_messages(out, f"{cls_name}.reset")
        return out

    return reset


def _checked_step(fn, cls_name: str):
    @functools.wraps(fn)
    def step(self: Environment, assistant_text: str) -> Step:
        where = f"{cls_name}.step"
        if self.__dict__.get("stepping"):  # super().step() of a subclass: the outer call checks
            return fn(self, assistant_text)
        check_max_turns(getattr(self, "max_turns", None), cls_name)
        self.__dict__["stepping"] = True
        try:
            out = fn(self, assistant_text)
        finally:
            self.__dict__["stepping"] = False
        if not isinstance(out, Step):
            raise TypeError(f"{where} must return a Step, got a {type(out).__name__}")
        _check_messages(out.observation, where + " (Step.observation)")
        bad = [m["role"] for m in out.observation if m["role"] not in OBSERVATION_ROLES]
        if bad:
            raise TypeError(f"{where}: observation roles must be 'tool' or 'user', got {bad}")
        if out.reward is not None:
            if isinstance(out.reward, bool) or not isinstance(out.reward, int | float):
                raise TypeError(f"{where}: Step.reward must be a float or None, got {out.reward!r}")
            if not math.isfinite(out.reward):
                raise ValueError(f"{where}: Step.reward must be finite, got {out.reward!r}")
        if not isinstance(out.done, bool):
            raise TypeError(f"{where}: Step.done must be a bool, got {out.done!r}")
        if not isinstance(out.errors, dict) or not all(
            isinstance(k, ErrorKind) and isinstance(v, int) for k, v in out.errors.items()
        ):
            raise TypeError(f"{where}: Step.errors must map ErrorKind to int, got {out.errors!r}")
        if not out.done and not out.observation:
            raise ValueError(f"{where}: a Step that is not done needs an observation")
        stats = self.__dict__.setdefault("stats", EpisodeStats())
        stats.turns += 1
        for kind, n in out.errors.items():
            stats.errors[kind] = stats.errors.get(kind, 0) + n
        stats.reward += out.reward or 0.0
        if not out.done and stats.turns >= self.max_turns:
            stats.truncated = True  # the budget ends it; the observation is never shown
            out = replace(out, observation=[], done=True)
        return out

    return step
