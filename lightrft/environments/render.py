"""Token ids of observations, rendered by the model's own chat template.

A multi-turn trajectory is one token sequence: the prompt, then the ids the engine sampled for
an assistant turn (ending at its stop token, e.g. ``<|im_end|>``), then the observation's ids,
then the next assistant turn, and so on. The sampled ids are never decoded and re-encoded; the
observation ids are what the template would have produced between two assistant turns:

    observation_ids = render(history + [assistant] + observation, generation prompt)
                      minus render(history + [assistant]) up to the assistant's end token

so they hold the template's text after the end token (Qwen's ``"\\n"``), the observation's turn
and the next assistant turn's generation prompt. A tool's output is data: a control token's
string in it (``</tool_response><|im_end|>\\n<|im_start|>assistant``) is encoded as plain text,
so it cannot forge a turn in the model's context. The end of the assistant turn is a special
token, so tokenising the rest separately gives the ids the whole rendering would have there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightrft.environments.base import Message
from lightrft.environments.tool_calls import tool_call_format
from lightrft.environments.tools import Tool

_SENTINEL = "sentinel-reply-5d2b"
_HISTORY: list[Message] = [{"role": "user", "content": "question"}]

ToolsArg = Sequence[Tool | dict[str, Any]] | None


def _render(tokenizer: Any, messages: list[Message], tools: ToolsArg, generation: bool) -> str:
    schemas = [t.schema if isinstance(t, Tool) else t for t in tools] if tools else None
    return tokenizer.apply_chat_template(
        messages, tools=schemas, tokenize=False, add_generation_prompt=generation
    )


def _encode(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"])


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
    # The probe's assistant content has a reasoning block when the template knows ``</think>``
    # (Qwen3, QwQ). Qwen3 renders the turns after the last user query with their ``<think>``
    # block only while they are last or carry reasoning, so a plain reply would render
    # differently once an observation follows; a turn sampled in thinking mode carries its
    # reasoning, and renders the same in both places.
    template = getattr(tokenizer, "chat_template", None) or ""
    thinks = isinstance(template, str) and "</think>" in template
    reply = ("<think>\nprobe-reasoning-3e1f\n</think>\n\n" if thinks else "") + _SENTINEL
    convo = [*_HISTORY, {"role": "assistant", "content": reply}]
    before = _render(tokenizer, convo, tools, False)
    prefix = before[: before.rfind(_SENTINEL) + len(_SENTINEL)] + end
    messages = [dict(m) for m in observation_messages]
    # The messages whose text holds a control token's string (``<|im_end|>``): a tool's output
    # is data, and must not open or close turns in the model's context. The strings the
    # tokenizer turns into one added (control) token, longest first:
    names = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    names |= set(getattr(tokenizer, "all_special_tokens", []))
    tokens = sorted((n for n in names if n), key=len, reverse=True)
    forged = [
        i
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), str) and any(t in m["content"] for t in tokens)
    ]
    for i in forged:  # render placeholders, and encode each content as plain text between them
        messages[i]["content"] = _placeholder(i)
    after = _render(tokenizer, [*convo, *messages], tools, True)
    if not after.startswith(prefix):
        raise ValueError(
            f"{_where(tokenizer)} renders the turns before an observation differently once the "
            "observation follows, so observation tokens cannot be appended to sampled ones"
        )
    rest = after[len(prefix) :]
    ids: list[int] = []
    for i in forged:
        head, mark, rest = rest.partition(_placeholder(i))
        if not mark:  # the template changed the content, so it cannot be encoded apart:
            # render each text with a zero-width space after the ``<`` of each control token in it
            for j in forged:
                text = observation_messages[j]["content"]
                for token in tokens:
                    text = text.replace(token, token[:1] + "\u200b" + token[1:])
                messages[j]["content"] = text
            after = _render(tokenizer, [*convo, *messages], tools, True)
            return _encode(tokenizer, after[len(prefix) :])
        # the content as plain text: a control token's string in it becomes ordinary tokens
        text = observation_messages[i]["content"]
        ids += _encode(tokenizer, head) + _encode(tokenizer, text, split_special_tokens=True)
    return ids + _encode(tokenizer, rest)


def _placeholder(i: int) -> str:
    return f"\ue000observation-{i}-7c4d\ue001"  # private-use characters no template writes


def initial_prompt_ids(
    tokenizer: Any, messages: Sequence[Message], tools: ToolsArg = None
) -> list[int]:
    """The first prompt's ids: the messages with the template's tool description (its system
    block built from ``tools``) and the generation prompt. With ``tools``, a template that would
    drop them is refused."""
    if tools:
        require_tool_support(tokenizer)
    return _encode(tokenizer, _render(tokenizer, [dict(m) for m in messages], tools, True))


def assistant_turn_text(tokenizer: Any, message: Message, tools: ToolsArg = None) -> str:
    """The text of an assistant message as the model samples it: what the template renders
    between the generation prompt and the turn's end token (:func:`assistant_end_token`), so
    structured ``tool_calls`` come out as the template writes them (``<tool_call>`` blocks).

    Raises:
        ValueError: naming the template, when its assistant turn does not start with its
            generation prompt or has no end token.
    """
    end = assistant_end_token(tokenizer, tools)
    before = _render(tokenizer, _HISTORY, tools, True)
    after = _render(tokenizer, [*_HISTORY, dict(message)], tools, False)
    if not after.startswith(before):
        raise ValueError(
            f"{_where(tokenizer)} renders an assistant turn that does not start with its "
            "generation prompt, so the text the model samples cannot be located"
        )
    rest = after[len(before) :]
    at = rest.find(end)
    if at < 0:
        raise ValueError(f"{_where(tokenizer)} renders an assistant turn without {end!r}")
    return rest[:at]


def transcript_ids(
    tokenizer: Any, messages: Sequence[Message], tools: ToolsArg = None
) -> tuple[list[int], list[bool]]:
    """A whole conversation's ids as a multi-turn rollout holds them, and which were sampled.

    The messages before the first assistant turn are the prompt (:func:`initial_prompt_ids`);
    each assistant turn is its :func:`assistant_turn_text` tokenised plus the end token
    (``True``: what the engine samples); the ``tool`` / ``user`` messages between two assistant
    turns are an observation (:func:`observation_ids`, ``False``). The ids end at the last
    assistant turn's end token, as a finished trajectory does.

    Raises:
        ValueError: no message before the first assistant turn, no assistant turn, two
            assistant turns with no observation between them, messages after the last assistant
            turn, or a template :func:`observation_ids` / :func:`assistant_turn_text` refuses.
    """
    roles = [m.get("role") for m in messages]
    turns = [k for k, role in enumerate(roles) if role == "assistant"]
    if not turns:
        raise ValueError("transcript_ids: the conversation has no assistant turn")
    if turns[0] == 0:
        raise ValueError("transcript_ids: the conversation starts with an assistant turn")
    if roles[-1] != "assistant":
        raise ValueError("transcript_ids: the conversation does not end with an assistant turn")
    ids = initial_prompt_ids(tokenizer, messages[: turns[0]], tools)
    sampled = [False] * len(ids)
    end_id = tokenizer.convert_tokens_to_ids(assistant_end_token(tokenizer, tools))
    for k, nxt in zip(turns, [*turns[1:], len(messages)], strict=True):
        if nxt == k + 1 < len(messages):
            raise ValueError(
                f"transcript_ids: messages {k} and {nxt} are assistant turns with no "
                "observation between them"
            )
        turn = _encode(tokenizer, assistant_turn_text(tokenizer, messages[k], tools)) + [end_id]
        obs = observation_ids(tokenizer, messages[k + 1 : nxt], tools) if nxt > k + 1 else []
        ids += turn + obs
        sampled += [True] * len(turn) + [False] * len(obs)
    return ids, sampled
