"""Tiny, randomly initialised Hugging Face models with a real tokenizer.

Tests and demos need a model that loads through exactly the same code path as a real checkpoint
(``from_pretrained`` on a directory holding ``config.json``, ``model.safetensors`` and the tokenizer
files) without a model hub. :func:`make_tiny_model` writes such a directory.

The tokenizer is character level: every printable ASCII character plus newline is one token, and
the chat markers are special tokens, so a chat template renders like Qwen's ChatML.
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
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ARCHS = ("qwen2", "llama")


def char_tokenizer():
    """A fast character-level tokenizer with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    # BPE without merges splits text into single characters; Fuse joins them back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
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
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 1024,
    tie_embeddings: bool = False,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.02,
        use_cache=True,
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
    seed: int = 0,
) -> Path:
    """Write a random-init causal LM plus tokenizer to ``out_dir`` and return the path.

    The vocabulary is padded to a multiple of 16, as real checkpoints do, so the embedding has a
    few rows that no token maps to.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer()
    vocab_size = -(-len(tok) // 16) * 16
    cfg = tiny_config(
        vocab_size,
        arch=arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        max_positions=max_positions,
        tie_embeddings=tie_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # Recorded so that loaders use tokenizer.json as written instead of the tokenizer class that
    # transformers associates with the model type (Qwen2's byte-level BPE would re-split text).
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    return out


_SETTINGS_FILE = "lightrft_tiny.json"


def ensure_tiny_model(out_dir: str | Path, **settings: Any) -> Path:
    """:func:`make_tiny_model` unless ``out_dir`` already holds a tiny model made with these
    settings (recorded in ``lightrft_tiny.json``). Configs call it in ``prepare:`` so that a demo
    runs as it is on a fresh checkout and a rerun or a resume reuses the same model."""
    out = Path(out_dir)
    record = out / _SETTINGS_FILE
    try:
        made = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        made = None
    if made == settings and (out / "config.json").is_file():
        return out
    make_tiny_model(out, **settings)
    record.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return out
