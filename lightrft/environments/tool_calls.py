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

Sampled text is hostile input, so parsing is bounded and never raises: a call body over
:data:`MAX_CALL_CHARS`, JSON nested deeper than :data:`MAX_DEPTH` or holding an integer past
Python's 4300-digit limit is a :class:`MalformedCall`, and past :data:`MAX_CALLS` blocks in one
turn the rest become one :class:`MalformedCall` (none of them runs).

Reasoning is not acting: a ``<tool_call>`` inside ``<think>...</think>`` (Qwen3, QwQ) is a
draft or a quotation, not a call, and is ignored, as llama.cpp's Hermes parser does. A
``</think>`` with no ``<think>`` before it (templates whose generation prompt opens the block)
makes everything before it reasoning; a ``<think>`` never closed, everything after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lightrft.environments.base import ErrorKind

HERMES = "hermes"  # Qwen2.5 / Qwen3 / NousResearch Hermes: <tool_call>{json}</tool_call>
OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_CALLS = 16  # blocks per turn that run; a turn is one assistant message
MAX_CALL_CHARS = 65536  # characters of one call's body
MAX_DEPTH = 32  # nesting of JSON arrays and objects in one call


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
    """Every ``<tool_call>`` block of ``text`` outside ``<think>`` blocks, in order (empty: the
    turn calls no tool); at most :data:`MAX_CALLS` plus one :class:`MalformedCall` for the rest.
    Linear in ``len(text)`` (``str.find``, no backtracking regex); never raises."""
    text = outside_reasoning(text)
    out: list[ToolCall | MalformedCall] = []
    at = text.find(OPEN)
    while at >= 0:
        if len(out) == MAX_CALLS:
            extra = text.count(OPEN, at)
            reason = f"more than {MAX_CALLS} tool calls in one turn: the last {extra} were not run"
            out.append(MalformedCall("", reason))
            break
        start = at + len(OPEN)
        end = text.find(CLOSE, start)
        if end < 0:
            out.append(MalformedCall(text[start : start + 200], f"{OPEN} without {CLOSE}"))
            break
        out.append(_parse_one(text[start:end]))
        at = text.find(OPEN, end + len(CLOSE))
    return out


def outside_reasoning(text: str) -> str:
    """``text`` without its ``<think>...</think>`` blocks (module docstring)."""
    head, *blocks = text.split(THINK_OPEN)
    if THINK_CLOSE in head:  # a close first: before it, reasoning
        head = head.partition(THINK_CLOSE)[2]
    # what follows an open is reasoning up to its first close; with none (an open inside a
    # block, or one never closed), all of it is
    return head + "".join(block.partition(THINK_CLOSE)[2] for block in blocks)


def _parse_one(body: str) -> ToolCall | MalformedCall:
    if len(body) > MAX_CALL_CHARS:
        return MalformedCall(
            body[:200], f"the call is longer than {MAX_CALL_CHARS} characters ({len(body)})"
        )
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"the call is not valid JSON ({e.msg} at character {e.pos})")
    except RecursionError:
        return MalformedCall(body[:200], f"the call nests deeper than {MAX_DEPTH} levels")
    except ValueError as e:  # an integer past Python's 4300-digit limit
        return MalformedCall(body[:200], f"the call is not valid JSON ({str(e)[:120]})")
    # JSON that nests arrays / objects deeper than MAX_DEPTH (iterative, stopping at the first
    # too-deep value)
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                return MalformedCall(body[:200], f"the call nests deeper than {MAX_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
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
    missing = []
    if "probe_tool_name_7f3a" not in text:
        missing.append("does not render the tools it is given")
    if "probe_result_9c1e" not in text:
        missing.append("does not render tool messages")
    if missing:
        raise ValueError(f"{where} has no tool support: it {' and '.join(missing)}")
    if OPEN in text or OPEN in template:
        return HERMES
    raise ValueError(
        f"{where} supports tools but in a tool-call format this library does not parse "
        f"(known: {HERMES} <tool_call>{{json}}</tool_call>)"
    )
