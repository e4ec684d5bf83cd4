"""Loading actor, critic and reward models with their tokenizers or processors (text,
vision-language and audio-language) from HF directories; parallelize()."""

from lightrft.models.loading import load_causal_lm, load_model, load_tokenizer
from lightrft.models.lora import load_export
from lightrft.models.multimodal import (
    checkpoint_is_audio_language,
    checkpoint_is_multimodal,
    checkpoint_is_vision_language,
    load_processor,
    load_vision_model,
    set_audio_trainable,
    set_towers_trainable,
    set_vision_trainable,
)
from lightrft.models.parallel import parallelize

__all__ = [
    "checkpoint_is_audio_language",
    "checkpoint_is_multimodal",
    "checkpoint_is_vision_language",
    "load_causal_lm",
    "load_export",
    "load_model",
    "load_processor",
    "load_tokenizer",
    "load_vision_model",
    "parallelize",
    "set_audio_trainable",
    "set_towers_trainable",
    "set_vision_trainable",
]
