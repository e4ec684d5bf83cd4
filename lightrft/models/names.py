"""The one normaliser of parameter names: from a wrapped model's names to the HF model's own.

Activation checkpointing, ``torch.compile`` and FSDP1 insert wrapper parts into names; PEFT adds
its own prefix, ``base_layer`` and the ``modules_to_save`` / ``original_module`` copies. Every
place that maps names (HF export, weight sync, sharded loading, DeepSpeed) uses these functions.
"""

from __future__ import annotations

import re

# Inserted by checkpoint_wrapper, torch.compile (module-level compile) and FSDP1.
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
PEFT_PREFIX = "base_model.model."
# Names that PEFT inserts between the HF model's own names (its copies of trained modules).
_PEFT_COPIES = re.compile(r"\.(modules_to_save\.[^.]+|original_module)\.")


def strip_wrappers(name: str) -> str:
    """A parameter's name without the wrapper parts (PEFT's names are kept):
    ``model.layers.0._checkpoint_wrapped_module.mlp...`` -> ``model.layers.0.mlp...``."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def hf_name(name: str) -> str:
    """The HF checkpoint name of a parameter of a wrapped model.

    >>> hf_name("base_model.model.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.base_layer.weight")
    'model.layers.0.mlp.up_proj.weight'
    """
    name = strip_wrappers(name).removeprefix(PEFT_PREFIX)
    name = name.replace(".base_layer.", ".")
    # PEFT `modules_to_save`: the trained copy replaces the original module.
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def hf_checkpoint_name(name: str) -> str:
    """The HF model's own name of a parameter of a wrapped (checkpointed, compiled, PEFT) model,
    for reading its tensor from a checkpoint (PEFT's ``original_module`` copy included)."""
    return hf_name(_PEFT_COPIES.sub(".", name))
