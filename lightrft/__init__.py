"""LightRFT: torch-native, minimal reinforcement fine-tuning for language models."""

import logging as _logging

__version__ = "0.1.0"


def _drop_torchao_import_notices(record: _logging.LogRecord) -> bool:
    # PEFT imports torchao (LoRA runs), whose optional C++ / CUDA kernels are built for other
    # torch versions or GPUs, and whose enums trip a torch deprecation notice aimed at torchao's
    # own register_constant() calls. LightRFT never calls those kernels, so these notices, printed
    # on every LoRA command, are noise. Only these messages are dropped: every other torchao or
    # torch warning still shows.
    msg = record.getMessage()
    if record.name == "torchao":
        return not (
            msg.startswith("Skipping import of cpp extensions")
            or (msg.startswith("Failed to load") and "/torchao/" in msg)
        )
    return not (
        "is an Enum subclass and is now natively supported" in msg and "register_constant" in msg
    )


_logging.getLogger("torchao").addFilter(_drop_torchao_import_notices)
_logging.getLogger("torch.utils._pytree").addFilter(_drop_torchao_import_notices)


def _map_source_checkout() -> None:
    """From a source checkout (``PYTHONPATH=<checkout>``, or a git worktree beside an editable
    install of another one), import ``lightrft.recipes`` / ``.configs`` from the checkout's
    top-level folders, as the wheel and ``pip install -e`` map them (pyproject ``package-dir``);
    without this they would come from whichever tree was installed.

    Both folders are namespace packages (no ``__init__.py``): a regular package in the repository
    root would shadow an installed distribution of the same name (torchtune ships a top-level
    ``recipes``) for any Python started there, and ``lightrft`` is the root's only package."""
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        return  # an installed wheel: its package-dir mapping is already in place
    for name in ("recipes", "configs"):
        if (root / name).is_dir():
            spec = importlib.machinery.ModuleSpec(f"{__name__}.{name}", None, is_package=True)
            spec.submodule_search_locations = [str(root / name)]
            globals()[name] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)


_map_source_checkout()
