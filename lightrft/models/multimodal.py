"""Vision- and audio-language models: loading with their processors, the encoder towers, and
their freezing.

Audio-language models (Qwen2-Audio: an ``audio_config``, a ``WhisperFeatureExtractor``, numpy
only) load through the same functions; their audio tower is frozen by default as the vision
tower is (:func:`set_towers_trainable`).

Any ``AutoModelForImageTextToText`` checkpoint loads through :func:`load_vision_model`, its
processor through :func:`load_processor`. Three facts shape this module:

* the PyPI torchvision does not import beside the torch 2.13 CPU wheel, so transformers picks the
  PIL image processors (``Qwen2VLImageProcessorPil``, ``CLIPImageProcessorPil``);
* the stock ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` refuse to build without a video
  processor, which needs torchvision. :mod:`lightrft.models.processors` holds the same processors
  without the video slot; they save and load under their own class name, registered with
  ``AutoProcessor`` when loaded (``AutoProcessor`` falls back to a bare tokenizer for a class it
  does not know);
* the vision tower is frozen by default for RL, as peers do (verl, OpenRLHF):
  :func:`set_vision_trainable` freezes or unfreezes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lightrft.models.loading import (
    bind_template_args,
    check_local,
    find_module_list,
    load_model,
    load_tokenizer,
)
from lightrft.models.modality import is_multimodal


def processor_classes() -> dict[str, type]:
    """model_type -> the image-only processor class standing in for the stock one (imports
    transformers and registers the classes with ``AutoProcessor`` on first use)."""
    from lightrft.models import processors

    return processors.PROCESSOR_CLASSES


def checkpoint_config(path: str | Path) -> dict | None:
    """The local checkpoint's ``config.json`` (cheap: no transformers import, no weights);
    None without one (a hub id, or a directory a ``prepare`` step writes later)."""
    cfg = Path(path) / "config.json"
    return json.loads(cfg.read_text()) if cfg.is_file() else None


def _has_config(path: str | Path, *keys: str) -> bool | None:
    """Whether the local checkpoint's ``config.json`` has one of the sections ``keys``; None
    without a local ``config.json`` (:func:`checkpoint_config`)."""
    data = checkpoint_config(path)
    return None if data is None else any(data.get(k) is not None for k in keys)


def checkpoint_is_multimodal(path: str | Path) -> bool | None:
    """:func:`checkpoint_is_vision_language` for vision or audio (``audio_config``) models."""
    return _has_config(path, "vision_config", "audio_config")


def checkpoint_is_audio_language(path: str | Path) -> bool | None:
    """Whether the local checkpoint at ``path`` is an audio-language model (its config.json
    has an ``audio_config``); None without a local config.json."""
    return _has_config(path, "audio_config")


def checkpoint_is_vision_language(path: str | Path) -> bool | None:
    """Whether the local checkpoint at ``path`` is a vision-language model, from its
    ``config.json`` alone; None when there is no local ``config.json``."""
    return _has_config(path, "vision_config")


def load_processor(path: str | Path, *, trust_remote_code: bool = False):
    """The processor (image processor + tokenizer + chat template) of a local VLM dir or hub id.

    A directory saved with one of our image-only processors loads as that class. A stock Qwen2-VL
    / Qwen2.5-VL checkpoint loads with the stock processor where torchvision is present and with
    the image-only one where it is not. The tokenizer gets a pad token (eos) if it has none.

    Raises:
        ValueError: the path holds no processor (e.g. a text-only model).
    """
    from transformers import AutoProcessor, ProcessorMixin

    check_local(path)
    # The image-only stand-in for the checkpoint's model type, if it has one. (A directory saved
    # with one names its class, which AutoProcessor loads once processor_classes registered it.)
    stand_in = processor_classes().get((checkpoint_config(path) or {}).get("model_type") or "")
    try:
        proc = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, ImportError, OSError, TypeError) as e:
        # Without torchvision the stock Qwen-VL processors cannot build their video slot.
        if stand_in is None:
            raise ValueError(f"cannot load a processor from {str(path)!r}: {e}") from e
        proc = stand_in.from_pretrained(path)
    else:
        media = getattr(proc, "image_processor", None) or getattr(proc, "feature_extractor", None)
        if not isinstance(proc, ProcessorMixin) or media is None:
            if stand_in is None:
                raise ValueError(
                    f"{str(path)!r} has no image processor or audio feature extractor "
                    f"(AutoProcessor gave {type(proc).__name__}): is it a vision-language or "
                    "audio-language model directory?"
                )
            proc = stand_in.from_pretrained(path)
    tok = proc.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return proc


def load_vision_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
) -> nn.Module:
    """An ``AutoModelForImageTextToText`` model (vision-language), or an
    ``AutoModelForMultimodalLM`` one (audio-language: Qwen2-Audio), from a local directory or
    hub id: :func:`~lightrft.models.loading.load_model` of a multimodal checkpoint (given a
    text-only checkpoint, it loads the causal LM, as ``load_model`` does)."""
    return load_model(
        path,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )


# Per tower kind: the attributes of the base model that may hold it, the paths of its blocks.
_TOWERS = {
    "vision": (
        ("visual", "vision_tower", "vision_model"),
        ("blocks", "vision_model.encoder.layers", "encoder.layers"),
    ),
    "audio": (("audio_tower",), ("layers", "encoder.layers")),
}


def _tower(model: nn.Module, kind: str) -> tuple[str, nn.Module]:
    """The ``kind`` tower of an ``*ForConditionalGeneration`` and its name."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, model)
    for attr in _TOWERS[kind][0]:
        mod = getattr(base, attr, None)
        if isinstance(mod, nn.Module):
            return f"{prefix}.{attr}", mod
    raise ValueError(f"cannot find the {kind} tower of {type(model).__name__}")


