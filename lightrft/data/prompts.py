"""Prompts for RL: token ids ready for the rollout engine, plus the reference answer and label."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import torch

from lightrft.config import Bound, check_args
from lightrft.data.audio import AudioTooLong
from lightrft.data.io import DataError, PathLike, require_field
from lightrft.data.media import Media, MediaOptions, as_processor
from lightrft.data.records import MediaSamples, Truncation, check_truncation, open_records
from lightrft.data.templates import check_messages, encode_prompt, prompt_turns, with_system

log = logging.getLogger(__name__)


class PromptDataset(torch.utils.data.Dataset):
    """RL prompts. Each item is a dict:

    - ``prompt_ids``: ``list[int]``, the rendered prompt (ends with the generation prompt).
    - ``prompt``: the rendered prompt text (what reward functions see as the prompt).
    - ``messages``: the chat the prompt was rendered from (``None`` in raw mode).
    - ``reference``: the reference answer as a string, or ``None``.
    - ``label``: which reward function applies (``label_field``, else ``default_label``).
    - ``index``: position in the dataset (stable across epochs; for logging trajectories).
    - ``media`` (datasets built with a vision- or audio-language processor only): the prompt's
      :class:`~lightrft.data.media.Media` (its ids hold the expanded media tokens), or ``None``
      for a prompt without media.

    Batch items with :func:`~lightrft.data.collate_prompts`.

    Args:
        tokenizer: a Hugging Face tokenizer, or a vision-language model's processor (the recipe
            passes its own as first argument).
        path, split, records: where the records are (see :class:`~lightrft.data.SFTDataset`).
        prompt_field: a string, or a list of chat messages, per record.
        messages_field: used instead of ``prompt_field`` when a record has it (chat records).
        reference_field: the reference answer; numbers are turned into strings.
        label_field: per-record reward label; ``None`` to use ``default_label`` for all.
        default_label: label of records without one.
        reference_required: a record without a reference is an error (verifiable rewards need
            one); ``False`` stores ``None`` (e.g. reward-model scoring).
        system_prompt: system message added to prompts that do not start with one.
        apply_chat_template: render with the chat template and its generation prompt; ``False``
            uses ``system_prompt + "\\n" + prompt`` as is.
        max_prompt_length: longest prompt in tokens; ``None`` for no limit.
        truncation: what happens to a prompt over ``max_prompt_length`` or over the engine's
            limit (:meth:`fit_to_engine`): ``"drop"`` (default), ``"truncate"``, which keeps
            the last tokens (the end holds the question and the generation prompt; a prompt
            whose images would lose vision tokens is dropped), or ``"error"``, which refuses the
            dataset naming the file and line. Counted in ``stats``.
        media: how images, audio and videos are read and bounded (the ``media`` section,
            :class:`~lightrft.data.media.MediaOptions`), as in :class:`~lightrft.data.SFTDataset`.
    """

    def __init__(
        self,
        tokenizer,
        path: PathLike | Sequence[PathLike] | None = None,
        *,
        split: str | None = None,
        records: Sequence[Mapping[str, Any]] | None = None,
        prompt_field: str = "prompt",
        messages_field: str = "messages",
        reference_field: str = "answer",
        label_field: str | None = "label",
        default_label: str | None = None,
        reference_required: bool = True,
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        max_prompt_length: Annotated[int | None, Bound(ge=1)] = None,
        truncation: Truncation | Literal["error"] = "drop",
        media: MediaOptions | None = None,
    ) -> None:
        check_truncation(truncation, ("drop", "truncate", "error"))
        tokenizer, processor = as_processor(tokenizer)
        self.media = MediaSamples(processor, media)
        self.tokenizer = tokenizer
        self.truncation = truncation
        check_args(PromptDataset.__init__, max_prompt_length=max_prompt_length)
        src = open_records(path, records, split)
        self.source = src.name
        self.items: list[dict[str, Any]] = []
        audio_dropped = 0
        for i in range(len(src)):
            rec, where = src[i], src.where(i)
            if rec.get(messages_field) is not None:
                prompt: str | list = check_messages(rec[messages_field], where, messages_field)
            else:
                prompt = require_field(src, i, prompt_field, (str, list))
                if isinstance(prompt, list):
                    prompt = check_messages(prompt, where, prompt_field)
            if isinstance(prompt, list) and not apply_chat_template:
                raise DataError(f"{where}: a message-list prompt needs apply_chat_template=true")
            reference = rec.get(reference_field)
            if reference_required or reference is not None:
                reference = require_field(src, i, reference_field, (str, int, float))
                if isinstance(reference, bool):
                    raise DataError(
                        f"{where}: field {reference_field!r} must be a string or number, got bool"
                    )
                reference = str(reference)
            label = rec.get(label_field) if label_field else None
            label = default_label if label is None else str(label)
            media = None
            if apply_chat_template:
                try:
                    prompt, media = self.media.messages(src, i, prompt_turns(prompt))
                except AudioTooLong:
                    audio_dropped += 1
                    continue
            else:
                self.media.raw_mode(src, i)
            text, ids = encode_prompt(
                tokenizer,
                prompt,
                system_prompt=system_prompt,
                apply_chat_template=apply_chat_template,
            )
            ids, _, _ = self.media.expand(ids, None, media, where)
            item = {
                "prompt_ids": ids,
                "prompt": text,
                # with the template, ``prompt`` is the chat (media.messages made it a list)
                "messages": with_system(prompt, system_prompt) if apply_chat_template else None,
                "reference": reference,
                "label": label,
                "where": where,
            }
            if self.media.kinds:
                item["media"] = media  # decoded (DecodedMedia), processed in __getitem__
            self.items.append(item)
        truncated, dropped = self._fit(max_prompt_length, "max_prompt_length")
        if not self.items:
            raise DataError(
                f"empty dataset: all {len(src)} prompts of {self.source} are longer than "
                f"max_prompt_length={max_prompt_length}"
                + (" (or have audio over media.audio.max_seconds)" if self.media.audio else "")
                + "; raise it or use truncation='truncate'"
            )
        self.stats: dict[str, int] = {
            "records": len(src),
            "prompts": len(self.items),
            "truncated": truncated,
            "dropped": dropped,
        }
        cut = f"max_prompt_length={max_prompt_length} truncated (left)"
        self.media.report(log, self.source, self.stats, "prompts", audio_dropped, cut)

    def _fit(self, limit: int | None, key: str) -> tuple[int, int]:
        """Apply ``truncation`` to the prompts over ``limit`` tokens (``key`` names the limit in
        errors) and re-number ``index``; returns how many were truncated and dropped. A too-long
        prompt is dropped, cut to its last ``limit`` tokens (and their text), or refused with a
        :class:`DataError`; a prompt whose cut would lose media tokens is dropped."""
        kept, truncated, dropped = [], 0, 0
        for item in self.items:
            ids = item["prompt_ids"]
            if limit is not None and len(ids) > limit:
                if self.truncation == "error":
                    raise DataError(
                        f"{item['where']}: the prompt has {len(ids)} tokens, over {key}={limit}; "
                        "shorten it, raise the limit, or set the dataset's truncation to 'drop' "
                        "or 'truncate'"
                    )
                if self.truncation == "drop" or not self.media.kept_all(ids, ids[-limit:]):
                    dropped += 1
                    continue
                text = self.tokenizer.decode(ids[-limit:], skip_special_tokens=False)
                item = {**item, "prompt_ids": ids[-limit:], "prompt": text}
                truncated += 1
            kept.append({**item, "index": len(kept)})
        self.items = kept
        return truncated, dropped

    def fit_to_engine(self, max_model_len: int, key: str = "engine.max_model_len") -> int:
        """Apply ``truncation`` to prompts the rollout engine could not take: a prompt needs
        ``max_model_len - 1`` tokens or fewer (one must be left to generate). Call it when the
        engine's limit is known, before training, so the problem shows at load time with the
        file and line instead of at the step that samples it. Returns how many prompts changed
        (counted in ``stats`` as ``engine_truncated`` / ``engine_dropped``)."""
        limit = max_model_len - 1
        if limit < 1:
            raise ValueError(f"{key} must be >= 2 (a prompt token and a generated one)")
        n = len(self.items)
        truncated, dropped = self._fit(limit, f"{key}-1")
        if not self.items:
            raise DataError(
                f"empty dataset: all {n} prompts of {self.source} are longer than "
                f"{key}-1={limit} tokens; raise {key} or use truncation='truncate'"
            )
        self.stats["prompts"] = len(self.items)
        self.stats["engine_truncated"] = truncated
        self.stats["engine_dropped"] = dropped
        if truncated or dropped:
            log.warning(
                "%s: %s=%d truncated (left) %d and dropped %d prompts",
                self.source,
                key,
                max_model_len,
                truncated,
                dropped,
            )
        return truncated + dropped

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.media.with_media(self.items[i], self.items[i].get("media"))

    def where(self, i: int) -> str:
        """The file and line (or row) prompt ``i`` came from."""
        return self.items[i]["where"]


def conversation(
    messages: Sequence[Mapping[str, Any]] | None, media: Media | None = None
) -> list[dict] | None:
    """A prompt item's chat (its ``messages``) with its media inline: the k-th part of a kind
    holds the k-th item of that kind of the item's ``media`` (each kind's ``parts()``): an image
    (resized as the actor saw it) under ``"image"``, an audio (decoded, clipped, at the feature
    extractor's rate) as an HF audio value ``{"array", "sampling_rate"}`` under ``"audio"``, a
    video's sampled frames (PIL images) under ``"video"`` and the rate they were sampled at under
    ``"fps"`` (a reward model re-samples them at its own ``media.video.fps``, as its preference
    data sampled the file): the HF content format that preference data reads too. ``None`` for
    a raw prompt (no messages). Reward functions get these (``Sample.conversation``), so a
    reward model renders the chat with its own template, as in its training."""
    if messages is None:
        return None
    inline = {kind: iter(inputs.parts()) for kind, inputs in media.kinds()} if media else {}
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = [
                {**part, **next(inline[part["type"]])} if part.get("type") in inline else dict(part)
                for part in content
            ]
        out.append({**m, "content": content})
    return out
