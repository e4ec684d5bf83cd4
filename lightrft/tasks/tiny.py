"""Tiny, randomly initialised Hugging Face models with a real tokenizer (and processor).

Tests and demos need a model that loads through exactly the same code path as a real checkpoint
(``from_pretrained`` on a directory holding ``config.json``, ``model.safetensors`` and the tokenizer
files) without a model hub. :func:`make_tiny_model` writes such a directory.

The tokenizer is character level: every printable ASCII character plus newline is one token, and
the chat markers are special tokens, so a chat template renders like Qwen's ChatML.

Vision-language archs (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``llava``) also write a
processor (PIL image processor, no torchvision) and a chat template that renders
``{"type": "image"}`` content parts as the model's vision placeholder; see
:mod:`lightrft.models.multimodal`. The audio-language arch ``qwen2_audio`` writes a
``Qwen2AudioForConditionalGeneration`` with a small Whisper-style audio tower and a
``Qwen2AudioProcessor`` (``WhisperFeatureExtractor``, numpy only; 16 mel bins and a 2 s chunk
instead of 128 and 30 s) whose template renders ``{"type": "audio"}`` parts as
``<|audio_bos|><|AUDIO|><|audio_eos|>``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import torch

# ChatML, as used by Qwen2.5; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# An assistant turn with tool_calls, as Qwen2.5-Instruct renders it: each call a <tool_call> block
# of JSON. Shared by both tool templates (the model's calls must parse the same either way).
_ASSISTANT_TOOL_CALLS = r"""{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
"""
# ChatML with Qwen2.5-Instruct's tool behaviour (written for the tiny models and their tests):
# with tools, a system turn lists each tool's JSON schema in <tools></tools> and explains the
# <tool_call> format; an assistant's tool_calls render as <tool_call> blocks; consecutive tool
# messages share one user turn, each in <tool_response>.
TOOL_CHAT_TEMPLATE = (
    r"""
{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- default_system }}{%- endif %}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
"""
    + _ASSISTANT_TOOL_CALLS
    + r"""{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
)
# ChatML whose system turn only names the tools (no JSON schemas, no format instructions): the
# tiny tool demo's template (lightrft.tasks.calc), where every prompt token costs step time and a
# model trained from scratch learns the call format from its SFT transcripts, not from a
# description. Assistant tool_calls render as Qwen's <tool_call> blocks; each tool message is a
# `tool` turn of its own.
COMPACT_TOOL_CHAT_TEMPLATE = (
    r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n' }}{%- endif %}
{{- 'tools:' }}
{%- for tool in tools %}{{- ' ' + (tool.function.name if tool.function is defined else tool.name) }}{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
"""
    + _ASSISTANT_TOOL_CALLS
    + r"""{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
)
CHAT_TEMPLATES = {
    "chatml": CHAT_TEMPLATE,
    "tools": TOOL_CHAT_TEMPLATE,
    "compact_tools": COMPACT_TOOL_CHAT_TEMPLATE,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT_ARCHS = ("qwen2", "llama")
VISION_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
AUDIO_ARCHS = ("qwen2_audio",)
ARCHS = TEXT_ARCHS + VISION_ARCHS + AUDIO_ARCHS

# Qwen2-Audio's audio markers, as its tokenizer names them.
QWEN_AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
# The tiny feature extractor: 16 kHz, 10 ms hop, 16 mel bins, 2 s chunks (200 frames, at most
# 50 audio tokens per audio).
AUDIO_RATE = 16000
AUDIO_MELS = 16
AUDIO_CHUNK_SECONDS = 2

# Qwen2-VL's vision markers, in the order the real tokenizer has them.
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_IMAGE_TOKEN = "<image>"


def _media_chat_template(**media: str) -> str:
    """ChatML whose content may be a string or a list of HF content parts; a part whose type is a
    keyword (``image``, ``video``, ``audio``) renders as that keyword's markup (the processor
    expands it per image, video or audio), a ``text`` part as its text."""
    parts = {**media, "text": "{{ part['text'] }}"}
    cases = "{% el".join(
        f"if part['type'] == '{kind}' %}}{markup}" for kind, markup in parts.items()
    )
    return (
        "{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}{% " + cases + "{% endif %}"
        "{% endfor %}{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def char_tokenizer(extra_special: list[str] | tuple[str, ...] = ()):
    """A fast character-level tokenizer with ChatML special tokens (plus ``extra_special``)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + list(extra_special)
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    # BPE without merges splits text into single characters; Fuse joins them back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(
    vocab_size: int,
    *,
    arch: str = "qwen2",
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    **sizes: Any,
):
    """A tiny text model's HF config (``sizes``: ``layers``, ``hidden``, ``heads``,
    ``kv_heads``, ``intermediate``, ``max_positions``, ``tie_embeddings``, as
    :func:`make_tiny_model` takes them)."""
    from transformers import AutoConfig

    if arch not in TEXT_ARCHS:
        raise ValueError(f"arch must be one of {TEXT_ARCHS}, got {arch!r}")
    return AutoConfig.for_model(
        arch, **_text_config(vocab_size, eos_token_id, pad_token_id, **sizes)
    )


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 1024,
    tie_embeddings: bool = False,
    chat_template: str = "chatml",
    seed: int = 0,
) -> Path:
    """Write a random-init causal LM plus tokenizer to ``out_dir`` and return the path.

    The vocabulary is padded to a multiple of 16, as real checkpoints do, so the embedding has a
    few rows that no token maps to. A vision-language ``arch`` (:data:`VISION_ARCHS`) writes an
    image-text-to-text model with a small vision tower and its processor instead.
    ``chat_template`` names a text model's template (:data:`CHAT_TEMPLATES`): ``"chatml"``,
    ``"tools"`` (Qwen2.5's tool behaviour) or ``"compact_tools"`` (the tools named only).
    """
    sizes = {
        k: v for k, v in locals().items() if k not in ("out_dir", "arch", "chat_template", "seed")
    }
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMultimodalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(
            f"chat_template must be one of {list(CHAT_TEMPLATES)}, got {chat_template!r}"
        )
    if chat_template != "chatml" and arch not in TEXT_ARCHS:
        raise ValueError(
            f"chat_template={chat_template!r} is for text archs {TEXT_ARCHS}, not {arch!r}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if arch in TEXT_ARCHS:
        tok = char_tokenizer()
        tok.chat_template = CHAT_TEMPLATES[chat_template]
        cfg = AutoConfig.for_model(arch, **_tok_text_config(tok, **sizes))
        return _save_random(AutoModelForCausalLM, cfg, tok, tok, seed, out)
    if arch == "llava":
        cfg, proc = _tiny_llava(**sizes)
    elif arch in AUDIO_ARCHS:
        cfg, proc = _tiny_qwen_audio(**sizes)
    else:
        cfg, proc = _tiny_qwen_vl(arch, **sizes)
    return _save_random(AutoModelForMultimodalLM, cfg, proc.tokenizer, proc, seed, out)


def _save_random(auto, cfg, tok, saver, seed: int, out: Path) -> Path:
    """Random-init ``auto.from_config(cfg)`` with ``seed`` (global RNG untouched), saved to
    ``out`` with ``saver`` (the tokenizer, or the processor holding it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    saver.save_pretrained(out)
    # Recorded so that loaders use tokenizer.json as written instead of the tokenizer class that
    # transformers associates with the model type (Qwen2's byte-level BPE would re-split text).
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    return out


# Tiny images: 14-pixel patches (Qwen3-VL: 16) merged 2x2, so a 56x56 image is 16 patches and
# 4 LLM tokens; at most 16 merged tokens per image.
_PATCH = 14


def _text_config(
    vocab_size: int,
    eos_token_id: int | None,
    pad_token_id: int | None,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 1024,
    tie_embeddings: bool = False,
) -> dict[str, Any]:
    """The text model of a tiny model's HF config."""
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate or 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def _tok_text_config(tok, **sizes: Any) -> dict[str, Any]:
    """The text model of a tiny model whose vocabulary and special ids are those of ``tok``: its
    vocabulary size is ``tok``'s length rounded up to a multiple of 16."""
    return _text_config(-(-len(tok) // 16) * 16, tok.eos_token_id, tok.pad_token_id, **sizes)


def _tiny_llava(**sizes: Any):
    """A tiny LLaVA's HF config, its image token id that of its tokenizer, and its processor: PIL
    image processor, tokenizer and chat template."""
    from transformers import AutoConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = char_tokenizer([LLAVA_IMAGE_TOKEN])
    size, vision_width = 2 * _PATCH, 32
    proc = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        ),
        tokenizer=tok,
        patch_size=_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=_media_chat_template(image=LLAVA_IMAGE_TOKEN),
    )
    cfg = AutoConfig.for_model(
        "llava",
        text_config=_tok_text_config(tok, **sizes),
        vision_config={
            "hidden_size": vision_width,
            "intermediate_size": 2 * vision_width,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": size,
            "patch_size": _PATCH,
            "projection_dim": vision_width,
        },
        image_token_id=tok.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=4,
        tie_word_embeddings=sizes["tie_embeddings"],
    )
    return cfg, proc


def _tiny_qwen_vl(arch: str, **sizes: Any):
    """A tiny Qwen-VL's HF config, its special ids those of its tokenizer, and its processor:
    PIL image processor, tokenizer and chat template."""
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from lightrft.models.multimodal import processor_classes

    tok = char_tokenizer(QWEN_VISION_TOKENS)
    patch = 16 if arch == "qwen3_vl" else _PATCH
    merged = 2 * patch  # pixels per side of one LLM token
    proc = processor_classes()[arch](
        image_processor=Qwen2VLImageProcessorPil(
            min_pixels=merged * merged, max_pixels=merged * merged * 16, patch_size=patch
        ),
        tokenizer=tok,
        chat_template=_media_chat_template(
            image="<|vision_start|><|image_pad|><|vision_end|>",
            video="<|vision_start|><|video_pad|><|vision_end|>",
        ),
    )
    hidden, vision_width = sizes["hidden"], 32
    head_dim = hidden // sizes["heads"]
    text = _tok_text_config(tok, **sizes)
    # M-RoPE splits the rotary half-dimension over (time, height, width): the sections must sum
    # to head_dim / 2, else the model's cos/sin do not match q and k.
    half = head_dim // 2
    text["rope_parameters"]["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    vision = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": patch,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    # The merger projects vision features to the text width: its output size must equal hidden.
    if arch == "qwen2_vl":
        vision.update(embed_dim=vision_width, hidden_size=hidden, mlp_ratio=2)
    else:
        vision.update(
            hidden_size=vision_width, out_hidden_size=hidden, intermediate_size=2 * vision_width
        )
    if arch == "qwen3_vl":
        text["head_dim"] = head_dim
        text["rope_parameters"]["mrope_interleaved"] = True
        # A 4x4 grid of learned position embeddings (interpolated to each image's grid), and
        # deepstack features taken after both blocks.
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    elif arch == "qwen2_5_vl":
        vision.update(window_size=2 * 2 * _PATCH, fullatt_block_indexes=[1])
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ids = dict(zip(names, tok.convert_tokens_to_ids(QWEN_VISION_TOKENS), strict=True))
    cfg = AutoConfig.for_model(
        arch,
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=sizes["tie_embeddings"],
        **ids,
    )
    return cfg, proc


def _tiny_qwen_audio(**sizes: Any):
    """A tiny Qwen2-Audio's HF config, its audio token id that of its tokenizer, and its processor
    over a small ``WhisperFeatureExtractor`` and the tokenizer."""
    from transformers import AutoConfig, Qwen2AudioProcessor, WhisperFeatureExtractor

    tok = char_tokenizer(QWEN_AUDIO_TOKENS)
    fe = WhisperFeatureExtractor(
        feature_size=AUDIO_MELS,
        sampling_rate=AUDIO_RATE,
        hop_length=AUDIO_RATE // 100,
        chunk_length=AUDIO_CHUNK_SECONDS,
        n_fft=400,
    )
    proc = Qwen2AudioProcessor(
        feature_extractor=fe,
        tokenizer=tok,
        chat_template=_media_chat_template(audio="".join(QWEN_AUDIO_TOKENS)),
    )
    width = 32
    frames = AUDIO_CHUNK_SECONDS * 100  # mel frames per chunk (10 ms hop)
    audio = {
        "num_mel_bins": AUDIO_MELS,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 2 * width,
        "d_model": width,
        # The encoder's stride-2 convolution halves the frames; it checks that length exactly.
        "max_source_positions": frames // 2,
    }
    cfg = AutoConfig.for_model(
        "qwen2_audio",
        text_config=_tok_text_config(tok, **sizes),
        audio_config=audio,
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
        tie_word_embeddings=sizes["tie_embeddings"],
    )
    return cfg, proc


def ensure_tiny_model(out_dir: str | Path, **settings: Any) -> Path:
    """:func:`make_tiny_model` unless ``out_dir`` already holds a tiny model made with these
    settings (recorded in ``lightrft_tiny.json``). Configs call it in ``prepare:`` so that a demo
    runs as it is on a fresh checkout and a rerun or a resume reuses the same model."""
    out = Path(out_dir)
    record = out / "lightrft_tiny.json"
    try:
        made = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        made = None
    if made == settings and (out / "config.json").is_file():
        return out
    make_tiny_model(out, **settings)
    record.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return out
