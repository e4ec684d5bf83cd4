"""Images for vision-language samples: decode, resize, process, and place vision tokens.

A record's images come from an ``images`` field (a list; a single value is a list of one) or
inline in HF content parts (``{"type": "image", "image": ...}``). Each image may be

- a path, relative to the data file's directory (or absolute);
- a base64 string, bare or as a ``data:image/...;base64,`` URL;
- a ``PIL.Image`` (in-memory records, HF ``datasets`` image columns);
- a ``{"bytes": ..., "path": ...}`` dict (an HF image column read from parquet).

Images are decoded when the dataset is built (a missing file or undecodable image fails there,
naming the file, line and field), converted to RGB and resized, keeping the aspect ratio, so
that ``min_pixels <= width * height <= max_pixels``. The model's chat template renders each
image part as the model's placeholder (``<|image_pad|>`` for Qwen-VL, ``<image>`` for LLaVA);
:class:`ImageProcessor` then expands every placeholder token into as many copies as the image
has vision tokens, which is what the model's forward expects.

Per sample, the processed images travel as one :class:`ImageInputs`: the resized PIL images
(what vLLM takes), the ``pixel_values`` (Qwen-VL: a flat ``[patches, D]`` tensor; LLaVA:
``[images, 3, H, W]``), the ``image_grid_thw`` rows (Qwen-VL) and the tokens per image.
:meth:`ImageInputs.cat` joins the images of several samples in order, as one forward takes them.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightrft.data.io import DataError

__all__ = [
    "IMAGE_PLACEHOLDER",
    "MEDIA_KINDS",
    "ImageInputs",
    "ImageProcessor",
    "content_with_images",
    "decode_image",
    "expand_placeholders",
    "fit_pixels",
    "record_media",
    "split_tags",
]

# A string prompt may mark where images go with this tag (the Geo3K / verl convention).
IMAGE_PLACEHOLDER = "<image>"


def _pil():
    from PIL import Image

    return Image


def decode_image(value: Any, *, base_dir: Path | None, where: str, field: str):
    """An RGB ``PIL.Image`` from a path, base64 string, bytes, HF image dict or PIL image.

    Raises:
        DataError: naming ``where`` (file and line) and ``field`` for a missing file or data
            that is not a decodable image.
    """
    Image = _pil()
    if isinstance(value, Image.Image):
        img = value
    else:
        if isinstance(value, dict):
            data, path = value.get("bytes"), value.get("path")
            value = data if data is not None else path
            if value is None:
                raise DataError(f"{where}: {field}: an image dict needs 'bytes' or 'path'")
        if isinstance(value, str):
            value = _read_image_string(value, base_dir=base_dir, where=where, field=field)
        if not isinstance(value, (bytes, bytearray)):
            raise DataError(
                f"{where}: {field}: expected an image path, base64 string, bytes or PIL image, "
                f"got {type(value).__name__}"
            )
        try:
            img = Image.open(io.BytesIO(value))
            img.load()
        except Exception as e:  # PIL raises several types for corrupt data
            raise DataError(f"{where}: {field}: cannot decode the image ({e})") from None
    return img.convert("RGB") if img.mode != "RGB" else img


def _read_image_string(value: str, *, base_dir: Path | None, where: str, field: str) -> bytes:
    if value.startswith("data:"):
        _, _, payload = value.partition(",")
        return _b64(payload, where, field)
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.is_file():
        return path.read_bytes()
    # A long string without path separators that is not a file is most likely base64.
    if len(value) > 64 and "/" not in value[:64].strip("+=") and "." not in value[-8:]:
        return _b64(value, where, field)
    raise DataError(f"{where}: {field}: image file not found: {path}")


def _b64(payload: str, where: str, field: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise DataError(f"{where}: {field}: not a valid base64 image") from None


def fit_pixels(img, min_pixels: int | None, max_pixels: int | None):
    """``img`` resized (aspect kept, bicubic) so that its area is within the pixel bounds."""
    w, h = img.size
    area = w * h
    scale = 1.0
    if max_pixels is not None and area > max_pixels:
        scale = math.sqrt(max_pixels / area)
    elif min_pixels is not None and area < min_pixels:
        scale = math.sqrt(min_pixels / area)
    if scale == 1.0:
        return img
    # floor when shrinking and ceil when growing, so the bound holds after rounding.
    rnd = math.floor if scale < 1 else math.ceil
    size = (max(1, rnd(w * scale)), max(1, rnd(h * scale)))
    return img.resize(size, _pil().Resampling.BICUBIC)


def content_with_images(content: Any) -> list[dict[str, Any]]:
    """HF content parts of a message: a string becomes text parts split at ``<image>`` tags
    (each tag an image part); a list of parts is returned as is."""
    return split_tags(content, ["image"])


@dataclass
class ImageInputs:
    """The processed images of one sample (or, after :meth:`cat`, of a micro-batch).

    ``images``: resized RGB PIL images, in placeholder order. ``pixel_values``: Qwen-VL's flat
    ``[patches, D]`` patches, or ``[images, 3, H, W]`` (LLaVA). ``image_grid_thw``: ``[images, 3]``
    (Qwen-VL) or None. ``num_tokens``: vision tokens per image (placeholder copies in the ids).
    ``processor_kwargs``: the image-processor settings used (vLLM re-processes with them).
    """

    images: list[Any]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None
    num_tokens: list[int]
    processor_kwargs: dict[str, Any]

    def __len__(self) -> int:
        return len(self.images)

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The model's keyword arguments: ``pixel_values`` (+ ``image_grid_thw``)."""
        out = {"pixel_values": self.pixel_values.to(device) if device else self.pixel_values}
        if self.image_grid_thw is not None:
            out["image_grid_thw"] = (
                self.image_grid_thw.to(device) if device else self.image_grid_thw
            )
        return out

    @staticmethod
    def cat(items: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """The images of several samples, in order (None entries, text-only samples, skipped)."""
        present = [x for x in items if x is not None and len(x)]
        if not present:
            return None
        if len(present) == 1:
            return present[0]
        grids = [x.image_grid_thw for x in present]
        if any(g is None for g in grids) and not all(g is None for g in grids):
            raise ValueError("cannot batch images of different processors (grid rows mixed)")
        return ImageInputs(
            images=[im for x in present for im in x.images],
            pixel_values=torch.cat([x.pixel_values for x in present]),
            image_grid_thw=None if grids[0] is None else torch.cat(grids),  # type: ignore[arg-type]
            num_tokens=[n for x in present for n in x.num_tokens],
            processor_kwargs=present[0].processor_kwargs,
        )


class ImageProcessor:
    """A VLM processor plus the pixel bounds: decodes, resizes and processes a sample's images
    and expands the image placeholders of its token ids.

    Args:
        processor: the model's processor (``lightrft.models.load_processor``).
        min_pixels, max_pixels: bounds on ``width * height`` of every image; None keeps the
            processor's own (Qwen-VL's image processor still applies its bounds after ours).
    """

    def __init__(self, processor, *, min_pixels: int | None = None, max_pixels: int | None = None):
        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            raise ValueError(f"min_pixels ({min_pixels}) must be <= max_pixels ({max_pixels})")
        for name, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.image_token = processor.image_token
        self.image_token_id = int(processor.image_token_id)
        self.kwargs: dict[str, Any] = {}
        ip = processor.image_processor
        if hasattr(ip, "merge_size") and (min_pixels or max_pixels):
            size = dict(ip.size)
            if min_pixels:
                size["shortest_edge"] = min_pixels
            if max_pixels:
                size["longest_edge"] = max_pixels
            self.kwargs["size"] = size

    def load(self, values: Sequence[Any], *, base_dir: Path | None, where: str, field: str):
        """Decoded, resized images of a record (fails at load, naming file, line and field)."""
        return [
            fit_pixels(
                decode_image(v, base_dir=base_dir, where=where, field=f"{field}[{j}]"),
                self.min_pixels,
                self.max_pixels,
            )
            for j, v in enumerate(values)
        ]

    def process(self, images: Sequence[Any]) -> ImageInputs:
        """Pixel values, grid rows and vision-token counts of decoded images."""
        out = self.processor.image_processor(list(images), return_tensors="pt", **self.kwargs)
        grid = out.get("image_grid_thw")
        pixels = out["pixel_values"]
        if grid is not None:
            merge = int(self.processor.image_processor.merge_size)
            counts = [int(n) for n in (grid.prod(-1) // merge**2).tolist()]
        else:
            counts = [self._fixed_count(pixels)] * len(images)
        return ImageInputs(list(images), pixels, grid, counts, dict(self.kwargs))

    def _fixed_count(self, pixels: torch.Tensor) -> int:
        # LLaVA-style: one token per patch (+ CLS unless the 'default' strategy drops it).
        proc = self.processor
        patch = getattr(proc, "patch_size", None)
        if patch is None:
            raise ValueError(
                f"{type(proc).__name__}: cannot tell how many tokens an image takes (no "
                "image_grid_thw and no patch_size)"
            )
        h, w = pixels.shape[-2:]
        n = (h // patch) * (w // patch) + int(getattr(proc, "num_additional_image_tokens", 0))
        if getattr(proc, "vision_feature_select_strategy", None) == "default":
            n -= 1
        return n

    def expand(
        self, ids: list[int], labels: list[int] | None, inputs: ImageInputs, where: str, field: str
    ) -> tuple[list[int], list[int] | None]:
        """Repeat the k-th placeholder token ``inputs.num_tokens[k]`` times (labels: -100)."""
        return expand_placeholders(
            ids,
            labels,
            token_id=self.image_token_id,
            token=self.image_token,
            counts=inputs.num_tokens,
            kind="image",
            where=where,
            field=field,
        )


def _a(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


_TAGS = {"image": IMAGE_PLACEHOLDER, "video": "<video>", "audio": "<audio>"}


def expand_placeholders(
    ids: list[int],
    labels: list[int] | None,
    *,
    token_id: int,
    token: str,
    counts: Sequence[int],
    kind: str,
    where: str,
    field: str,
) -> tuple[list[int], list[int] | None]:
    """Repeat the k-th ``token_id`` placeholder ``counts[k]`` times (labels: -100), the layout
    the model's forward expects for its k-th image or audio.

    Raises:
        DataError: the rendered ids hold more or fewer placeholders than there are media items,
            or a placeholder sits in a trained (assistant) position.
    """
    from lightrft.data.templates import IGNORE_INDEX

    found = sum(1 for t in ids if t == token_id)
    if found != len(counts):
        raise DataError(
            f"{where}: {field}: {len(counts)} {kind}(s) but the rendered prompt has {found} "
            f"{kind} placeholder(s) ({token!r}); give one {kind} part "
            f'({{"type": "{kind}"}}) or {_TAGS[kind]} tag per {kind}'
        )
    out_ids: list[int] = []
    out_labels: list[int] | None = [] if labels is not None else None
    k = 0
    for j, t in enumerate(ids):
        if t != token_id:
            out_ids.append(t)
            if out_labels is not None:
                out_labels.append(labels[j])  # type: ignore[index]
            continue
        if labels is not None and labels[j] != IGNORE_INDEX:
            raise DataError(
                f"{where}: {field}: {_a(kind)} {kind} in an assistant turn; {kind} parts go in "
                "user turns"
            )
        out_ids.extend([token_id] * counts[k])
        if out_labels is not None:
            out_labels.extend([IGNORE_INDEX] * counts[k])
        k += 1
    return out_ids, out_labels


# Where an inline part holds its source, per kind (HF content format; Qwen2-Audio's "audio_url").
_INLINE_KEYS = {
    "image": ("image", "path", "url"),
    "video": ("video", "path", "url"),
    "audio": ("audio", "path", "url", "audio_url"),
}
MEDIA_KINDS = ("image", "video", "audio")


def as_processor(tokenizer_or_processor) -> tuple[Any, Any | None]:
    """``(tokenizer, processor or None)`` from what a recipe passes a dataset as its first
    argument: a tokenizer (text models) or a multimodal processor (images and/or audio)."""
    obj = tokenizer_or_processor
    media = getattr(obj, "image_processor", None) or getattr(obj, "feature_extractor", None)
    if media is not None and hasattr(obj, "tokenizer"):
        return obj.tokenizer, obj
    return obj, None


def split_tags(content: Any, kinds: Sequence[str]) -> list[dict[str, Any]]:
    """HF content parts of a message: a string becomes text parts split at the tags of
    ``kinds`` (``<image>``, ``<audio>``; each tag a part of its kind); a list is returned as is."""
    if not isinstance(content, str):
        return list(content)
    parts: list[dict[str, Any]] = []
    text = content
    while text:
        hits = [(text.find(_TAGS[k]), k) for k in kinds if _TAGS[k] in text]
        if not hits:
            parts.append({"type": "text", "text": text})
            break
        at, kind = min(hits)
        if at:
            parts.append({"type": "text", "text": text[:at]})
        parts.append({"type": kind})
        text = text[at + len(_TAGS[kind]) :]
    return parts


def record_media(
    rec: dict[str, Any],
    messages: list[dict[str, Any]],
    fields: dict[str, str | None],
    where: str,
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The messages with media parts, and the record's raw media per kind in placeholder order.

    ``fields`` maps each kind the model's processor takes (``"image"``, ``"video"``,
    ``"audio"``) to the
    record field holding that kind's list (or None: inline parts only). Media come from that
    field (a list, or one value) or inline in parts (``{"type": "image", "image": ...}``,
    ``{"type": "video", "video": ...}``, ``{"type": "audio", "audio": ...}``), not both. String
    contents are split at the kinds' tags (``<image>``, ``<video>``, ``<audio>``) into parts.

    Raises:
        DataError: media both in the field and inline, a different number of media than parts,
            or a part of a kind the model does not take.
    """
    kinds = [k for k in MEDIA_KINDS if k in fields]
    inline: dict[str, list[Any]] = {k: [] for k in kinds}
    n_parts = dict.fromkeys(kinds, 0)
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str) and not any(_TAGS[k] in content for k in kinds):
            out.append(m)
            continue
        parts = []
        for part in split_tags(content, kinds):
            kind = part.get("type")
            if kind in MEDIA_KINDS and kind not in kinds:
                takes = " and ".join(f"{k}s" for k in kinds)
                raise DataError(
                    f"{where}: {_a(kind)} {kind} part, but the model's processor takes {takes} only"
                )
            if kind in kinds:
                n_parts[kind] += 1
                src = next((part[k] for k in _INLINE_KEYS[kind] if part.get(k) is not None), None)
                if src is not None and kind == "video" and part.get("fps") is not None:
                    src = {"video": src, "fps": part["fps"]}  # a frame list's own rate
                if src is not None:
                    inline[kind].append(src)
                part = {"type": kind}
            parts.append(part)
        out.append({**m, "content": parts})
    media: dict[str, list[Any]] = {}
    for kind in kinds:
        field = fields[kind]
        raw = rec.get(field) if field else None
        if raw is not None and not isinstance(raw, (list, tuple)):
            raw = [raw]
        raw = list(raw) if raw is not None else []
        if raw and inline[kind]:
            raise DataError(
                f"{where}: {kind}s both in field {field!r} and inline in {kind} parts; "
                "give them one way"
            )
        found = raw or inline[kind]
        if len(found) != n_parts[kind]:
            raise DataError(
                f"{where}: field {field!r}: {len(found)} {kind}(s) but the messages have "
                f"{n_parts[kind]} {kind} part(s) (or {_TAGS[kind]} tags); give one per {kind}"
            )
        media[kind] = found
    return out, media
