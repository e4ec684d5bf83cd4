"""Token ids of observations, rendered by the model's own chat template.

A multi-turn trajectory is one token sequence: the prompt, then the ids the engine sampled for
an assistant turn (ending at its stop token, e.g. ``<|im_end|>``), then the observation's ids,
then the next assistant turn, and so on. The sampled ids are never decoded and re-encoded; the
observation ids are what the template would have produced between two assistant turns:

    observation_ids = render(history + [assistant] + observation, generation prompt)
                      minus render(history + [assistant]) up to the assistant's end token

so they hold the template's text after the end token (Qwen's ``"\\n"``), the observation's turn
and the next assistant turn's generation prompt. The end of the assistant turn is a special
token, so tokenising the rest separately gives the ids the whole rendering would have there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightrft.environments.base import Message
from lightrft.environments.tool_calls import tool_call_format
from lightrft.environments.tools import Tool

__all__ = [
    "assistant_end_token",
    "initial_prompt_ids",
    "observation_ids",
    "require_tool_support",
]

_SENTINEL = "sentinel-reply-5d2b"
_HISTORY: list[Message] = [{"role": "user", "content": "question"}]

ToolsArg = Sequence[Tool | dict[str, Any]] | None


def _schemas(tools: ToolsArg) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [t.schema if isinstance(t, Tool) else t for t in tools]


def _render(tokenizer: Any, messages: list[Message], tools: ToolsArg, generation: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=_schemas(tools), tokenize=False, add_generation_prompt=generation
    )


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _where(tokenizer: Any) -> str:
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


def assistant_end_token(tokenizer: Any, tools: ToolsArg = None) -> str:
    """The special token that closes an assistant turn in the template (the engine's stop
    token for multi-turn rollouts): the first special token rendered after its content."""
    text = _render(
        tokenizer, [*_HISTORY, {"role": "assistant", "content": _SENTINEL}], tools, False
    )
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise ValueError(f"{_where(tokenizer)} does not render an assistant message's content")
    rest = text[at + len(_SENTINEL) :]
    specials = set(getattr(tokenizer, "all_special_tokens", [])) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special
    }
    for token_id in _encode(tokenizer, rest):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token in specials:
            if not rest.startswith(token):
                raise ValueError(
                    f"{_where(tokenizer)} puts {rest[: rest.find(token)]!r} between an assistant "
                    f"turn's content and its end token {token!r}: the sampled ids cannot end "
                    "where the template's turn ends"
                )
            return token
    raise ValueError(f"{_where(tokenizer)} closes an assistant turn with no special token")


# (model, chat template) -> None, or why the template has no tool support
_SUPPORTS_TOOLS: dict[tuple[str, str], str | None] = {}


def require_tool_support(tokenizer: Any) -> None:
    """Refuse (``ValueError`` naming the model) a chat template without tool support or with an
    unknown tool-call format (:func:`~lightrft.environments.tool_calls.tool_call_format`),
    probed once per template."""
    key = (
        str(getattr(tokenizer, "name_or_path", "")),
        getattr(tokenizer, "chat_template", "") or "",
    )
    if key not in _SUPPORTS_TOOLS:
        try:
            tool_call_format(tokenizer)
            _SUPPORTS_TOOLS[key] = None
        except ValueError as e:
            _SUPPORTS_TOOLS[key] = str(e)
    if _SUPPORTS_TOOLS[key] is not None:
        raise ValueError(_SUPPORTS_TOOLS[key])


def observation_ids(
    tokenizer: Any, observation_messages: Sequence[Message], tools: ToolsArg = None
) -> list[int]:
    """The ids to append after an assistant turn's sampled ids (which end at
    :func:`assistant_end_token`): the template's rendering of the observation turn(s) plus the
    next assistant turn's generation prompt.

    Raises:
        ValueError: naming the template, when the rendering with the observation does not
            extend the rendering without it (a template that rewrites earlier turns).
    """
    if not observation_messages:
        raise ValueError("observation_ids: no observation messages")
    if tools or any(m.get("role") == "tool" for m in observation_messages):
        require_tool_support(tokenizer)
    end = assistant_end_token(tokenizer, tools)
    convo = [*_HISTORY, {"role": "assistant", "content": _SENTINEL}]
    before = _render(tokenizer, convo, tools, False)
    prefix = before[: before.rfind(_SENTINEL) + len(_SENTINEL)] + end
    after = _render(tokenizer, [*convo, *map(dict, observation_messages)], tools, True)
    if not after.startswith(prefix):
        raise ValueError(
            f"{_where(tokenizer)} renders the turns before an observation differently once the "
            "observation follows, so observation tokens cannot be appended to sampled ones"
        )
    return _encode(tokenizer, after[len(prefix) :])


def initial_prompt_ids(
    tokenizer: Any, messages: Sequence[Message], tools: ToolsArg = None
) -> list[int]:
    """The first prompt's ids: the messages with the template's tool description (its system
    block built from ``tools``) and the generation prompt. With ``tools``, a template that would
    drop them is refused."""
    if tools:
        require_tool_support(tokenizer)
    return _encode(tokenizer, _render(tokenizer, [dict(m) for m in messages], tools, True))