def _set_tower_trainable(model: nn.Module, kind: str, trainable: bool) -> list[str]:
    prefix, tower = _tower(model, kind)
    for p in tower.parameters():
        p.requires_grad_(trainable)
    return [f"{prefix}.{name}" for name, _ in tower.named_parameters()]


def set_audio_trainable(model: nn.Module, trainable: bool) -> list[str]:
    """Freeze (``trainable=False``, the default) or unfreeze the audio tower in place; as
    :func:`set_vision_trainable`. Returns the names of the parameters set."""
    return _set_tower_trainable(model, "audio", trainable)


def _tower_kinds(model: nn.Module) -> list[str]:
    """The encoder towers a model has: ``"vision"``, ``"audio"`` (none for a text model), each
    when its config has a ``<kind>_config`` (as :mod:`lightrft.models.modality` reads it)."""
    config = getattr(model, "config", None)
    return [k for k in _TOWERS if getattr(config, f"{k}_config", None) is not None]


def media_blocks(model: nn.Module) -> list[nn.Module]:
    """The vision and audio tower blocks of a multimodal model (none for a text model): what
    FSDP2 shards one by one."""
    found = []
    for kind in _tower_kinds(model):
        _, tower = _tower(model, kind)
        blocks = find_module_list(tower, _TOWERS[kind][1])
        if blocks is None:
            raise ValueError(f"cannot find the blocks of the {kind} tower {type(tower).__name__}")
        found += blocks
    return found


def set_towers_trainable(
    model: nn.Module, *, vision: bool = False, audio: bool = False
) -> list[str]:
    """Freeze or unfreeze each encoder tower the model has (vision, audio); what recipes call
    with ``model.train_vision_tower`` / ``model.train_audio_tower``."""
    trainable = {"vision": vision, "audio": audio}
    return [
        name
        for kind in _tower_kinds(model)
        for name in _set_tower_trainable(model, kind, trainable[kind])
    ]


def set_vision_trainable(model: nn.Module, trainable: bool) -> list[str]:
    """Freeze (``trainable=False``, the RL default) or unfreeze the vision tower in place.

    Call before building the optimizer and before ``parallelize``. Returns the names of the
    parameters whose ``requires_grad`` is now ``trainable``.
    """
    return _set_tower_trainable(model, "vision", trainable)


def load_processors(
    path: str | Path, *, trust_remote_code: bool = False, config=None, template_args=None
):
    """``(processor, tokenizer)`` of a checkpoint, what datasets and exports take: a vision- or
    audio-language model's processor and its tokenizer, or a text model's tokenizer twice.
    ``config``: the loaded model's HF config (else the checkpoint's config.json decides);
    ``template_args``: ``model.chat_template_args``, bound to the tokenizer's renders."""
    multimodal = checkpoint_is_multimodal(path) if config is None else is_multimodal(config)
    if multimodal:
        processor = load_processor(path, trust_remote_code=trust_remote_code)
        key = "model.chat_template_args"
        return processor, bind_template_args(processor.tokenizer, template_args, key=key)
    tokenizer = load_tokenizer(
        path, trust_remote_code=trust_remote_code, template_args=template_args
    )
    return tokenizer, tokenizer


def check_towers(model) -> None:
    """``model.train_vision_tower`` needs a vision-language checkpoint and
    ``model.train_audio_tower`` an audio-language one (read from config.json; a checkpoint that
    a ``prepare`` step writes is checked again before loading). ``model``: the model section."""
    for kind, train in (("vision", model.train_vision_tower), ("audio", model.train_audio_tower)):
        if train and _has_config(model.path, f"{kind}_config") is False:
            raise ValueError(
                f"model.train_{kind}_tower=true but {model.path} is not a {kind}-language model "
                f"(its config.json has no {kind}_config)"
            )
