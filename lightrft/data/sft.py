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
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightrft.data.audio import AudioInputs, AudioProcessor, AudioTooLong, OverlongAudio
from lightrft.data.io import DataError, PathLike, Records, load_records, require_field
from lightrft.data.templates import (
    IGNORE_INDEX,
    check_messages,
    encode_chat,
    encode_raw,
    eos_id,
    has_parts,
    with_system,
)
from lightrft.data.vision import ImageInputs, ImageProcessor, as_processor, record_media

__all__ = ["SFTDataset", "Truncation"]

log = logging.getLogger(__name__)
_NO_IMAGES = ImageInputs([], torch.empty(0), None, [], {})
_NO_AUDIO = AudioInputs([], torch.empty(0), torch.empty(0), [], 0)
Truncation = Literal["truncate", "drop"]


def _check_truncation(truncation: str, name: str = "truncation") -> None:
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"{name} must be 'truncate' or 'drop', got {truncation!r}")


def open_records(
    path: PathLike | Sequence[PathLike] | None,
    records: Sequence[Mapping[str, Any]] | None,
    split: str | None,
) -> Records:
    """Records from files (``path``) or given in memory (``records``); exactly one of them."""
    if (path is None) == (records is None):
        raise ValueError("give exactly one of path (data files) or records (in-memory list)")
    if records is not None:
        if len(records) == 0:
            raise DataError("empty dataset: records is an empty list")
        return Records.from_list(records)
    return load_records(path, split=split)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SampleMedia:
    """A sample's media: decoded at load (lists of PIL images / waveforms), or processed
    (:class:`~lightrft.data.vision.ImageInputs`, :class:`~lightrft.data.audio.AudioInputs`).
    A kind the sample does not have is None."""

    images: Any = None
    audios: Any = None

    def item_fields(self, kinds: Sequence[str]) -> dict[str, Any]:
        """The dataset item's fields: ``"images"`` / ``"audios"`` for each kind in ``kinds``."""
        return {f"{k}s": getattr(self, f"{k}s") for k in kinds}

    def count(self) -> tuple[int, int]:
        return len(self.images or ()), len(self.audios or ())


