"""Stream a (possibly FSDP2-sharded, checkpoint-wrapped, compiled, LoRA-adapted) model's weights
into a rollout engine under Hugging Face parameter names.

Every rank walks the parameters in the same (registration) order, so the all-gathers that
materialise full tensors line up across ranks. Names lose the wrapper prefixes that activation
checkpointing, ``torch.compile`` and PEFT add; LoRA adapters are merged into their base weights
(``W + scaling * B @ A``, Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685). Tensors are cast to the engine's dtype and handed over in buckets of about
``bucket_bytes``, so at most one bucket of full tensors is alive at a time.

FSDP2 parameters of a bucket travel in one all-gather (rather than one ``DTensor.full_tensor()``
collective per parameter, whose per-call latency dominated on gloo): local shards are packed into
one buffer, gathered, and regrouped into full tensors with one copy each way.

An engine that exposes its weights (``weight_buffers(names)`` and ``weights_version``, as
:class:`~lightrft.engine.NativeEngine` does) gets them written in place: the gathered buffer is
regrouped straight into the engine's tensors, so a sync costs the pack copy, the all-gather and
one copy, with the per-parameter plan (names, shapes, buckets, destination views) built once and
cached until the model's parameters or the engine's storage change.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightrft.config import at_least
from lightrft.distributed import comm_device, full_tensor
from lightrft.models.lora import (
    LoraFactors,
    is_adapter_param,
    is_lora_matrix,
    is_original_copy,
    merged_adapters,
)
from lightrft.models.names import hf_name


@dataclass
class _Item:
    """One weight to send: a parameter, plus the LoRA factors to merge into it."""

    name: str
    param: torch.Tensor
    loras: list[LoraFactors]

    def tensors(self) -> list[torch.Tensor]:
        return [self.param] + [t for lo in self.loras for t in (lo.a, lo.b)]


def plan_weights(model: nn.Module, *, skip_frozen: bool = False) -> list[_Item]:
    """The weights to send, in registration order (identical on every rank).

    ``skip_frozen`` leaves out parameters that do not require grad and carry no LoRA adapter:
    they never change, so an engine that already holds them (built from the same checkpoint,
    no level-2 sleep since) need not receive them again, e.g. a frozen vision tower.
    """
    items = []
    for name, param in model.named_parameters():  # a tied weight once, under its first name
        if is_original_copy(name):
            continue  # PEFT keeps the frozen original next to `modules_to_save`
        if is_lora_matrix(name):
            continue  # merged into its base weight
        if is_adapter_param(name):
            raise ValueError(
                f"sync_weights: adapter parameter {name!r} is not a LoRA A/B matrix of a linear "
                "layer; merge the adapter into the model before syncing"
            )
        loras = merged_adapters(model, name)
        if skip_frozen and not param.requires_grad and not loras:
            continue
        items.append(_Item(hf_name(name), param, loras))
    return items


def _shard0_mesh(t: torch.Tensor):
    """The 1-D mesh of a DTensor sharded on dim 0 (FSDP2's layout), else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or t.ndim == 0:
        return None
    placements = t.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        return None
    return t.device_mesh


@torch.no_grad()
def _merged(item: _Item, full: list[torch.Tensor]) -> torch.Tensor:
    weight = full[0]
    if not item.loras:
        return weight
    out = weight.float()
    for k, lo in enumerate(item.loras):
        a, b = full[1 + 2 * k].float(), full[2 + 2 * k].float()  # [r, in], [out, r]
        delta = (b @ a) * lo.scaling
        out = out + (delta.T if lo.transpose else delta)
    return out.to(weight.dtype)


def _split(items: list[_Item], dtype: torch.dtype | None, bucket_bytes: int) -> list[list[_Item]]:
    """Consecutive items grouped into buckets of at most ``bucket_bytes`` (or one item)."""
    buckets: list[list[_Item]] = []
    size = 0
    for it in items:
        nbytes = it.param.numel() * (dtype or it.param.dtype).itemsize
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(it)
        size += nbytes
    return buckets


def iter_weight_buckets(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 512 * 2**20,
    skip_frozen: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(hf_name, full tensor)`` cast to ``dtype``, about ``bucket_bytes`` each.

    A collective when the model holds DTensors: every rank must drain the iterator. The tensors
    of a bucket may be views into its gather buffer: copy what you keep.
    """
    at_least("bucket_bytes", bucket_bytes, 1)
    for items in _split(plan_weights(model, skip_frozen=skip_frozen), dtype, bucket_bytes):
        # Planned afresh and not cached: a bucket's buffers go when the next bucket is planned.
        bucket = _bucket_plan(items, dtype, {})
        yield _loaded_pairs(bucket, _gather_bucket(bucket), dtype)


# ------------------------------------------------------------------------- in place


@dataclass
class _GatherPlan:
    """One all-gather of a bucket (one process group and wire dtype), planned once.

    ``direct[k]``: the engine's tensor viewed as ``[world, size]``, which the regroup copy writes
    in place (every rank's rows land where they belong when the row count divides evenly);
    ``None``: the tensor goes through the scratch buffer (uneven rows, a LoRA merge, no engine
    buffer), and from there to the engine by a trim copy (``trim``) or ``load_weights``.
    """

    index: list[int]  # positions in the bucket's tensor list
    params: list[torch.Tensor]  # the sharded DTensors, read with to_local() at every sync
    group: object
    world: int
    dtype: torch.dtype
    device: torch.device
    sizes: list[int]  # padded elements per rank of each
    direct: list[torch.Tensor | None]
    trim: dict[int, torch.Tensor]  # k -> engine tensor filled from the scratch (uneven rows)
    views: tuple | None = None  # CPU: the plan's own buffers and views, kept between syncs


@dataclass
class _BucketPlan:
    items: list[_Item]
    tensors: list[torch.Tensor]  # the items' tensors (each param, then its LoRA factors)
    others: list[int]  # tensors not gathered here: plain, or DTensors of another layout
    gathers: list[_GatherPlan]
    loaded: list[int]  # items sent with load_weights (the rest is written in place)


@dataclass
class _Plan:
    engine: weakref.ref | None  # the engine it writes into (its tensors are in the views)
    key: tuple
    buckets: list[_BucketPlan]
    tensors: int
    bytes: int


# model -> id(engine) -> plan (a plan holds its engine weakly; dead ones are dropped on rebuild).
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[int, _Plan]] = weakref.WeakKeyDictionary()


def _engine_buffers(items: list[_Item], engine, dtype) -> dict[str, torch.Tensor]:
    """The engine tensors that can take an item's full weight in place, by HF name."""
    if engine is None or not hasattr(engine, "weight_buffers"):
        return {}
    cands = [it for it in items if not it.loras and _shard0_mesh(it.param) is not None]
    bufs = engine.weight_buffers([it.name for it in cands]) if cands else []
    return {
        it.name: buf
        for it, buf in zip(cands, bufs, strict=True)
        if tuple(buf.shape) == tuple(it.param.shape)
        and buf.dtype == (dtype or it.param.dtype)
        and buf.device == comm_device(it.param)
        and buf.is_contiguous()
    }


def _bucket_plan(items: list[_Item], dtype, buffers: dict[str, torch.Tensor]) -> _BucketPlan:
    """The bucket's gathers, one per (process group, wire dtype) in tensor order (so that ranks
    with and without an engine line up), with each tensor's destination. A weight with no LoRA
    to merge is cast to ``dtype`` before it travels (half the bytes for a bf16 engine)."""
    tensors, wire, owner = [], [], []
    for j, it in enumerate(items):
        ts = it.tensors()
        tensors += ts
        wire += [dtype if (dtype is not None and not it.loras) else t.dtype for t in ts]
        owner += [j] * len(ts)
    others, groups = [], {}
    for i, t in enumerate(tensors):
        mesh = _shard0_mesh(t)
        if mesh is None:
            others.append(i)
            continue
        groups.setdefault((mesh.get_group(), wire[i]), []).append(i)
    gathers = []
    for (group, wire_dtype), idx in groups.items():
        world = dist.get_world_size(group)
        params = [tensors[i] for i in idx]
        rows = [-(-t.shape[0] // world) for t in params]
        sizes = [r * math.prod(t.shape[1:]) for r, t in zip(rows, params, strict=True)]
        direct, trim = [], {}
        for k, (i, size) in enumerate(zip(idx, sizes, strict=True)):
            buf = buffers.get(items[owner[i]].name)
            even = buf is not None and buf.numel() == world * size
            direct.append(buf.view(world, size) if even else None)
            if buf is not None and not even:
                trim[k] = buf
        gathers.append(
            _GatherPlan(
                index=idx,
                params=params,
                group=group,
                world=world,
                dtype=wire_dtype,
                device=comm_device(params[0]),
                sizes=sizes,
                direct=direct,
                trim=trim,
            )
        )
    # An engine buffer is only found for a weight of one Shard(0) tensor: it is in a gather.
    loaded = [j for j, it in enumerate(items) if it.name not in buffers]
    return _BucketPlan(items, tensors, others, gathers, loaded)


def _sync_plan(model: nn.Module, engine, dtype, bucket_bytes: int, skip_frozen: bool) -> _Plan:
    """The cached plan of a sync, rebuilt when its key changes: what a cached plan depends on
    besides the engine object, i.e. the engine's storage, the settings, and every parameter
    object with its local storage (one cheap pass over the parameters, nothing allocated)."""
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    storage = tuple((id(t), t.data_ptr(), t.requires_grad) for t in local)
    key = (getattr(engine, "weights_version", None), dtype, bucket_bytes, skip_frozen, storage)
    plans = _PLANS.setdefault(model, {})
    plan = plans.get(id(engine))
    target = None if plan is None or plan.engine is None else plan.engine()
    if plan is not None and target is engine and plan.key == key:
        return plan
    plan = None
    plans.pop(id(engine), None)  # release the old plan's buffers before building anew
    for k in [k for k, p in plans.items() if p.engine is not None and p.engine() is None]:
        del plans[k]
    items = plan_weights(model, skip_frozen=skip_frozen)
    buffers = _engine_buffers(items, engine, dtype)
    buckets = [_bucket_plan(b, dtype, buffers) for b in _split(items, dtype, bucket_bytes)]
    nbytes = sum(it.param.numel() * (dtype or it.param.dtype).itemsize for it in items)
    ref = None if engine is None else weakref.ref(engine)
    plans[id(engine)] = plan = _Plan(ref, key, buckets, len(items), nbytes)
    return plan


@torch.no_grad()
def _run_gather(g: _GatherPlan, result: list[torch.Tensor | None]) -> None:
    """Pack this rank's shards, all-gather, regroup into the engine's tensors and the scratch."""
    if g.views is None:
        # CPU: the plan keeps its buffers (a fresh multi-megabyte CPU allocation costs page
        # faults); CUDA: the caching allocator serves them and nothing is held between syncs.
        # Views: pack slots, regroup destinations and the scratch results of the gather.
        flat = torch.zeros(sum(g.sizes), dtype=g.dtype, device=g.device)
        out = torch.empty(g.world * flat.numel(), dtype=g.dtype, device=g.device)
        scratch_k = [k for k, d in enumerate(g.direct) if d is None]
        pieces = [g.world * g.sizes[k] for k in scratch_k]
        scratch = torch.empty(sum(pieces), dtype=g.dtype, device=g.device)
        local = [p.to_local() for p in g.params]  # this rank's shard of each
        slots = [s[: x.numel()] for s, x in zip(flat.split(g.sizes), local, strict=True)]
        dests = list(g.direct)
        results: dict[int, torch.Tensor] = {}
        for k, piece in zip(scratch_k, scratch.split(pieces), strict=True):
            dests[k] = piece.view(g.world, g.sizes[k])
            shape = g.params[k].shape
            results[k] = piece.view(-1, *shape[1:])[: shape[0]]
        g.views = (flat, out, slots, dests, results)
    flat, out, slots, dests, results = g.views
    # Pack the local shards into the gather slots, casting: one fused copy on one device; from
    # offloaded CPU shards, foreach's per-tensor fallback copies each to the device.
    local = [p.to_local().reshape(-1) for p in g.params]
    torch._foreach_copy_(slots, local, non_blocking=True)
    dist.all_gather_single(out, flat, group=g.group)
    torch.split_with_sizes_copy(out.view(g.world, -1), g.sizes, dim=1, out=dests)
    if g.trim:
        torch._foreach_copy_(list(g.trim.values()), [results[k] for k in g.trim])
    for k, r in results.items():
        result[g.index[k]] = r
    if g.device.type != "cpu":
        g.views = None


@torch.no_grad()
def _gather_bucket(b: _BucketPlan) -> list[torch.Tensor | None]:
    """The bucket's tensors in full (a collective: same call on every rank); None for those
    written straight into the engine's tensors.

    FSDP2 parameters (``Shard(0)`` on a 1-D mesh) travel in one all-gather per (process group,
    wire dtype); other DTensors fall back to ``DTensor.full_tensor()``.
    """
    from torch.distributed.tensor import DTensor

    result: list[torch.Tensor | None] = [None] * len(b.tensors)
    for i in b.others:
        t = b.tensors[i]
        result[i] = full_tensor(t) if isinstance(t, DTensor) else t.detach()
    for g in b.gathers:
        _run_gather(g, result)
    return result


def _loaded_pairs(
    b: _BucketPlan, full: list[torch.Tensor | None], dtype
) -> list[tuple[str, torch.Tensor]]:
    """The ``(hf_name, full weight)`` pairs of the items not written in place, LoRA merged and
    cast to ``dtype``."""
    starts = [0, *itertools.accumulate(len(it.tensors()) for it in b.items)]
    pairs = []
    for j in b.loaded:
        it = b.items[j]
        w = _merged(it, full[starts[j] : starts[j + 1]])
        pairs.append((it.name, w.to(dtype) if dtype is not None else w))
    return pairs


@dataclass
class SyncStats:
    tensors: int
    bytes: int
    buckets: int


def sync_weights(
    model: nn.Module,
    engine,
    *,
    bucket_bytes: int = 512 * 2**20,
    dtype: torch.dtype | None = None,
    skip_frozen: bool = False,
) -> SyncStats:
    """Copy ``model``'s weights into ``engine`` (call on every rank; ``engine`` may be None on
    ranks that only take part in the all-gathers), then reset the engine's prefix cache.

    ``dtype`` defaults to ``engine.dtype`` when the engine has one. ``bucket_bytes`` bounds the
    full tensors held at once (in ``dtype``; a single larger tensor goes alone): each bucket is
    one all-gather and one ``engine.load_weights`` call. ``skip_frozen``: see
    :func:`plan_weights` (after a level-2 sleep the engine needs every weight: keep it False).
    """
    if dtype is None and engine is not None:
        dtype = getattr(engine, "dtype", None)
    at_least("bucket_bytes", bucket_bytes, 1)
    plan = _sync_plan(model, engine, dtype, bucket_bytes, skip_frozen)
    for bucket in plan.buckets:
        full = _gather_bucket(bucket)
        if engine is not None and bucket.loaded:
            engine.load_weights(_loaded_pairs(bucket, full, dtype))
    if engine is not None:
        engine.reset_prefix_cache()
    return SyncStats(tensors=plan.tensors, bytes=plan.bytes, buckets=len(plan.buckets))
