"""Activation checkpointing -> torch.compile per block -> FSDP2, in that order (as torchtitan)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightrft.distributed import collective_timeout
from lightrft.models.forward import unwrap_peft
from lightrft.models.loading import find_module_list
from lightrft.models.multimodal import media_blocks
from lightrft.models.vocab_parallel import shard_vocab_tables
from lightrft.sections import mesh_shape


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of an HF causal LM (``model.model.layers`` and kin), also
    inside a PEFT wrapper."""
    model = unwrap_peft(model)
    layers = find_module_list(
        model,
        (
            "model.layers",
            "model.language_model.layers",
            "transformer.h",
            "gpt_neox.layers",
            "model.decoder.layers",
            "layers",
        ),
    )
    if layers is not None:
        return layers
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}; "
        "pass a model with a `model.layers` ModuleList"
    )


def _untied_embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The model's input embedding and LM head, each when it is a module with a weight of its
    own (both ``None`` where the head shares the embedding's weight)."""

    def own(getter: str) -> nn.Module | None:
        module = getattr(model, getter, lambda: None)()
        return module if isinstance(getattr(module, "weight", None), nn.Parameter) else None

    emb, head = own("get_input_embeddings"), own("get_output_embeddings")
    if emb is not None and head is not None and emb.weight is head.weight:
        return None, None
    return emb, head


def default_param_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 compute on accelerators, fp32 on CPU (CPU bf16 matmuls are slow and imprecise)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def parallelize(
    model: nn.Module,
    *,
    mesh=None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
    shard: bool | None = None,
    offload: bool = False,
    scoring: bool = False,
) -> nn.Module:
    """Prepare ``model`` for training in place and return it.

    1. activation checkpointing wraps each decoder block (recompute in backward);
    2. ``torch.compile`` compiles each block in place (names keep no ``_orig_mod.`` prefix);
    3. FSDP2 ``fully_shard`` shards each block, then the root, with a ``MixedPrecisionPolicy``;
       a vision- or audio-language model's tower blocks are sharded each as well, and so are an
       untied input embedding and, in a model without trainable parameters (freeze it in
       ``prepare``), an untied LM head: each is then gathered only while it runs.

    ``shard=None`` shards over a process group of two ranks or more (one rank: only for
    ``offload`` or ``scoring``); a single process keeps ordinary tensors, so the same recipe
    runs unchanged on a laptop.

    ``offload``: FSDP2's ``CPUOffloadPolicy`` on every group: the sharded parameters (and so
    their gradients and the optimizer state) live in CPU memory, copied to the mesh's device
    for each all-gather; pinned when that device is a GPU. Needs sharding.

    ``scoring``: a frozen, meta-built model that only scores (a reward model over the ranks) is
    laid out for the least memory per rank: it keeps only its rows of the input embedding and LM
    head, outside FSDP2's groups, and runs them vocabulary-parallel
    (:mod:`lightrft.models.vocab_parallel`), so no rank gathers a vocabulary-sized table; and
    each linear layer of its decoder blocks is an FSDP2 unit of its own, so a rank gathers one
    weight matrix at a time (more, smaller all-gathers; it has no backward to overlap). Needs
    sharding over a 1-D ``mesh``.
    """
    layers = decoder_layers(model)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    if compile:
        for layer in layers:
            layer.compile(dynamic=True)
    if shard is None:
        shard = default_sharding(offload=offload, scoring=scoring)
    if not shard:
        if scoring:
            raise ValueError("scoring lays a model out over the ranks: it needs sharding")
        if offload:
            raise ValueError(
                "offload=params needs FSDP2 sharding, which needs a process group: launch with "
                "torchrun (lightrft run --nproc_per_node 1 ... on one device)"
            )
        return model

    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh is None:
        # FSDP2's default mesh is on CUDA whenever CUDA exists: a CPU model (device=cpu, or the
        # gloo tests) on a GPU machine would be moved there. Shard where the model lives.
        dev = next((p.device for p in model.parameters() if not p.is_meta), None)
        if dev is not None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    if param_dtype is None:
        param_dtype = default_param_dtype(next(model.parameters()).device)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    policy = OffloadPolicy()
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        # Pinned host memory lets the copies to and from a GPU overlap compute; on a CPU mesh
        # the "offload" is to the same memory, and pinning needs an accelerator.
        on = (
            mesh.device_type if mesh is not None else "cuda" if torch.cuda.is_available() else "cpu"
        )
        policy = CPUOffloadPolicy(pin_memory=on != "cpu")
    shard_kw = dict(mesh=mesh, mp_policy=mp, offload_policy=policy)
    # A vision- or audio-language model's tower blocks are sharded one by one too (trained or
    # frozen: a frozen tower costs no gradients but its weights are as large). The tower runs
    # before the decoder, so its blocks are gathered and resharded like the decoder's.
    for block in media_blocks(model):
        fully_shard(block, **shard_kw, reshard_after_forward=True)
    # Scoring: the embedding and LM head keep their rows on each rank, out of FSDP2's groups,
    # and are never gathered (vocabulary-parallel).
    ignored = shard_vocab_tables(model, mesh) if scoring else set()
    # The input embedding is its own group unless the LM head shares its weight: gathered at
    # the start of forward and resharded at once, instead of held (and all-gathered) together
    # with the root's LM head for the whole forward.
    embedding, head = (None, None) if scoring else _untied_embeddings(model)
    if embedding is not None:
        fully_shard(embedding, **shard_kw, reshard_after_forward=True)
    frozen = not any(p.requires_grad for p in model.parameters())  # a reference policy
    for i, layer in enumerate(layers):
        # A trained model's last block is gathered again right away by the root's backward:
        # keep it unsharded. A frozen model has no backward.
        keep = i == len(layers) - 1 and not frozen
        # Scoring: each linear layer is a unit, the block keeps the rest (its norms).
        for linear in [m for m in layer.modules() if isinstance(m, nn.Linear)] if scoring else []:
            fully_shard(linear, **shard_kw, reshard_after_forward=True)
        fully_shard(layer, **shard_kw, reshard_after_forward=not keep)
    # A frozen model gathers its untied LM head only for the head's own forward instead of
    # holding it with the root for the whole forward. A trained head stays in the root: the
    # fused log-prob kernel's backward reads its weight after the forward.
    if head is not None and frozen:
        fully_shard(head, **shard_kw, reshard_after_forward=True)
    fully_shard(model, **shard_kw, reshard_after_forward=True, ignored_params=ignored or None)
    return model


def default_sharding(*, offload: bool = False, scoring: bool = False) -> bool:
    """Whether a model is sharded when its loader is not told (``shard=None``): over a process
    group of two ranks or more. A one-rank group (an asynchronous run's lone trainer,
    ``--nproc_per_node 1``) would gain nothing from FSDP2 but its hooks' parameter and gradient
    copies, 11% of that trainer's step on the CPU demo, so it stays plain unless ``offload``
    or ``scoring`` needs FSDP2's layout; without a group nothing is sharded."""
    return dist.is_initialized() and (dist.get_world_size() > 1 or offload or scoring)


def build_mesh(shard_size: int | None, replicate_size: int | None, device: torch.device | str):
    """The device mesh ``parallelize`` shards over: 1-D ``("shard",)`` for plain FSDP, 2-D
    ``("replicate", "shard")`` for HSDP; ``None`` without a process group (one plain process,
    where the sizes must be 1)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    replicate, shard = mesh_shape(shard_size, replicate_size, world)
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    device_type = torch.device(device).type
    if replicate == 1:  # the default group itself (with its timeout)
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
    # HSDP's sub-groups get the default group's collective_timeout_s: torch makes them with its
    # own default (30 min on gloo) otherwise, and a peer that died in a gradient all-reduce
    # across replicas would hold the others that long.
    names, override, timeout = ("replicate", "shard"), None, collective_timeout()
    if timeout is not None:
        backend, override = dist.get_backend(), {}
        for name in names:
            opts = (
                dist.ProcessGroupNCCL.Options()
                if "nccl" in backend  # "cpu:gloo,cuda:nccl" on CUDA: the gloo half ignores them
                else dist.ProcessGroupGloo._Options()
            )
            opts._timeout = timeout
            override[name] = (backend, opts)
    return init_device_mesh(
        device_type, (replicate, shard), mesh_dim_names=names, backend_override=override
    )
