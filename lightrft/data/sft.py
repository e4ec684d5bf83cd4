"""Supervised fine-tuning data: token ids plus labels that are -100 outside the loss.

Record formats (chosen per record):

- prompt/completion: ``{"prompt": str | [messages], "completion": str}``. With the chat template
  the prompt becomes a user turn (or is used as given when it is a message list) and the
  completion the assistant turn; loss on the completion and its eos.
- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}``; loss on every assistant turn.

Vision-language samples add images (an ``images`` field, or inline image parts; see
:mod:`lightrft.data.vision`), audio-language samples audio (an ``audios`` field, or inline audio
parts; see :mod:`lightrft.data.audio`); both are built with the model's processor in place of the
tokenizer.

Everything is tokenised when the dataset is built, so lengths (for packing and for the
``max_length`` policy) and the ``stats`` the recipe logs are known before training starts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import torch

from lightrft.config import Bound, check_args
from lightrft.data.audio import AudioTooLong
from lightrft.data.io import DataError, PathLike, Records, require_field
from lightrft.data.media import MEDIA_KINDS, MediaOptions, as_processor
from lightrft.data.records import (
    DecodedMedia,
    MediaSamples,
    Truncation,
    check_truncation,
    open_records,
)
from lightrft.data.templates import (
    IGNORE_INDEX,
    check_messages,
    encode_chat,
    encode_raw,
    eos_id,
    prompt_turns,
    with_system,
)

log = logging.getLogger(__name__)


def refuse_tool_transcript(record: Mapping[str, Any], messages: Any, where: str) -> None:
    """Refuse a tool-use transcript (a ``tools`` field, a ``tool`` message or ``tool_calls``):
    its tokens must be the multi-turn rollout's, which ``ToolSFTDataset`` renders; this
    dataset's whole-conversation rendering would teach other ones."""
    tool_messages = (
        f"message {j} has {'role tool' if m['role'] == 'tool' else 'tool_calls'}"
        for j, m in enumerate(messages if isinstance(messages, list) else [])
        if isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls"))
    )
    why = "field 'tools'" if record.get("tools") else next(tool_messages, None)
    if why is not None:
        raise DataError(
            f"{where}: a tool-use transcript ({why}): train on it with "
            "lightrft.environments.ToolSFTDataset, which renders it as the GRPO rollout does"
        )


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised SFT samples: ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}``, plus
    ``"media"`` (a :class:`~lightrft.data.media.Media`: its images and audio) for samples with
    media.

    Labels equal the input ids on loss tokens and are ``-100`` elsewhere (prompt, system and
    user turns, template text). The first label is always -100: no token predicts it, and a
    packed row must not train a sample's first token on the previous sample's last one.

    Args:
        tokenizer: a Hugging Face tokenizer, or a vision-language model's processor (the recipe
            passes its own as first argument).
        path: data file(s) or directory; see :func:`lightrft.data.load_records`.
        split: split name for saved HF ``DatasetDict`` dirs and per-split directories.
        records: in-memory records instead of ``path``.
        prompt_field, completion_field, messages_field: field names in the records.
        system_prompt: system message added to prompts that do not start with one.
        apply_chat_template: render with the tokenizer's chat template; ``False`` concatenates
            ``system_prompt + "\\n" + prompt``, ``completion`` and eos.
        max_length: longest sample in tokens; ``None`` for no limit.
        truncation: ``"truncate"`` keeps the first ``max_length`` tokens (a sample left with no
            loss token, or with an image cut, is dropped), ``"drop"`` drops the sample. Both are
            counted in ``stats``.
        media: how images, audio and videos are read and bounds on them
            (:class:`~lightrft.data.media.MediaOptions`, the ``media`` section: ``image``
            ``field``, ``min_pixels``, ``max_pixels``; ``audio`` ``field``, ``max_seconds``,
            ``overlong``; ``video`` ``field``, ``fps``, ``num_frames``, ``max_frames``,
            ``overlong``, ``min_pixels``, ``max_pixels``; see docs/vision.md and docs/audio.md).
            Media come from the record's field (paths relative to the data file, base64, PIL
            images, HF image and audio columns, video files or frame lists) or inline parts;
            options of a kind need a model's processor that takes it. Clipped and dropped media
            are counted in ``stats`` (``audio_clipped``, ``audio_dropped``, ``video_clipped``).
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
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        max_length: Annotated[int | None, Bound(ge=2)] = None,
        truncation: Truncation = "truncate",
        media: MediaOptions | None = None,
    ) -> None:
        check_truncation(truncation)
        check_args(SFTDataset.__init__, max_length=max_length)  # >= 2: a token and its target
        tokenizer, processor = as_processor(tokenizer)
        eos_id(tokenizer)
        self.tokenizer = tokenizer
        self.media = MediaSamples(processor, media)
        self.prompt_field, self.completion_field = prompt_field, completion_field
        self.messages_field, self.system_prompt = messages_field, system_prompt
        self.apply_chat_template = apply_chat_template
        src = open_records(path, records, split)
        self.source = src.name

        ids_chunks, label_chunks, origins = [], [], []
        self._media: list[DecodedMedia | None] = []
        truncated = dropped = audio_dropped = 0
        for i in range(len(src)):
            try:
                ids, labels, media = self._encode(src, i)
            except AudioTooLong:
                audio_dropped += 1
                continue
            ids, labels, _ = self.media.expand(ids, labels, media, src.where(i))
            labels[0] = IGNORE_INDEX
            if max_length is not None and len(ids) > max_length:
                if truncation == "drop":
                    dropped += 1
                    continue
                full, ids, labels = ids, ids[:max_length], labels[:max_length]
                if all(lab == IGNORE_INDEX for lab in labels) or not self.media.kept_all(full, ids):
                    # The prompt alone fills max_length (nothing left to learn), or an image
                    # lost some of its vision tokens (the forward would refuse the sample).
                    dropped += 1
                    continue
                truncated += 1
            ids_chunks.append(torch.tensor(ids, dtype=torch.int32))
            label_chunks.append(torch.tensor(labels, dtype=torch.int32))
            origins.append(src.where(i))
            self._media.append(media)
        if not origins:
            audio = self.media.audio
            raise DataError(
                f"empty dataset: max_length={max_length} (truncation={truncation!r})"
                + (f" and media.audio.overlong={audio.overlong!r}" if audio else "")
                + f" dropped all {len(src)} records of {self.source}; raise max_length"
                + (" or media.audio.max_seconds" if audio else "")
            )
        # Flat int32 storage: one tensor per field instead of millions of Python ints.
        self._ids = torch.cat(ids_chunks)  # [total tokens]
        self._labels = torch.cat(label_chunks)  # [total tokens]
        # Sample i is tokens offsets[i]:offsets[i + 1].
        self._offsets = torch.tensor([0] + [len(c) for c in ids_chunks]).cumsum(0)  # [N + 1]
        self._origins = origins
        self.stats: dict[str, int] = {
            "records": len(src),
            "samples": len(origins),
            "truncated": truncated,
            "dropped": dropped,
            "tokens": len(self._ids),
            "loss_tokens": int((self._labels != IGNORE_INDEX).sum()),
        }
        for kind in MEDIA_KINDS:  # images / videos when some, audios with an audio model
            n = sum(len(m.get(kind) or ()) for m in self._media if m)
            if n or (kind == "audio" and self.media.audio is not None):
                self.stats[f"{kind}s"] = n
        cut = f"max_length={max_length} truncated"
        self.media.report(log, self.source, self.stats, "samples", audio_dropped, cut)

    def _encode(self, src: Records, i: int) -> tuple[list[int], list[int], DecodedMedia | None]:
        """Ids and labels of record ``i`` (chat if it has ``messages_field``), and its decoded
        media (None without); media placeholders are not expanded yet."""
        rec, where = src[i], src.where(i)
        prompt_field, completion_field = self.prompt_field, self.completion_field
        messages_field, system_prompt = self.messages_field, self.system_prompt
        if rec.get(messages_field) is not None:
            if not self.apply_chat_template:
                raise DataError(
                    f"{where}: chat records ({messages_field!r}) need apply_chat_template=true"
                )
            refuse_tool_transcript(rec, rec[messages_field], where)
            msgs = check_messages(rec[messages_field], where, messages_field)
            msgs, media = self.media.messages(src, i, msgs)
            ids, labels = encode_chat(self.tokenizer, with_system(msgs, system_prompt), where)
            return ids, labels, media
        if prompt_field not in rec and completion_field not in rec:
            keys = ", ".join(sorted(map(str, rec))) or "none"
            raise DataError(
                f"{where}: missing field {messages_field!r} (chat) or {prompt_field!r} and "
                f"{completion_field!r} (prompt/completion); the record has: {keys}. Set "
                "messages_field or prompt_field/completion_field to your field names"
            )
        prompt = require_field(src, i, prompt_field, (str, list))
        completion = require_field(src, i, completion_field, str)
        refuse_tool_transcript(rec, prompt, where)
        if not self.apply_chat_template:
            if not isinstance(prompt, str):
                raise DataError(
                    f"{where}: field {prompt_field!r} is a message list, which needs "
                    "apply_chat_template=true"
                )
            self.media.raw_mode(src, i)
            return (*encode_raw(self.tokenizer, prompt, completion, system_prompt), None)
        if isinstance(prompt, list):
            prompt = check_messages(prompt, where, prompt_field)
        msgs, media = self.media.messages(src, i, prompt_turns(prompt))
        msgs = [*with_system(msgs, system_prompt), {"role": "assistant", "content": completion}]
        return (*encode_chat(self.tokenizer, msgs, where), media)

    def __len__(self) -> int:
        return len(self._origins)

    def __getitem__(self, i: int) -> dict[str, Any]:
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        item = {"input_ids": self._ids[a:b].long(), "labels": self._labels[a:b].long()}  # [L]
        return self.media.with_media(item, self._media[i])

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample (what packing bins)."""
        return self._offsets.diff().tolist()

    def where(self, i: int) -> str:
        """The file and line (or row) sample ``i`` came from."""
        return self._origins[i]
