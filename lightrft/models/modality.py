"""Which media an HF model config takes (vision, audio), and the placeholder token ids its
processor places: what datasets, engines and the forward funnel ask of a model's config.

Pure functions of the config object; no transformers import.
"""

from __future__ import annotations


def is_vision_language(config) -> bool:
    """Whether an HF config describes a vision-language model (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def is_audio_language(config) -> bool:
    """Whether an HF config describes an audio-language model (it has an ``audio_config``:
    Qwen2-Audio)."""
    return getattr(config, "audio_config", None) is not None


def is_multimodal(config) -> bool:
    """Whether an HF config describes a vision- or audio-language model: one that loads with
    its processor and takes media inputs beside the token ids."""
    return is_vision_language(config) or is_audio_language(config)


def _token_id(config, kind: str) -> int:
    for key in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} names no {kind} token id")


def image_token_id(config) -> int:
    """The id of the image placeholder token (``image_token_id``, LLaVA's ``image_token_index``)."""
    return _token_id(config, "image")


def audio_token_id(config) -> int:
    """The id of the audio placeholder token (Qwen2-Audio's ``audio_token_index``)."""
    return _token_id(config, "audio")


# Vision-language models whose videos the engines place (one run of video tokens per video;
# Qwen3-VL interleaves frame timestamps and is not among them).
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def placeholder_ids(config) -> dict[str, int]:
    """The media kinds a model takes, each with its placeholder token id: ``image`` (and
    ``video`` for :data:`VIDEO_MODEL_TYPES`) for a vision-language model, ``audio`` for an
    audio-language one; empty for a text model."""
    ids = {}
    if is_vision_language(config):
        ids["image"] = image_token_id(config)
        if config.model_type in VIDEO_MODEL_TYPES:
            ids["video"] = int(config.video_token_id)
    if is_audio_language(config):
        ids["audio"] = audio_token_id(config)
    return ids


_VISION_TOKEN_KEYS = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def vision_token_ids(config) -> list[int]:
    """Token ids that only the processor may place (image/video placeholders, vision markers).

    A sampler must never emit them: the next forward would find more placeholders than image
    features (a random tiny Qwen2-VL does sample ``<|image_pad|>``).
    """
    values = (getattr(config, key, None) for key in _VISION_TOKEN_KEYS)
    return list(dict.fromkeys(int(v) for v in values if v is not None))


def media_token_ids(config) -> list[int]:
    """:func:`vision_token_ids` plus the audio placeholder: ids a sampler must never emit."""
    ids = vision_token_ids(config) if is_vision_language(config) else []
    audio = [audio_token_id(config)] if is_audio_language(config) else []
    return list(dict.fromkeys(ids + audio))
