"""Images for vision-language samples: decode, resize, process, and place vision tokens.

A record's images come from an ``images`` field (a list; a single value is a list of one) or
inline in HF content parts (``{"type": "image", "image": ...}``). Each image may be

- a path, relative to the data file's directory (or absolute);
- a base64 string, bare or as a ``data:image/...;base64,`` URL;
- a ``PIL.Image`` (in-memory records, HF ``datasets`` image columns);
- a ``{"bytes": ..., "path": ...}`` dict (an HF image column read from parquet).

Images are decoded when the dataset is built (a missing file or undecodable image fails there,
naming the file, line and field), converted to RGB and resized, keeping the aspect ratio, so
that ``min_pixels <= width * height <= max_pixels`` (``media.image``: :class:`ImageOptions`). The model's chat template renders each
image part as the model's placeholder (``<|image_pad|>`` for Qwen-VL, ``<image>`` for LLaVA);
:class:`~lightrft.data.records.MediaSamples` then expands every placeholder token into as many
copies as the image has vision tokens, which is what the model's forward expects.

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
from typing import Any, ClassVar

import torch

from lightrft.config import Section, option, section
from lightrft.data.io import DataError, MediaItems, local_file

# A string prompt may mark where images go with this tag (the Geo3K / verl convention).
IMAGE_PLACEHOLDER = "<image>"


def decode_image(value: Any, *, base_dir: Path | None, where: str, field: str):
    """An RGB ``PIL.Image`` from a path, base64 string, bytes, HF image dict or PIL image.

    Raises:
        DataError: naming ``where`` (file and line) and ``field`` for a missing file or data
            that is not a decodable image.
    """
    from PIL import Image

    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if data is not None else path
        if value is None:
            raise DataError(f"{where}: {field}: an image dict needs 'bytes' or 'path'")
    if isinstance(value, str) and not value.startswith("data:"):
        try:
            value = local_file(value, base_dir, where, field, "image").read_bytes()
        except DataError:
            # A long string without path separators that is not a file is most likely base64.
            if len(value) <= 64 or "/" in value[:64].strip("+=") or "." in value[-8:]:
                raise
    if isinstance(value, str):  # base64, bare or as a data:image/...;base64, URL
        payload = value.partition(",")[2] if value.startswith("data:") else value
        try:
            value = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise DataError(f"{where}: {field}: not a valid base64 image") from None
    if isinstance(value, (bytes, bytearray)):
        try:
            value = Image.open(io.BytesIO(value))
            value.load()
        except Exception as e:  # PIL raises several types for corrupt data
            raise DataError(f"{where}: {field}: cannot decode the image ({e})") from None
    if not isinstance(value, Image.Image):
        raise DataError(
            f"{where}: {field}: expected an image path, base64 string, bytes or PIL image, "
            f"got {type(value).__name__}"
        )
    return value.convert("RGB") if value.mode != "RGB" else value


def fit_pixels(img, min_pixels: int | None, max_pixels: int | None):
    """``img`` resized (aspect kept, bicubic) so that its area is within the pixel bounds."""
    w, h = img.size
    area = w * h
    target = min(max(area, min_pixels or 0), max_pixels or math.inf)  # ImageOptions: min <= max
    if target == area:
        return img
    scale = math.sqrt(target / area)
    # floor when shrinking and ceil when growing, so the bound holds after rounding.
    rnd = math.floor if scale < 1 else math.ceil
    size = (max(1, rnd(w * scale)), max(1, rnd(h * scale)))
    from PIL import Image

    return img.resize(size, Image.Resampling.BICUBIC)


@dataclass
class ImageInputs(MediaItems):
    """The processed images of one sample (or, after :meth:`cat`, of a micro-batch).

    ``images``: resized RGB PIL images, in placeholder order. ``pixel_values``: Qwen-VL's flat
    ``[patches, D]`` patches, or ``[images, 3, H, W]`` (LLaVA). ``image_grid_thw``: ``[images, 3]``
    (Qwen-VL) or None. ``num_tokens``: vision tokens per image (placeholder copies in the ids).
    ``processor_kwargs``: the image-processor settings used (vLLM re-processes with them).
    """

    kind: ClassVar[str] = "image"
    model_keys: ClassVar[tuple[str, ...]] = ("pixel_values", "image_grid_thw")

    images: list[Any]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None
    num_tokens: list[int]
    processor_kwargs: dict[str, Any]

    def parts(self) -> list[dict[str, Any]]:
        """Each image as the keys of its inline content part (``{"image": PIL image}``)."""
        return [{"image": im} for im in self.images]


@section
class ImageOptions(Section):
    """How a dataset (or a vision-language reward model or judge) reads and sizes its images:
    the ``media.image`` keys."""

    field: str = option("images", doc="the records' image list (absent: inline image parts)")
    min_pixels: int | None = option(
        None, ge=1, doc="least area of an image (null: the processor's)"
    )
    max_pixels: int | None = option(None, ge=1, doc="most area of an image (null: the processor's)")

    def resolve(self, at: str) -> ImageOptions:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"{at}min_pixels ({self.min_pixels}) must be <= {at}max_pixels ({self.max_pixels})"
            )
        return self


class ImageProcessor:
    """A VLM processor plus the pixel bounds: decodes, resizes and processes a sample's images
    (:class:`~lightrft.data.records.MediaSamples` expands their placeholders).

    Args:
        processor: the model's processor (``lightrft.models.load_processor``).
        options: the pixel bounds (:class:`ImageOptions`); None bounds keep the processor's own
            (Qwen-VL's image processor still applies its bounds after ours).
    """

    kind, tag, inline = "image", IMAGE_PLACEHOLDER, ("image", "path", "url")
    needs = "a vision-language"

    @staticmethod
    def takes(processor) -> bool:
        """Whether a model's processor takes images (it has an image processor)."""
        return getattr(processor, "image_processor", None) is not None

    def __init__(self, processor, options: ImageOptions) -> None:
        self.processor = processor
        self.min_pixels, self.max_pixels = options.min_pixels, options.max_pixels
        self.token = processor.image_token
        self.token_id = int(processor.image_token_id)
        self.kwargs: dict[str, Any] = {}
        ip = processor.image_processor
        if hasattr(ip, "merge_size") and (self.min_pixels or self.max_pixels):
            bounds = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
            self.kwargs["size"] = {**dict(ip.size), **{k: v for k, v in bounds.items() if v}}

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
            return ImageInputs(list(images), pixels, grid, counts, dict(self.kwargs))
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
        return ImageInputs(list(images), pixels, grid, [n] * len(images), dict(self.kwargs))
