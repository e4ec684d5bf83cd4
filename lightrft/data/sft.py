"""Supervised fine-tuning data: token ids plus labels that are -100 outside the loss.

Record formats (chosen per record):

- prompt/completion: ``{"prompt": str | [messages], "completion": str}``. With the chat template
  the prompt becomes a user turn (or is used as given when it is a message list) and the
  completion the assistant turn; loss on the completion and its eos.
- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}``; loss on every assistant turn.

Vision-language samples add images (an ``images`` field, or inline image parts; see
:mod:`lightrft.data.vision`) and are built with the model's processor in place of the tokenizer.

Everything is tokenised when the dataset is built, so lengths (for packing and for the
``max_length`` policy) and the ``stats`` the recipe logs are known before training starts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

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
from lightrft.data.vision import ImageInputs, ImageProcessor, as_processor, record_images

__all__ = ["SFTDataset", "Truncation"]

log = logging.getLogger(__name__)
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


_NO_IMAGES = ImageInputs([], torch.empty(0), None, [], {})


class VisionSamples:
    """The image side of a dataset: finds a record's images, loads them (failing at load with
    file, line and field) and expands the placeholders of its ids. Shared by the SFT and prompt
    datasets so that images ride the same path as text."""

    def __init__(self, processor, images_field: str | None, min_pixels, max_pixels) -> None:
        self.images = (
            ImageProcessor(processor, min_pixels=min_pixels, max_pixels=max_pixels)
            if processor is not None
            else None
        )
        if self.images is None and (min_pixels is not None or max_pixels is not None):
            raise ValueError(
                "min_pixels / max_pixels need a vision-language processor (the dataset was "
                "given a tokenizer)"
            )
        self.field = images_field

    def messages(self, src: Records, i: int, msgs: list[dict[str, Any]]):
        """``(messages with image parts, decoded images or None)`` of record ``i``."""
        where = src.where(i)
        if self.images is None:
            # Text models: "<image>" in a string is just text, but an image field is an error.
            if self.field and src[i].get(self.field):
                raise DataError(
                    f"{where}: the record has images, but the dataset was built with a "
                    "tokenizer: a vision-language model's processor is needed (is the model a "
                    "VLM?)"
                )
            if has_parts(msgs):
                raise DataError(
                    f"{where}: content parts (lists) need a vision-language model's processor"
                )
            return msgs, None
        msgs, raw = record_images(src[i], msgs, self.field, where)
        if not raw:
            return msgs, None
        field = self.field or "content"
        return msgs, self.images.load(raw, base_dir=src.base_dir(i), where=where, field=field)

    def raw_mode(self, src: Records, i: int) -> None:
        """Raw (template-free) records cannot place vision tokens: refuse their images."""
        if self.field and src[i].get(self.field):
            raise DataError(
                f"{src.where(i)}: field {self.field!r}: images need apply_chat_template=true "
                "(the chat template places the vision tokens)"
            )

    def expand(
        self, ids: list[int], labels, images, where: str
    ) -> tuple[list[int], Any, ImageInputs | None]:
        """Process the sample's images and expand its placeholders; a vision-language sample
        without images must hold no placeholder (the forward would find no image for it)."""
        if self.images is None:
            return ids, labels, None
        inputs = self.images.process(images) if images else _NO_IMAGES
        ids, labels = self.images.expand(ids, labels, inputs, where, self.field or "content")
        return ids, labels, inputs if images else None

    def intact(self, ids: list[int], inputs: ImageInputs | None) -> bool:
        """Whether truncated ``ids`` still hold every vision token of the sample's images."""
        if inputs is None:
            return True
        assert self.images is not None
        tok = self.images.image_token_id
        return sum(1 for t in ids if t == tok) == sum(inputs.num_tokens)


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised SFT samples: ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}``, plus
    ``"images"`` (an :class:`~lightrft.data.vision.ImageInputs`) for samples with images.

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
    ) -> None:
        _check_truncation(truncation)
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2 (a token and its target), got {max_length}")
        tokenizer, processor = as_processor(tokenizer)
        eos_id(tokenizer)
        self.tokenizer = tokenizer
        self.vision = VisionSamples(processor, images_field, min_pixels, max_pixels)
        self.max_length = max_length
        src = open_records(path, records, split)
        self.source = src.name

        ids_chunks, label_chunks, lengths, origins = [], [], [], []
        self._images: list[list[Any] | None] = []
        truncated = dropped = 0
        for i in range(len(src)):
            ids, labels, images = self._encode(
                src,
                i,
                prompt_field=prompt_field,
                completion_field=completion_field,
                messages_field=messages_field,
                system_prompt=system_prompt,
                apply_chat_template=apply_chat_template,
            )
            ids, labels, inputs = self.vision.expand(ids, labels, images, src.where(i))
            labels[0] = IGNORE_INDEX
            if max_length is not None and len(ids) > max_length:
                if truncation == "drop":
                    dropped += 1
                    continue
                ids, labels = ids[:max_length], labels[:max_length]
                if all(lab == IGNORE_INDEX for lab in labels) or not self.vision.intact(
                    ids, inputs
                ):
                    # The prompt alone fills max_length (nothing left to learn), or an image
                    # lost some of its vision tokens (the forward would refuse the sample).
                    dropped += 1
                    continue
                truncated += 1
            ids_chunks.append(torch.tensor(ids, dtype=torch.int32))
            label_chunks.append(torch.tensor(labels, dtype=torch.int32))
            lengths.append(len(ids))
            origins.append(src.where(i))
            self._images.append(images)
        if not lengths:
            raise DataError(
                f"empty dataset: max_length={max_length} (truncation={truncation!r}) dropped "
                f"all {len(src)} records of {self.source}; raise max_length"
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
        n_images = sum(len(x) for x in self._images if x)
        if n_images:
            self.stats["images"] = n_images
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
    ) -> tuple[list[int], list[int], list[Any] | None]:
        """Ids and labels of record ``i`` (chat if it has ``messages_field``), and its decoded
        images (None without); image placeholders are not expanded yet."""
        rec, where = src[i], src.where(i)
        if rec.get(messages_field) is not None:
            if not apply_chat_template:
                raise DataError(
                    f"{where}: chat records ({messages_field!r}) need apply_chat_template=true"
                )
            msgs = check_messages(rec[messages_field], where, messages_field)
            msgs, images = self.vision.messages(src, i, msgs)
            ids, labels = encode_chat(self.tokenizer, with_system(msgs, system_prompt), where)
            return ids, labels, images
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
            self.vision.raw_mode(src, i)
            return (*encode_raw(self.tokenizer, prompt, completion, system_prompt), None)
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        else:
            msgs = check_messages(prompt, where, prompt_field)
        msgs, images = self.vision.messages(src, i, msgs)
        msgs = [*with_system(msgs, system_prompt), {"role": "assistant", "content": completion}]
        return (*encode_chat(self.tokenizer, msgs, where), images)

    def __len__(self) -> int:
        return len(self._origins)

    def __getitem__(self, i: int) -> dict[str, Any]:
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        item: dict[str, Any] = {
            "input_ids": self._ids[a:b].long(),  # [L]
            "labels": self._labels[a:b].long(),  # [L]
        }
        images = self._images[i]
        if images is not None:
            # Processed on access: pixel values of a whole dataset would not fit in memory.
            assert self.vision.images is not None
            item["images"] = self.vision.images.process(images)
        return item

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample (what packing bins)."""
        return self._lengths.tolist()

    def where(self, i: int) -> str:
        """The file and line (or row) sample ``i`` came from."""
        return self._origins[i]
