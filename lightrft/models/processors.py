"""Qwen-VL processors without the video slot (images only), so they build without torchvision.

The stock ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` refuse to build
without a video processor, and the video processors need torchvision, which does not import beside
the torch 2.13 CPU wheel. These subclasses pass ``None`` for the video slot; processing images and
``apply_chat_template`` work as in the stock ones. They save and load under their own class names,
registered with ``AutoProcessor`` when this module is imported (it imports transformers: import it
through :func:`lightrft.models.multimodal.processor_classes`).
"""

from __future__ import annotations

from transformers import (
    CONFIG_MAPPING,
    AutoProcessor,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)


class _ImageOnly:
    """A Qwen-VL processor without a video processor (images only; needs no torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen2VLImageOnlyProcessor(_ImageOnly, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without a video processor (images only; needs no torchvision)."""


class Qwen2_5_VLImageOnlyProcessor(_ImageOnly, Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without a video processor (images only; needs no torchvision)."""


class Qwen3VLImageOnlyProcessor(_ImageOnly, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without a video processor (images only; needs no torchvision)."""


# model_type -> the image-only processor that stands in for the stock one.
PROCESSOR_CLASSES: dict[str, type] = {
    "qwen2_vl": Qwen2VLImageOnlyProcessor,
    "qwen2_5_vl": Qwen2_5_VLImageOnlyProcessor,
    "qwen3_vl": Qwen3VLImageOnlyProcessor,
}


# exist_ok: re-importing (tests, runpy) must not fail. AutoProcessor resolves the class name
# written in processor_config.json against registered classes, so saved dirs load back.
for _model_type, _cls in PROCESSOR_CLASSES.items():
    AutoProcessor.register(CONFIG_MAPPING[_model_type], _cls, exist_ok=True)
