"""Turn prompts and conversations into token ids, with a loss mask on assistant tokens.

Two modes, chosen by ``apply_chat_template``:

- chat template (default): the tokenizer's template renders the conversation. The prompt of an RL
  sample ends with the generation prompt (``<|im_start|>assistant\\n`` in ChatML), which is
  exactly what SFT puts before an assistant turn, so SFT and RL see the same prompt tokens.
- raw: ``system_prompt + "\\n" + prompt`` (system prompt optional), then ``completion`` and eos.

Each rendered segment is tokenised on its own and the ids are concatenated. Prompt tokens are then
the same whether or not a completion follows, which is also what generation sees (the engine
continues from the prompt ids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightrft.data import media
from lightrft.data.io import DataError

IGNORE_INDEX = -100
Message = Mapping[str, Any]


def eos_id(tokenizer) -> int:
    """The tokenizer's eos id; a tokenizer without one cannot end completions."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no eos_token: set eos_token in its tokenizer_config.json so "
            "completions can end with it"
        )
    return int(tokenizer.eos_token_id)


def check_messages(messages: Any, where: str, field: str) -> list[dict[str, Any]]:
    """Validate a chat list: each item a dict with a string ``role`` and a ``content`` that is a
    string or a list of HF content parts (``{"type": "text", "text": ...}``,
    ``{"type": "image", ...}``, ``{"type": "video", ...}``, ``{"type": "audio", ...}``)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of messages")
    kinds = [p.kind for p in media.PROCESSORS]  # a part of each kind of media (image, ...)
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: {field}[{j}] must be an object with role and content")
        if not isinstance(m.get("role"), str):
            raise DataError(f"{where}: {field}[{j}] has no string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text" and isinstance(part.get("text"), str) or kind in kinds:
                    continue
                media_parts = [
                    f'{"an" if name[0] in "aeiou" else "a"} {name} part ({{"type": "{name}"}})'
                    for name in kinds
                ]
                raise DataError(
                    f"{where}: {field}[{j}].content[{k}] must be a text part "
                    f'({{"type": "text", "text": ...}}), {", ".join(media_parts[:-1])} or '
                    f"{media_parts[-1]}"
                )
        elif not isinstance(content, str):
            raise DataError(f"{where}: {field}[{j}] has no string 'content' (or list of parts)")
    return [dict(m) for m in messages]


def _tokenize(tokenizer, text: str, *, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def prompt_turns(prompt: str | Sequence[Message] | None) -> list[dict[str, Any]]:
    """A prompt as chat turns: none for ``None``, one user turn for a string, a copy of a
    conversation."""
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def with_system(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """Prepend a system message unless there is none to add or the chat already has one."""
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def encode_prompt(
    tokenizer,
    prompt: str | list[dict[str, Any]],
    *,
    system_prompt: str | None = None,
    apply_chat_template: bool = True,
) -> tuple[str, list[int]]:
    """Render a prompt for generation; returns ``(text, ids)``.

    With the chat template the text ends with the generation prompt. Raw mode needs a string
    prompt and lets the tokenizer add its usual special tokens (e.g. a BOS).
    """
    if apply_chat_template:
        msgs = with_system(prompt_turns(prompt), system_prompt)
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return text, _tokenize(tokenizer, text)
    if not isinstance(prompt, str):
        raise ValueError("a prompt given as a list of messages needs apply_chat_template=true")
    text = prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
    return text, _tokenize(tokenizer, text, special=True)


def encode_chat(tokenizer, messages: Sequence[Message], where: str) -> tuple[list[int], list[int]]:
    """Token ids and labels of a whole conversation; loss on assistant turns only.

    Each assistant turn is rendered as the difference between the conversation up to it with the
    generation prompt and the conversation including it. Its loss covers the content and the
    end-of-turn token, not template whitespace after eos (nothing is generated after eos). If the
    final assistant turn does not end with eos (a template that does not emit it), eos is
    appended so that the model learns to stop. The ids end there: turns after the last
    assistant turn and template text after its eos are dropped.

    Raises:
        DataError: no assistant turn, or a template that rewrites earlier turns (the rendering of
            a conversation prefix is not a prefix of the full rendering).
    """
    msgs = [dict(m) for m in messages]
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: the conversation has no assistant turn to learn from")
    eos = eos_id(tokenizer)
    ids: list[int] = []
    labels: list[int] = []
    done = ""  # text rendered (and tokenised) so far
    # Turns after the last assistant turn carry no loss and nothing can attend to them: dropped.
    for k in (k for k, m in enumerate(msgs) if m["role"] == "assistant"):
        # The conversation up to the turn with the generation prompt (no loss), then with it.
        for loss in (False, True):
            text = tokenizer.apply_chat_template(
                msgs[: k + 1 if loss else k], tokenize=False, add_generation_prompt=not loss
            )
            if not text.startswith(done):
                raise DataError(
                    f"{where}: the chat template renders earlier turns differently once later "
                    "turns are added, so assistant tokens cannot be located; use a template "
                    "without history rewriting or prompt/completion records"
                )
            new = _tokenize(tokenizer, text[len(done) :])
            # No loss on template text that follows the end-of-turn token (e.g. "\n").
            stop = (len(new) - new[::-1].index(eos) if eos in new else len(new)) if loss else 0
            ids += new
            labels += new[:stop] + [IGNORE_INDEX] * (len(new) - stop)
            done = text
    # End at the last loss token: template text after the final eos is never trained on.
    last = max((k for k, lab in enumerate(labels) if lab != IGNORE_INDEX), default=-1)
    if last < 0:  # only possible with empty assistant turns and a template without eos
        raise DataError(f"{where}: the assistant turns render to no tokens")
    ids, labels = ids[: last + 1], labels[: last + 1]
    if ids[-1] != eos:
        ids, labels = ids + [eos], labels + [eos]
    return ids, labels


def encode_raw(
    tokenizer, prompt: str, completion: str, system_prompt: str | None
) -> tuple[list[int], list[int]]:
    """Raw concatenation: prompt (no loss), then completion and eos (loss)."""
    _, p = encode_prompt(tokenizer, prompt, system_prompt=system_prompt, apply_chat_template=False)
    c = _tokenize(tokenizer, completion) + [eos_id(tokenizer)]
    return p + c, [IGNORE_INDEX] * len(p) + c
