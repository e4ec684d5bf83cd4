"""The rules of a recipe's ``environment:`` section that need the model: one function, so the
recipes that take the section (GRPO, eval) refuse the same inputs with the same messages.

Unknown keys, a tool that cannot be imported and ``max_turns < 1`` are the component checker's
(:mod:`lightrft.config`), which every recipe's schema runs on the section.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightrft.environments.render import require_tool_support
from lightrft.models.multimodal import checkpoint_is_multimodal


def check_environment(
    environment: Mapping[str, Any] | None, model_path: str, *, trust_remote_code: bool = False
) -> None:
    """Refuse an ``environment:`` section the model at ``model_path`` cannot play: a vision- or
    audio-language model (multi-turn rollouts take text models), and, when ``tools`` are
    configured, a chat template without tool support or with a tool-call format this library
    does not parse. Each ``ValueError`` names the key.

    Read from the checkpoint's ``config.json`` and tokenizer, before any model loads; a path
    without a local ``config.json`` yet (a hub id, or one a ``prepare`` step writes) is not
    checked, so recipes call this again in setup, once ``prepare`` has run."""
    if environment is None or not (Path(model_path) / "config.json").exists():
        return
    if checkpoint_is_multimodal(model_path):
        raise ValueError(
            f"environment: multi-turn rollouts take a text model; {model_path} is "
            "vision- or audio-language"
        )
    if environment.get("tools"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        try:
            require_tool_support(tok)
        except ValueError as e:
            raise ValueError(f"environment.tools: {e}") from None
