"""Load HF causal LMs and tokenizers from a local directory or a hub id; the auto class of a
multimodal checkpoint; finding a module list inside a model."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.config import ConfigError
from lightrft.sections import looks_local

_GENERIC_TOKENIZERS = {"PreTrainedTokenizerFast", "TokenizersBackend"}
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def check_local(path: str | Path) -> None:
    """Raise a ``ValueError`` when ``path`` looks like a local path (not a hub id) but does not
    exist."""
    # A string that looks like a path (absolute, ./, ../, or more parts than a hub id's
    # "namespace/name") but does not exist is a user error, not a hub id: say so instead of
    # letting the hub client time out or reject the id.
    if looks_local(str(path)) and not Path(path).exists():
        raise ValueError(f"model path {str(path)!r} does not exist")


# what the library itself passes to every render: a template argument may not set them
_RENDER_ARGS = {"messages", "conversation", "tools", "documents", "tokenize",
                "add_generation_prompt", "continue_final_message", "chat_template"}  # fmt: skip


def bind_template_args(tokenizer, args: Mapping[str, Any] | None, *, key: str):
    """Make every chat-template render of ``tokenizer`` pass ``args`` (the template's own
    variables, e.g. Qwen3's ``enable_thinking: false``): prompts, SFT chats, preference pairs
    and multi-turn observations all render through ``tokenizer.apply_chat_template``, so they
    agree. The saved tokenizer is untouched (an export keeps the stock template).

    Raises:
        ConfigError: naming ``key.<name>``, for a name the library sets itself, or one the
            template never reads (it would do nothing).
    """
    if not args:
        return tokenizer
    template = tokenizer.chat_template or ""
    text = " ".join(template.values()) if isinstance(template, dict) else template
    for name in args:
        if name in _RENDER_ARGS:
            raise ConfigError(f"{key}.{name}: the library sets {name!r} on every render itself")
        if not re.search(rf"\b{re.escape(str(name))}\b", text):
            raise ConfigError(
                f"{key}.{name}: the chat template of {tokenizer.name_or_path!r} never reads "
                f"{name!r}, so it would do nothing"
            )
    tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **args)
    return tokenizer


def load_tokenizer(
    path: str | Path,
    *,
    trust_remote_code: bool = False,
    template_args: Mapping[str, Any] | None = None,
):
    """The tokenizer (with its chat template) of a local HF directory or hub id;
    ``template_args``: see :func:`bind_template_args` (``model.chat_template_args``).

    A directory whose ``tokenizer_config.json`` names the generic fast tokenizer is loaded as
    exactly that, so its ``tokenizer.json`` is used as written.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    check_local(path)
    cfg_file = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    if cfg.get("tokenizer_class") in _GENERIC_TOKENIZERS:
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return bind_template_args(tok, template_args, key="model.chat_template_args")


def from_pretrained_dir(
    auto,
    path: str | Path,
    *,
    dtype: str | torch.dtype,
    device: str | torch.device,
    trust_remote_code: bool,
    attn_implementation: str | None,
):
    """``auto.from_pretrained(path)`` in ``dtype`` on ``device``; a bad local path fails first."""
    check_local(path)
    kwargs = {"dtype": to_dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return auto.from_pretrained(path, **kwargs).to(device)


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
):
    """A ``transformers`` causal LM from a local directory or hub id, in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    return from_pretrained_dir(
        AutoModelForCausalLM,
        path,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
):
    """A causal LM, or an ``AutoModelForImageTextToText`` model when the checkpoint's config has
    a ``vision_config`` (a vision-language model), or an ``AutoModelForMultimodalLM`` one when it
    has an ``audio_config`` (Qwen2-Audio): one call for recipes."""
    from transformers import AutoConfig

    check_local(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return from_pretrained_dir(
        model_auto_class(config),
        path,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )


def model_auto_class(config):
    """The auto class :func:`load_model` loads a checkpoint of ``config`` with:
    ``AutoModelForCausalLM`` for a text model; for a multimodal one ``AutoModelForMultimodalLM``
    when it is audio-language (Qwen2-Audio is not an image-text model), else
    ``AutoModelForImageTextToText``."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForMultimodalLM,
    )

    from lightrft.models.modality import is_audio_language, is_multimodal

    if not is_multimodal(config):
        return AutoModelForCausalLM
    return AutoModelForMultimodalLM if is_audio_language(config) else AutoModelForImageTextToText


def head_dim(config) -> int:
    """The attention head size of an HF (text) config."""
    text = config.get_text_config()
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def find_module_list(root: nn.Module, paths: tuple[str, ...]) -> nn.ModuleList | None:
    """The first ``nn.ModuleList`` found at one of the dotted ``paths`` under ``root``."""
    for path in paths:
        mod = functools.reduce(lambda m, part: getattr(m, part, None), path.split("."), root)
        if isinstance(mod, nn.ModuleList):
            return mod
    return None