class MediaSamples:
    """The media side of a dataset: finds a record's images and audio, loads them (failing at
    load with file, line and field) and expands the placeholders of its ids. Shared by the SFT
    and prompt datasets so that images and audio ride the same path as text.

    Which kinds a dataset takes follows the processor: an ``image_processor`` takes images, a
    ``feature_extractor`` (Whisper features: Qwen2-Audio) takes audio.
    """

    def __init__(
        self,
        processor,
        images_field: str | None,
        min_pixels,
        max_pixels,
        audios_field: str | None = "audios",
        max_audio_seconds: float | None = None,
        overlong_audio: OverlongAudio = "clip",
    ) -> None:
        has_images = getattr(processor, "image_processor", None) is not None
        has_audio = getattr(processor, "feature_extractor", None) is not None
        self.images = (
            ImageProcessor(processor, min_pixels=min_pixels, max_pixels=max_pixels)
            if has_images
            else None
        )
        if self.images is None and (min_pixels is not None or max_pixels is not None):
            raise ValueError(
                "min_pixels / max_pixels need a vision-language processor (the dataset was "
                f"given {'a tokenizer' if processor is None else type(processor).__name__})"
            )
        self.audio = (
            AudioProcessor(
                processor, max_audio_seconds=max_audio_seconds, overlong_audio=overlong_audio
            )
            if has_audio
            else None
        )
        if self.audio is None and (max_audio_seconds is not None or overlong_audio != "clip"):
            raise ValueError(
                "max_audio_seconds / overlong_audio need an audio-language processor (the "
                f"dataset was given {'a tokenizer' if processor is None else type(processor).__name__})"
            )
        self.fields: dict[str, str | None] = {}
        if self.images is not None:
            self.fields["image"] = images_field
        if self.audio is not None:
            self.fields["audio"] = audios_field
        self._all_fields = {"image": images_field, "audio": audios_field}
        self.kinds = list(self.fields)

    @property
    def clipped(self) -> int:
        """Audio clipped to ``max_audio_seconds`` so far."""
        return self.audio.clipped if self.audio is not None else 0

    def messages(self, src: Records, i: int, msgs: list[dict[str, Any]]):
        """``(messages with media parts, decoded SampleMedia or None)`` of record ``i``.

        Raises:
            AudioTooLong: the record's audio is over the maximum and ``overlong_audio="drop"``.
        """
        where = src.where(i)
        for kind, field in self._all_fields.items():
            if kind not in self.fields and field and src[i].get(field):
                model = (
                    "a tokenizer"
                    if not self.kinds
                    else f"a processor for {' and '.join(k + 's' for k in self.kinds)} only"
                )
                raise DataError(
                    f"{where}: the record has {kind}s, but the dataset was built with {model} "
                    f"(field {field!r}): a {'vision' if kind == 'image' else 'audio'}-language "
                    "model's processor is needed"
                )
        if not self.kinds:
            # Text models: "<image>" in a string is just text, but content parts are an error.
            if has_parts(msgs):
                raise DataError(
                    f"{where}: content parts (lists) need a multimodal model's processor"
                )
            return msgs, None
        msgs, raw = record_media(src[i], msgs, self.fields, where)
        if not any(raw.values()):
            return msgs, None
        base = src.base_dir(i)
        images = audios = None
        if raw.get("image"):
            assert self.images is not None
            field = self.fields["image"] or "content"
            images = self.images.load(raw["image"], base_dir=base, where=where, field=field)
        if raw.get("audio"):
            assert self.audio is not None
            field = self.fields["audio"] or "content"
            audios = self.audio.load(raw["audio"], base_dir=base, where=where, field=field)
        return msgs, SampleMedia(images, audios)

    def raw_mode(self, src: Records, i: int) -> None:
        """Raw (template-free) records cannot place media tokens: refuse their media."""
        for kind, field in self._all_fields.items():
            if field and src[i].get(field):
                raise DataError(
                    f"{src.where(i)}: field {field!r}: {kind}s need apply_chat_template=true "
                    f"(the chat template places the {kind} tokens)"
                )

    def process(self, media: SampleMedia) -> SampleMedia:
        """Pixel values / audio features of a sample's decoded media."""
        images = audios = None
        if media.images:
            assert self.images is not None
            images = self.images.process(media.images)
        if media.audios:
            assert self.audio is not None
            audios = self.audio.process(media.audios)
        return SampleMedia(images, audios)

    def expand(
        self, ids: list[int], labels, media: SampleMedia | None, where: str
    ) -> tuple[list[int], Any, SampleMedia | None]:
        """Process the sample's media and expand its placeholders; a multimodal sample without
        media of a kind must hold no placeholder of that kind (the forward would find none)."""
        if not self.kinds:
            return ids, labels, None
        done = self.process(media) if media is not None else SampleMedia()
        if self.images is not None:
            field = self.fields["image"] or "content"
            ids, labels = self.images.expand(ids, labels, done.images or _NO_IMAGES, where, field)
        if self.audio is not None:
            field = self.fields["audio"] or "content"
            ids, labels = self.audio.expand(ids, labels, done.audios or _NO_AUDIO, where, field)
        return ids, labels, done if media is not None else None

    def intact(self, ids: list[int], media: SampleMedia | None) -> bool:
        """Whether truncated ``ids`` still hold every media token of the sample."""
        if media is None:
            return True
        for proc, inputs in ((self.images, media.images), (self.audio, media.audios)):
            if inputs is None:
                continue
            tok = proc.image_token_id if proc is self.images else proc.audio_token_id
            if sum(1 for t in ids if t == tok) != sum(inputs.num_tokens):
                return False
        return True


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised SFT samples: ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}``, plus
    ``"images"`` (an :class:`~lightrft.data.vision.ImageInputs`) for samples with images and
    ``"audios"`` (an :class:`~lightrft.data.audio.AudioInputs`) for samples with audio.

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
        images_field: the records' image list (paths relative to the data file, base64, PIL
            images, HF image columns); ``None`` reads images only from inline image parts.
        min_pixels, max_pixels: bounds on each image's area (resized keeping aspect ratio).
        audios_field: the records' audio list (paths relative to the data file, HF audio
            values); ``None`` reads audio only from inline audio parts.
        max_audio_seconds: the longest audio kept (None: the feature extractor's chunk).
        overlong_audio: ``"clip"`` an audio over ``max_audio_seconds`` to it, or ``"drop"`` the
            sample; counted in ``stats`` (``audio_clipped``, ``audio_dropped``).
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
        max_length: int | None = None,
        truncation: Truncation = "truncate",
        images_field: str | None = "images",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        audios_field: str | None = "audios",
        max_audio_seconds: float | None = None,
        overlong_audio: OverlongAudio = "clip",
    ) -> None:
        _check_truncation(truncation)
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2 (a token and its target), got {max_length}")
        tokenizer, processor = as_processor(tokenizer)
        eos_id(tokenizer)
        self.tokenizer = tokenizer
        self.media = MediaSamples(
            processor,
            images_field,
            min_pixels,
            max_pixels,
            audios_field,
            max_audio_seconds,
            overlong_audio,
        )
        self.max_length = max_length
        src = open_records(path, records, split)
        self.source = src.name

        ids_chunks, label_chunks, lengths, origins = [], [], [], []
        self._media: list[SampleMedia | None] = []
        truncated = dropped = audio_dropped = 0
        for i in range(len(src)):
            try:
                ids, labels, media = self._encode(
                    src,
                    i,
                    prompt_field=prompt_field,
                    completion_field=completion_field,
                    messages_field=messages_field,
                    system_prompt=system_prompt,
                    apply_chat_template=apply_chat_template,
                )
            except AudioTooLong:
                audio_dropped += 1
                continue
            ids, labels, inputs = self.media.expand(ids, labels, media, src.where(i))
            labels[0] = IGNORE_INDEX
            if max_length is not None and len(ids) > max_length:
                if truncation == "drop":
                    dropped += 1
                    continue
                ids, labels = ids[:max_length], labels[:max_length]
                if all(lab == IGNORE_INDEX for lab in labels) or not self.media.intact(ids, inputs):
                    # The prompt alone fills max_length (nothing left to learn), or an image
                    # lost some of its vision tokens (the forward would refuse the sample).
                    dropped += 1
                    continue
                truncated += 1
            ids_chunks.append(torch.tensor(ids, dtype=torch.int32))
            label_chunks.append(torch.tensor(labels, dtype=torch.int32))
            lengths.append(len(ids))
            origins.append(src.where(i))
            self._media.append(media)
        if not lengths:
            audio = f" and overlong_audio={overlong_audio!r}" if self.media.audio else ""
            raise DataError(
                f"empty dataset: max_length={max_length} (truncation={truncation!r}){audio} "
                f"dropped all {len(src)} records of {self.source}; raise max_length"
                + (" or max_audio_seconds" if audio else "")
            )
        # Flat int32 storage: one tensor per field instead of millions of Python ints.
        self._ids = torch.cat(ids_chunks)  # [total tokens]
        self._labels = torch.cat(label_chunks)  # [total tokens]
        self._lengths = torch.tensor(lengths, dtype=torch.long)  # [N]
        self._offsets = torch.cat([torch.zeros(1, dtype=torch.long), self._lengths.cumsum(0)])
        self._origins = origins
        n_loss = int((self._labels != IGNORE_INDEX).sum())
        self.stats: dict[str, int] = {
            "records": len(src),
            "samples": len(lengths),
            "truncated": truncated,
            "dropped": dropped,
            "tokens": int(self._lengths.sum()),
            "loss_tokens": n_loss,
        }
        n_images = sum(m.count()[0] for m in self._media if m)
        if n_images:
            self.stats["images"] = n_images
        if self.media.audio is not None:
            self.stats["audios"] = sum(m.count()[1] for m in self._media if m)
            self.stats["audio_clipped"] = self.media.clipped
            self.stats["audio_dropped"] = audio_dropped
            if audio_dropped:
                log.warning(
                    "%s: dropped %d samples with audio over max_audio_seconds=%g",
                    self.source,
                    audio_dropped,
                    self.media.audio.max_seconds,
                )
        if truncated or dropped:
            log.warning(
                "%s: max_length=%s truncated %d and dropped %d of %d samples",
                self.source,
                max_length,
                truncated,
                dropped,
                len(src),
            )

    def _encode(
        self,
        src: Records,
        i: int,
        *,
        prompt_field: str,
        completion_field: str,
        messages_field: str,
        system_prompt: str | None,
        apply_chat_template: bool,
    ) -> tuple[list[int], list[int], SampleMedia | None]:
        """Ids and labels of record ``i`` (chat if it has ``messages_field``), and its decoded
        media (None without); media placeholders are not expanded yet."""
        rec, where = src[i], src.where(i)
        if rec.get(messages_field) is not None:
            if not apply_chat_template:
                raise DataError(
                    f"{where}: chat records ({messages_field!r}) need apply_chat_template=true"
                )
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
        if not apply_chat_template:
            if not isinstance(prompt, str):
                raise DataError(
                    f"{where}: field {prompt_field!r} is a message list, which needs "
                    "apply_chat_template=true"
                )
            self.media.raw_mode(src, i)
            return (*encode_raw(self.tokenizer, prompt, completion, system_prompt), None)
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        else:
            msgs = check_messages(prompt, where, prompt_field)
        msgs, media = self.media.messages(src, i, msgs)
        msgs = [*with_system(msgs, system_prompt), {"role": "assistant", "content": completion}]
        return (*encode_chat(self.tokenizer, msgs, where), media)

    def __len__(self) -> int:
        return len(self._origins)

    def __getitem__(self, i: int) -> dict[str, Any]:
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        item: dict[str, Any] = {
            "input_ids": self._ids[a:b].long(),  # [L]
            "labels": self._labels[a:b].long(),  # [L]
        }
        media = self._media[i]
        if media is not None:
            # Processed on access: pixel values (audio features) of a whole dataset would not
            # fit in memory.
            processed = self.media.process(media)
            item.update({k: v for k, v in processed.item_fields(self.media.kinds).items() if v})
        return item

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample (what packing bins)."""
        return self._lengths.tolist()

    def where(self, i: int) -> str:
        """The file and line (or row) sample ``i`` came from."""
        return self._origins[i]
