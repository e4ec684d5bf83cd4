"""SFT on multi-turn tool-use transcripts, tokenised exactly as the GRPO rollout holds them.

A transcript is a chat record: system / user messages (the prompt), then assistant turns, each
followed by its observation (``tool`` results, or ``user`` messages) except the last. An
assistant turn calls tools with ``<tool_call>{json}</tool_call>`` blocks in its content (the
Hermes / Qwen2.5 format, as the model samples it) or with OpenAI-style ``tool_calls``, which the
chat template renders into those blocks. The record's ``tools`` (JSON schemas, or names of the
shipped tools) go to the template as in the rollout's first prompt.

The ids are :func:`~lightrft.environments.render.transcript_ids`: the rollout's own prompt,
sampled-turn and observation rendering, so SFT teaches exactly the tokens GRPO samples. Labels:
the assistant turns' ids (their text, tool calls included, and their end token); everything
else (system, user, tool results, the template's text between turns) is -100.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from lightrft.config import Bound
from lightrft.data import DataError, SFTDataset
from lightrft.data.io import PathLike, Records, require_field
from lightrft.data.media import as_processor
from lightrft.data.records import Truncation
from lightrft.data.templates import IGNORE_INDEX, with_system
from lightrft.environments.render import (
    assistant_turn_text,
    require_tool_support,
    transcript_ids,
)
from lightrft.environments.tool_calls import MalformedCall, parse_tool_calls
from lightrft.environments.tools import (
    SHIPPED_TOOLS,
    Tool,
    as_text,
    shipped_tool,
    validate_arguments,
)

ROLES = ("system", "user", "assistant", "tool")
SCHEMA_SHAPE = (
    '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
)


@functools.cache
def _shipped_schema(name: str) -> dict[str, Any]:
    return shipped_tool(name).schema


def resolve_tools(value: Any, where: str, field: str) -> list[dict[str, Any]] | None:
    """A record's tools as the JSON schemas the chat template receives: each entry a schema
    (``{"type": "function", "function": {...}}``, what ``get_json_schema`` gives), a shipped
    tool's name (``calculator``, ``python``) or a :class:`Tool`. ``None`` or empty: no tools.

    Raises:
        DataError: naming ``where`` and the entry, for anything else or two tools of one name.
    """
    if value is None:
        return None
    if not isinstance(value, list):
        raise DataError(
            f"{where}: field {field!r} must be a list of tool schemas or shipped tool names, "
            f"got {type(value).__name__}"
        )
    schemas: list[dict[str, Any]] = []
    for j, tool in enumerate(value):
        if isinstance(tool, Tool):
            schemas.append(tool.schema)
        elif isinstance(tool, str):
            if tool not in SHIPPED_TOOLS:
                raise DataError(
                    f"{where}: {field}[{j}]: no shipped tool is named {tool!r}; the shipped "
                    f"tools are {', '.join(SHIPPED_TOOLS)} (or give the tool's JSON schema)"
                )
            schemas.append(_shipped_schema(tool))
        else:
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if (
                not isinstance(fn, Mapping)
                or tool.get("type") != "function"
                or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("parameters", {}), Mapping)
            ):
                raise DataError(
                    f"{where}: {field}[{j}] must be a tool schema {SCHEMA_SHAPE} or a shipped "
                    f"tool name ({', '.join(SHIPPED_TOOLS)})"
                )
            schemas.append(dict(tool))
    names = [s["function"]["name"] for s in schemas]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise DataError(f"{where}: field {field!r} has two tools named {twice[0]!r}")
    return schemas or None


def _structured_calls(calls: Any, at: str) -> list[dict[str, Any]]:
    """OpenAI-style ``tool_calls`` in the form chat templates read, with ``arguments`` an object
    (a JSON string is decoded: templates would render it as a string, which the rollout's
    parser refuses)."""
    if not isinstance(calls, list):
        raise DataError(f"{at}.tool_calls must be a list of calls, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        here = f"{at}.tool_calls[{j}]"
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if isinstance(call, Mapping) and "function" in call:
            here += ".function"
        if not isinstance(fn, Mapping):
            raise DataError(f"{here} must be an object with 'name' and 'arguments'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise DataError(f"{here}.name must be a non-empty string, got {name!r}")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{here}.arguments does not parse as JSON ({e.msg} at character {e.pos}): "
                    f"{arguments[:80]!r}"
                ) from None
        if not isinstance(arguments, dict):
            raise DataError(
                f"{here}.arguments must be a JSON object, got {type(arguments).__name__}"
            )
        ident = {"id": call["id"]} if "id" in call else {}
        out.append(
            {**ident, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return out


def check_transcript(
    tokenizer: Any,
    messages: Sequence[Any],
    tools: list[dict[str, Any]] | None,
    where: str,
    names: Sequence[str],
    tools_field: str = "tools",
) -> list[dict[str, Any]]:
    """Validate a transcript against what a rollout can produce; returns its messages with
    structured tool calls normalised. ``names[k]`` is message ``k``'s field path in the record
    (``messages[3]``) and ``tools_field`` the tools' field, for the errors.

    Raises:
        DataError: naming ``where`` and the message: an unknown role, content that is not
            text, a system message after the first assistant turn, two assistant turns with no
            observation between them, a ``tool`` message with no assistant tool call before it,
            an assistant turn whose calls are not all answered before the next one, a tool call
            that does not parse, names a tool not in ``tools`` or has arguments its schema
            refuses, a template without tool support, or a last message that is not the
            assistant's.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: the transcript must be a non-empty list of messages")
    uses_tools = tools is not None or any(
        isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls"))
        for m in messages
    )
    if uses_tools:
        try:
            require_tool_support(tokenizer)
        except ValueError as e:
            what = f"field {tools_field!r}" if tools is not None else "a tool message or tool_calls"
            raise DataError(f"{where}: {what}: {e}") from None
    by_name = {s["function"]["name"]: s for s in tools or []}
    out: list[dict[str, Any]] = []
    last = None  # index of the latest assistant turn
    made = unanswered = 0  # its tool calls, and how many have no tool message yet
    for k, m in enumerate(messages):
        at = f"{where}: {names[k]}"
        if not isinstance(m, Mapping):
            raise DataError(f"{at} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}")
        msg = dict(m)
        if role == "assistant" and msg.get("content") is None and msg.get("tool_calls"):
            msg["content"] = ""  # OpenAI's `content: null` beside tool calls
        if role == "tool" and not isinstance(msg.get("content"), str):
            # A tool's JSON result, shown as the ToolEnvironment shows one (json.dumps).
            msg["content"] = as_text(msg.get("content"))
        if not isinstance(msg.get("content"), str):
            raise DataError(f"{at}.content must be a string (tool transcripts are text)")
        if role == "assistant" and k == 0:
            raise DataError(f"{at} is an assistant turn: a transcript starts with its prompt")
        if role == "system" and last is not None:
            raise DataError(
                f"{at} is a system message after an assistant turn: a rollout shows only tool "
                "and user messages between assistant turns"
            )
        if role == "tool":
            if not unanswered:
                after = (
                    f" ({names[last]} makes {made} tool call(s), each answered already)"
                    if last is not None and made
                    else ""
                )
                raise DataError(
                    f"{at} is a tool result with no assistant tool call before it{after}"
                )
            unanswered -= 1
        if role == "assistant":
            if last is not None and unanswered:
                raise DataError(
                    f"{where}: {names[last]} makes {made} tool call(s) but only "
                    f"{made - unanswered} tool message(s) answer them before {names[k]}"
                )
            if last is not None and last == k - 1:
                raise DataError(
                    f"{at} follows the assistant turn {names[last]} with no observation between "
                    "them: a rollout's assistant turns are separated by tool or user messages"
                )
            if "tool_calls" in msg and msg["tool_calls"] is not None:
                msg["tool_calls"] = _structured_calls(msg["tool_calls"], at)
            # The turn's tool calls as the rollout's parser reads its rendered text, each
            # checked: it parses, names one of ``tools`` and fits its schema (with tools given).
            try:
                text = assistant_turn_text(tokenizer, msg, tools)
            except ValueError as e:
                raise DataError(f"{at}: {e}") from None
            calls = parse_tool_calls(text)
            inline = len(parse_tool_calls(msg["content"]))
            structured = len(msg.get("tool_calls") or [])
            if len(calls) != inline + structured:
                raise DataError(
                    f"{at}: the chat template renders {len(calls)} tool call(s) of the "
                    f"{structured} in 'tool_calls' and {inline} in 'content': it does not write "
                    "tool_calls as <tool_call> blocks"
                )
            for j, call in enumerate(calls, 1):
                if isinstance(call, MalformedCall):
                    raise DataError(
                        f"{at}: tool call {j} does not parse: {call.reason}: {call.text[:80]!r}"
                    )
                if tools is None:
                    continue
                if call.name not in by_name:
                    raise DataError(
                        f"{at}: tool call {j} names {call.name!r}, which is not among the "
                        f"record's tools ({', '.join(by_name)})"
                    )
                problem = validate_arguments(
                    by_name[call.name]["function"].get("parameters", {}), call.arguments
                )
                if problem is not None:
                    raise DataError(f"{at}: tool call {j} ({call.name!r}): {problem}")
            made = unanswered = len(calls)
            last = k
        out.append(msg)
    if out[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message ({names[-1]}, role {out[-1]['role']!r}) is not an "
            "assistant turn: a transcript ends with the assistant's final turn"
        )
    return out


