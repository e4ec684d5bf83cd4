"""Tool calls in the assistant's text, and which format a chat template expects.

The Qwen2.5 / Qwen3 / Hermes format: each call is a JSON object inside its own tags,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

and a turn may hold several. :func:`parse_tool_calls` returns them in order, each a
:class:`ToolCall` or a :class:`MalformedCall` (not JSON, no ``name``, ``arguments`` not an
object, a tag never closed), so that a malformed call becomes an error observation in its place.
A missing ``arguments`` key means ``{}``; other keys are ignored; ``arguments`` given as a JSON
*string* is malformed (the format says object, and the model should learn it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from lightrft.environments.base import ErrorKind

__all__ = [
    "HERMES",
    "MalformedCall",
    "ToolCall",
    "parse_tool_calls",
    "tool_call_format",
]

HERMES = "hermes"  # Qwen2.5 / Qwen3 / NousResearch Hermes: <tool_call>{json}</tool_call>
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments object."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` block that is not a call; ``reason`` is shown to the model."""

    text: str
    reason: str
    kind: ErrorKind = ErrorKind.malformed_call


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every ``<tool_call>`` block of ``text``, in order (empty: the turn calls no tool)."""
    out: list[ToolCall | MalformedCall] = []
    for m in _CALL.finditer(text):
        body, closed = m.group(1), bool(m.group(2))
        out.append(_parse_one(body) if closed else MalformedCall(body, f"{OPEN} without {CLOSE}"))
    return out


def _parse_one(body: str) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"the call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict):
        return MalformedCall(body, "the call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(body, "the call has no 'name' string")
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        what = type(arguments).__name__
        return MalformedCall(body, f"'arguments' must be a JSON object, got a {what}")
    return ToolCall(name, arguments)


def tool_call_format(tokenizer: Any) -> str:
    """The tool-call format of a tokenizer's chat template (:data:`HERMES` today).

    The template is probed by rendering a conversation with one tool and one tool message: it
    must show the tool's schema (it reads ``tools``), show the tool message's content (it renders
    role ``"tool"``), and speak the ``<tool_call>`` format.

    Raises:
        ValueError: naming the model (``name_or_path``) when the template lacks tool support or
            uses a tool-call format this library does not parse.
    """
    where = f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{where}: there is none, so tools cannot be described to the model")
    probe_tool = {
        "type": "function",
        "function": {
            "name": "probe_tool_name_7f3a",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }
    messages = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "asking"},
        {"role": "tool", "content": "probe_result_9c1e"},
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=[probe_tool], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # a template may raise on a role it does not know
        raise ValueError(f"{where} cannot render a tool conversation: {e}") from None
    missing = [
        what
        for what, ok in (
            ("does not render the tools it is given", "probe_tool_name_7f3a" in text),
            ("does not render tool messages", "probe_result_9c1e" in text),
        )
        if not ok
    ]
    if missing:
        raise ValueError(f"{where} has no tool support: it {' and '.join(missing)}")
    if OPEN in text or OPEN in template:
        return HERMES
    raise ValueError(
        f"{where} supports tools but in a tool-call format this library does not parse "
        f"(known: {HERMES} <tool_call>{{json}}</tool_call>)"
    )
