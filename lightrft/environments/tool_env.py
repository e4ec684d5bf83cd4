"""The tool-calling environment: the model calls tools until it answers without one."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from lightrft.config import Bound
from lightrft.environments.base import Environment, ErrorKind, Message, Step
from lightrft.environments.tool_calls import MalformedCall, ToolCall, parse_tool_calls
from lightrft.environments.tools import Tool, ToolResult, as_tool


class ToolEnvironment(Environment):
    """Answers each assistant turn's tool calls with their results as ``tool`` messages.

    A turn without a ``<tool_call>`` ends the episode: its text is the final answer that the
    rewards score. Calls of one turn run concurrently (a thread each; every call has its
    tool's time limit), and their results come back in call order, one ``tool`` message each
    (``{"role": "tool", "name": ..., "content": ...}``). Every failure (malformed call, unknown
    tool, bad arguments, exception, timeout, non-text or truncated result) is such a message
    starting with ``Error:``, and is counted in :attr:`stats`.

    Args:
        tools: :class:`~lightrft.environments.tools.Tool` objects, plain functions (wrapped
            with the default limits) or ``_component_`` mappings building either (YAML).
        max_turns: assistant turns per episode; the last one is the answer whatever it holds.
        error_penalty: per-turn reward ``-error_penalty * errors`` on turns with errors
            (0: no per-turn reward).
    """

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any] | Mapping[str, Any]],
        max_turns: Annotated[int, Bound(ge=1)] = 4,
        error_penalty: float = 0.0,
    ) -> None:
        super().__init__(max_turns=max_turns)
        self.tools: dict[str, Tool] = {}
        for t in map(as_tool, tools):
            if t.name in self.tools:
                raise ValueError(f"ToolEnvironment: two tools are named {t.name!r}")
            self.tools[t.name] = t
        if not self.tools:
            raise ValueError("ToolEnvironment: tools is empty; give at least one tool")
        if error_penalty < 0:
            raise ValueError(f"ToolEnvironment: error_penalty must be >= 0, got {error_penalty}")
        self.error_penalty = float(error_penalty)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for ``apply_chat_template(..., tools=...)``."""
        return [t.schema for t in self.tools.values()]

    def step(self, assistant_text: str) -> Step:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            return Step(done=True)

        def one(call: ToolCall | MalformedCall) -> ToolResult:
            if isinstance(call, MalformedCall):
                return ToolResult(f"Error: malformed tool call: {call.reason}", call.kind, 0.0)
            tool = self.tools.get(call.name)
            if tool is None:
                known = ", ".join(sorted(self.tools))
                text = f"Error: unknown tool {call.name!r}; the tools are: {known}"
                return ToolResult(text, ErrorKind.unknown_tool, 0.0)
            result = tool.run(call.arguments)
            self.stats.tool_seconds.append(result.seconds)
            return result

        with ThreadPoolExecutor(len(calls), thread_name_prefix="tool-call") as pool:
            results = list(pool.map(one, calls))
        errors = dict(Counter(r.error for r in results if r.error is not None))
        observation: list[Message] = []
        for call, result in zip(calls, results, strict=True):
            message: Message = {"role": "tool", "content": result.text}
            if isinstance(call, ToolCall):
                message["name"] = call.name
            observation.append(message)
        self.stats.tool_calls += len(calls)
        n_errors = sum(errors.values())
        reward = -self.error_penalty * n_errors if self.error_penalty and n_errors else None
        return Step(observation=observation, reward=reward, errors=errors)