class ToolSFTDataset(SFTDataset):
    """SFT samples from tool-use transcripts (and plain chats), rendered as the multi-turn
    rollout renders them (module docstring). The storage, ``max_length`` policy and ``stats``
    are :class:`~lightrft.data.SFTDataset`'s; records are always rendered with the chat template.

    Records: ``{"messages": [...], "tools": [...]}`` (``tools`` optional), or
    ``{"prompt": str | [messages], "completion": str, "tools": [...]}`` (the completion is the
    assistant's only turn). Text models only (multi-turn rollouts are text-only for now).

    Args:
        tokenizer: the model's tokenizer (the recipe passes its own as first argument).
        path, split, records: where the records are; see :class:`~lightrft.data.SFTDataset`.
        prompt_field, completion_field, messages_field: field names in the records.
        tools_field: the records' tool list: JSON schemas or shipped tool names.
        system_prompt: system message added to transcripts that do not start with one.
        max_length, truncation: as in :class:`~lightrft.data.SFTDataset`.
    """

    def __init__(
        self,
        tokenizer,
        path: PathLike | Sequence[PathLike] | None = None,
        *,
        split: str | None = None,
        records: Sequence[Mapping[str, Any]] | None = None,
        prompt_field: str = "prompt",
        completion_field: str = "completion",
        messages_field: str = "messages",
        tools_field: str = "tools",
        system_prompt: str | None = None,
        max_length: Annotated[int | None, Bound(ge=2)] = None,
        truncation: Truncation = "truncate",
    ) -> None:
        if as_processor(tokenizer)[1] is not None:
            raise ValueError(
                "ToolSFTDataset takes a text model's tokenizer: multi-turn rollouts are "
                "text-only for now, so there is no rollout rendering to match for this model"
            )
        self.tools_field = tools_field  # read by _encode, which the base __init__ calls
        super().__init__(
            tokenizer,
            path,
            split=split,
            records=records,
            prompt_field=prompt_field,
            completion_field=completion_field,
            messages_field=messages_field,
            system_prompt=system_prompt,
            apply_chat_template=True,
            max_length=max_length,
            truncation=truncation,
        )

    def _encode(self, src: Records, i: int) -> tuple[list[int], list[int], None]:
        rec, where = src[i], src.where(i)
        prompt_field, completion_field = self.prompt_field, self.completion_field
        messages_field, system_prompt = self.messages_field, self.system_prompt
        if rec.get(messages_field) is not None:
            msgs = rec[messages_field]
            names = (
                [f"{messages_field}[{k}]" for k in range(len(msgs))]
                if isinstance(msgs, list)
                else []
            )
        elif prompt_field in rec or completion_field in rec:
            prompt = require_field(src, i, prompt_field, (str, list))
            completion = require_field(src, i, completion_field, str)
            if isinstance(prompt, str):
                msgs, names = [{"role": "user", "content": prompt}], [prompt_field]
            else:
                msgs, names = list(prompt), [f"{prompt_field}[{k}]" for k in range(len(prompt))]
            msgs.append({"role": "assistant", "content": completion})
            names.append(completion_field)
        else:
            keys = ", ".join(sorted(map(str, rec))) or "none"
            raise DataError(
                f"{where}: missing field {messages_field!r} (a transcript) or {prompt_field!r} "
                f"and {completion_field!r}; the record has: {keys}. Set messages_field or "
                "prompt_field/completion_field to your field names"
            )
        tools = resolve_tools(rec.get(self.tools_field), where, self.tools_field)
        msgs = check_transcript(self.tokenizer, msgs, tools, where, names, self.tools_field)
        msgs, _ = self.media.messages(src, i, msgs)  # refuses images / audio for a text model
        try:
            ids, sampled = transcript_ids(self.tokenizer, with_system(msgs, system_prompt), tools)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        labels = [t if s else IGNORE_INDEX for t, s in zip(ids, sampled, strict=True)]
        return ids, labels, None
