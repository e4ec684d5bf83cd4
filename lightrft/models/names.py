"""The one normaliser of parameter names: from a wrapped model's names to the HF model's own.

Activation checkpointing, ``torch.compile`` and FSDP1 insert wrapper parts into names; PEFT adds
its own prefix, ``base_layer`` and the ``modules_to_save`` / ``original_module`` copies. Every
place that maps names (HF export, weight sync, sharded loading, DeepSpeed) uses these functions.
"""

from __future__ import annotations

import re

# Inserted by checkpoint_wrapper, torch.compile (module-level compile) and FSDP1.
_WRAPPER_PARTS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")
PEFT_PREFIX = "base_model.model."
# Names that PEFT inserts between the HF model's own names: a LoRA layer's ``base_layer`` and the
# ``modules_to_save`` copy of a trained module (the trained copy replaces the original module).
_PEFT_PARTS = re.compile(r"\.(base_layer|modules_to_save\.[^.]+)(?=\.)")


def strip_wrappers(name: str) -> str:
    """A parameter's name without the wrapper parts (PEFT's names are kept):
    ``model.layers.0._checkpoint_wrapped_module.mlp...`` -> ``model.layers.0.mlp...``."""
    return _WRAPPER_PARTS.sub("", name)


def hf_name(name: str) -> str:
    """The HF checkpoint name of a parameter of a wrapped model.

    >>> hf_name("base_model.model.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.base_layer.weight")
    'model.layers.0.mlp.up_proj.weight'
    """
    return _PEFT_PARTS.sub("", strip_wrappers(name).removeprefix(PEFT_PREFIX))


def hf_checkpoint_name(name: str) -> str:
    """The HF model's own name of a parameter of a wrapped (checkpointed, compiled, PEFT) model,
    for reading its tensor from a checkpoint (PEFT's ``original_module`` copy included)."""
    return hf_name(name.replace(".original_module.", "."))
