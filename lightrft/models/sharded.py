"""Loading that scales: no rank ever holds a full copy of a model it shards.

Under a process group :func:`load_parallel` builds the model with its parameters on the meta
device (buffers stay real: rotary ``inv_freq`` and other non-persistent buffers are computed by
the modules' own ``__init__``), applies the caller's ``prepare`` (LoRA, a value head, a frozen
vision tower), shards it with :func:`~lightrft.models.parallel.parallelize` and only then gives
each parameter storage: its local shard, read straight from the safetensors with lazy slicing
(``safe_open(...).get_slice``), so a rank reads and holds only its rows. In one plain process it
is ``load_model`` -> ``prepare`` -> ``parallelize`` as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.models.loading import check_local, load_model, model_auto_class, to_dtype
from lightrft.models.lora import initial_adapter_value
from lightrft.models.names import hf_checkpoint_name
from lightrft.models.parallel import default_param_dtype, default_sharding, parallelize

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class SafetensorsIndex:
    """Which ``*.safetensors`` file of a checkpoint directory holds each tensor name."""

    root: Path
    files: dict[str, str]  # tensor name -> file name

    @classmethod
    def read(cls, path: str | Path) -> SafetensorsIndex:
        root = Path(path)
        index = root / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
            return cls(root, dict(weight_map))
        single = root / _SINGLE
        if not single.is_file():
            raise ValueError(
                f"model path {str(path)!r} has neither {_SINGLE} nor {_INDEX}: sharded loading "
                "reads safetensors checkpoints (re-save it with save_pretrained)"
            )
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return cls(root, dict.fromkeys(f.keys(), _SINGLE))


def checkpoint_names(model: nn.Module, keys: list[str]) -> tuple[dict[str, str], set[str]]:
    """Model name -> checkpoint name for the checkpoint's ``keys``, renamed as ``transformers``
    renames them on load (legacy layouts, e.g. Qwen2.5-VL's ``model.layers`` ->
    ``model.language_model.layers``); and the model names whose tensors ``transformers`` would
    merge or split from several checkpoint tensors (not loadable shard by shard)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without these helpers: names are used as written
        return {k: k for k in keys}, set()
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    own = model.state_dict()  # meta tensors: no memory
    prefix = getattr(model, "base_model_prefix", None)
    names: dict[str, str] = {}
    converted: set[str] = set()
    for key in keys:
        try:
            new, converter = rename_source_key(key, renamings, converters, prefix, own)
        except TypeError:  # another signature (transformers internals): names as written
            new, converter = key, None
        if converter is not None:
            converted.add(new)
        else:
            names.setdefault(new, key)
    # As from_pretrained does: remember the renamings this checkpoint used, so that
    # save_pretrained (the recipes' export) writes the checkpoint's own layout back.
    model._weight_conversions = [t for t in transforms if getattr(t, "was_used", lambda: False)()]
    return names, converted


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lives on the meta device; buffers do not.

    (``with torch.device("meta")`` would put buffers there too, and a non-persistent buffer such
    as rotary ``inv_freq`` is in no checkpoint: it would stay garbage after materialisation.)
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(
                param.detach().to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_on_meta(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    auto_class=None,
    **config_overrides: Any,
) -> nn.Module:
    """The model class ``load_model`` would load from ``path`` (or ``auto_class``, e.g.
    ``AutoModelForSequenceClassification`` with ``num_labels=...`` in ``config_overrides``), its
    parameters on the meta device, in eval mode (as ``from_pretrained`` returns it), with the
    checkpoint's generation config."""
    from transformers import AutoConfig, GenerationConfig

    check_local(path)
    config = AutoConfig.from_pretrained(
        path, trust_remote_code=trust_remote_code, **config_overrides
    )
    kwargs = {"dtype": to_dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with params_on_meta():
        model = (auto_class or model_auto_class(config)).from_config(config, **kwargs)
    if Path(path, "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's shard of ``t`` and the slice of the full tensor it holds (``t`` itself, all of
    it, when plain)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t._local_tensor, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def fill_from_safetensors(
    model: nn.Module,
    path: str | Path,
    *,
    names: dict[str, str],
    converted: set[str] = frozenset(),  # type: ignore[assignment]
    device: str | torch.device = "cpu",
) -> list[str]:
    """Give every meta parameter / buffer of ``model`` its local shard, read from the
    safetensors under ``path`` (``names``: HF model name -> checkpoint name); new LoRA adapters
    are initialised instead. Returns the names that were initialised rather than read."""
    from safetensors import safe_open

    device = torch.device(device)
    index = SafetensorsIndex.read(path)
    initialised = []
    # Every meta tensor once (a tied weight under its first name), parameters in module order
    # (the order adapters draw their initial values in), then buffers.
    meta = [(n, t, "param") for n, t in model.named_parameters() if t.is_meta]
    meta += [(n, t, "buffer") for n, t in model.named_buffers() if t.is_meta]
    with torch.no_grad():
        for full, t, kind in meta:
            owner, _, attr = full.rpartition(".")
            module = model.get_submodule(owner)
            own = hf_checkpoint_name(full)
            if own in converted:
                raise ValueError(
                    f"{path}: tensor {own!r} is stored in a layout transformers converts on "
                    "load (merged or split weights); sharded loading reads tensors as named. "
                    "Re-save the checkpoint with save_pretrained, or train in one process"
                )
            key = names.get(own)
            # Uninitialised storage on ``device`` (its shard's size for a DTensor), keeping the
            # Python object (FSDP2 and tied weights hold on to it).
            if kind == "buffer":
                t = module._buffers[attr] = torch.empty_like(t, device=device)
            else:
                new = nn.Parameter(
                    torch.empty_like(t, device=device), requires_grad=t.requires_grad
                )
                torch.utils.swap_tensors(t, new)
            local, region = _local_region(t)
            if key is not None and key in index.files:
                file = index.root / index.files[key]
                # One mapping per tensor: the file pages a rank touches count in its RSS until
                # the file is closed, so a whole-file mapping would add the rank's slice of
                # every tensor on top of the shards it fills.
                with safe_open(str(file), framework="pt") as f:
                    stored = f.get_slice(key)
                    full_shape = tuple(stored.get_shape())
                    if full_shape != tuple(t.shape):
                        raise ValueError(
                            f"{file}: tensor {key!r} has shape {list(full_shape)} but the model "
                            f"expects {list(t.shape)} (does config.json match the weights?)"
                        )
                    value = stored[region] if region else f.get_tensor(key)
                    local.copy_(value.to(local.dtype))
                continue
            if kind == "buffer":
                raise ValueError(
                    f"buffer {full!r} of {type(model).__name__} is not in the checkpoint "
                    f"{path}; build it on a real device"
                )
            # A parameter ``prepare`` added, in full on every rank from the same RNG state: a
            # LoRA adapter's, as PEFT initialises it.
            value = initial_adapter_value(full, t.shape, t.dtype)
            if value is None:
                raise ValueError(
                    f"parameter {full!r} is neither in the checkpoint nor one lightrft knows "
                    "how to initialise; create new parameters on a real device in `prepare` "
                    "(not on meta)"
                )
            local.copy_(value[region])
            initialised.append(full)
    return initialised


def prepare_and_parallelize(
    model: nn.Module,
    prepare: Callable[[nn.Module], nn.Module] | None,
    *,
    activation_checkpointing: bool = False,
    compile: bool = False,
    mesh=None,
    device: str | torch.device = "cpu",
    checkpoint: tuple[str | Path, dict[str, str], set[str]] | None = None,
    offload: bool = False,
    param_dtype: torch.dtype | None = None,
    scoring: bool = False,
) -> nn.Module:
    """Apply ``prepare`` (LoRA, a value head) to ``model`` and :func:`parallelize` it: unsharded,
    or, given the ``checkpoint`` ``(path, names, converted)`` of a meta-built model, sharded on
    ``mesh`` with each rank's slices read from it (:func:`fill_from_safetensors`).
    ``offload``: the shards live in CPU memory (:func:`parallelize`). ``param_dtype``: the
    sharded forward's compute dtype (default: :func:`default_param_dtype` of ``device``).
    ``scoring``: sharded, a frozen model that only scores (a reward model over the ranks) keeps
    only its rows of the vocabulary tables and gathers one weight matrix at a time
    (:func:`parallelize`)."""
    model = prepare(model) if prepare is not None else model
    kw = dict(activation_checkpointing=activation_checkpointing, compile=compile, offload=offload)
    if checkpoint is None:
        return parallelize(model, shard=False, **kw)
    # fully_shard moves buffers and real parameters to the mesh's device (offloaded ones to the
    # CPU); meta ones stay meta.
    model = parallelize(
        model,
        mesh=mesh,
        param_dtype=param_dtype or default_param_dtype(device),
        shard=True,
        scoring=scoring,
        **kw,
    )
    path, names, converted = checkpoint
    # FSDP2 refuses offloaded parameters that are not in CPU memory (it pins them itself).
    where = "cpu" if offload else device
    fill_from_safetensors(model, path, names=names, converted=converted, device=where)
    return model


def load_parallel(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    mesh=None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    shard: bool | None = None,
    offload: bool = False,
) -> nn.Module:
    """Load the HF model at ``path``, apply ``prepare`` and :func:`parallelize` it: the one call
    the recipes make for every model they train or hold (actor, reference, critic).

    ``prepare(model) -> model`` runs before sharding (LoRA, a value head, freezing a tower).
    Sharded (``shard=True``, or ``shard=None`` under :func:`default_sharding`) the
    parameters are never materialised in full: each rank reads only its shards (module
    docstring). Parameters that ``prepare`` creates on a real device are sharded from that
    value; LoRA adapters it creates on meta (PEFT follows the base layer's device) are
    initialised as PEFT initialises them.
    """
    opts = dict(
        device=device,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        offload=offload,
    )
    load = dict(
        dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    if shard is None:
        shard = default_sharding(offload=offload)
    if not shard:
        return prepare_and_parallelize(load_model(path, device=device, **load), prepare, **opts)
    model = build_on_meta(path, **load)
    names, converted = checkpoint_names(model, list(SafetensorsIndex.read(path).files))
    return prepare_and_parallelize(
        model, prepare, mesh=mesh, checkpoint=(path, names, converted), **opts
    )
