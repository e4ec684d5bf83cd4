"""Vocabulary-parallel tables for frozen models sharded over a data-parallel group (reward models).

FSDP2 shards the input embedding and the LM head by rows (dim 0: the vocabulary) but gathers
them whole to run them: a ``vocab x hidden`` buffer per gather, as much as a rank's shard of a
whole small model. Here each rank keeps only its rows (a ``DTensor`` with ``Shard(0)`` over the
mesh, kept out of FSDP2's groups) and the ranks move activations instead of weights:

- the embedding: every rank's token ids are gathered, each rank looks up the ids in its row
  range (zeros elsewhere), and an all-reduce sums the lookups; each rank keeps its own rows.
  Exactly one rank contributes each row, so the sum is exact.
- the LM head's log-probabilities: every rank's hidden rows and targets are gathered, each rank
  computes its vocabulary slice of the logits, and the log-softmax is assembled with all-reduces
  (the max, the sum of exponentials rescaled to it, the target's logit from the rank that owns
  it).

The ranks score different samples (data parallel), so the gathers carry every rank's tokens:
``world x`` a micro-batch's ids or hidden rows, far less than a vocabulary table. Inference only
(no autograd); every rank must make each call, as with any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightrft.kernels.logprobs import acc_dtype, logit_workspaces, logits_into


@dataclass(frozen=True)
class VocabRows:
    """Rows ``[start, stop)`` of a ``vocab``-row table that this rank holds, and the group the
    other rows are spread over."""

    start: int
    stop: int
    vocab: int
    group: dist.ProcessGroup


def vocab_rows(weight: torch.Tensor) -> VocabRows | None:
    """This rank's rows of a vocabulary-sharded ``weight`` (a ``DTensor`` sharded on dim 0 over
    a 1-D mesh); ``None`` for a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(weight, DTensor):
        return None
    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or placements[0] != Shard(0):
        raise ValueError(
            f"a vocabulary table must be sharded on dim 0 over a 1-D mesh, got {placements} "
            f"over a {mesh.ndim}-D mesh"
        )
    shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    return VocabRows(offset[0], offset[0] + shape[0], weight.shape[0], mesh.get_group())


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list[int]]:
    """Every rank's ``x [n_r, ...]`` as ``[world, max n_r, ...]`` (zero-padded) and the ``n_r``."""
    world = dist.get_world_size(group)
    counts = torch.empty(world, dtype=torch.long, device=x.device)
    dist.all_gather_into_tensor(counts, counts.new_tensor([x.shape[0]]), group=group)
    sizes = counts.tolist()
    padded = x.new_zeros((max(sizes), *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = padded.new_empty((world * len(padded), *padded.shape[1:]))  # concatenated on dim 0
    dist.all_gather_into_tensor(parts, padded, group=group)
    return parts.view(world, *padded.shape), sizes


# Elements of a chunk's logits workspace (2 Mi: 8 MiB in fp32): small next to the tables a
# rank no longer gathers, and some hundreds of rows for a vocabulary slice, enough for the
# matmul to run near peak.
LOGITS_WORKSPACE = 1 << 21


def logits_chunk_rows(n_rows: int, vocab_rows: int) -> int:
    """Rows of logits computed at a time: the workspace over the rows of the slice, a multiple
    of 64 (BLAS blocks), at least 64 and at most ``n_rows`` (and 1)."""
    rows = LOGITS_WORKSPACE // max(vocab_rows, 1) // 64 * 64
    return max(1, min(max(rows, 64), n_rows))


def _mine(rows: VocabRows, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of ``ids`` fall in this rank's rows, and their local row (0 for the others)."""
    inside = (ids >= rows.start) & (ids < rows.stop)
    return inside, torch.where(inside, ids - rows.start, 0)


def _check_ids(ids: torch.Tensor, vocab: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"token ids must lie in [0, {vocab}) (the vocabulary), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


def vocab_parallel_lookup(ids: torch.Tensor, weight: torch.Tensor, rows: VocabRows) -> torch.Tensor:
    """``weight[ids]`` ``[*ids.shape, H]`` from every rank's rows of ``weight`` (this rank's as
    ``weight [stop - start, H]``): a collective of ``rows.group``, whose ranks look up ids of
    their own."""
    every, sizes = gather_rows(ids.reshape(-1), rows.group)  # [world, n_max]
    _check_ids(every, rows.vocab)  # every rank checks every rank's ids: all raise, or none
    inside, local = _mine(rows, every)
    out = nn.functional.embedding(local, weight)  # [world, n_max, H]
    out.masked_fill_(~inside[..., None], 0)
    dist.all_reduce(out, group=rows.group)  # one rank holds each row: an exact sum
    rank = dist.get_rank(rows.group)
    # A copy: a view would hold every rank's lookups for the whole forward.
    return out[rank, : sizes[rank]].clone().reshape(*ids.shape, weight.shape[1])


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: VocabRows,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log_softmax(hidden @ W.T + b)[i, targets[i]]`` ``[n]`` (fp32; fp64 for fp64) with each
    rank holding its rows of ``W`` (``weight [stop - start, H]``, ``bias`` likewise): a
    collective of ``rows.group`` whose ranks score rows of their own. Per rank, in chunks of
    rows, the local max ``m``, the sum ``s`` of ``exp(z - m)`` and the target's logit (zero
    unless this rank owns it); then ``M = max m``, ``S = sum s exp(m - M)``, and
    ``logp = z_target - M - log S``."""
    every_h, sizes = gather_rows(hidden, rows.group)  # [world, n_max, H]
    every_t, _ = gather_rows(targets, rows.group)  # [world, n_max]
    _check_ids(every_t, rows.vocab)  # every rank checks every rank's targets: all raise, or none
    h, t = every_h.flatten(0, 1), every_t.reshape(-1)
    acc = acc_dtype(hidden.dtype)
    n = h.shape[0]
    # Every row's max, sum of exponentials and target logit, all set chunk by chunk.
    peak, sums, picked = h.new_zeros((3, n), dtype=acc)
    chunk = logits_chunk_rows(n, weight.shape[0])
    # The fused kernel's workspace and logits (fp32 from a low-precision matmul where it can).
    buf, _, low = logit_workspaces(min(chunk, n), weight.shape[0], h, entropy=False)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        z = logits_into(buf[: e - s], h[s:e], weight, bias, 1.0, low)  # [c, V_local]
        inside, local = _mine(rows, t[s:e])
        picked[s:e] = torch.where(inside, z.gather(1, local[:, None]).squeeze(1), 0)
        peak[s:e] = z.amax(dim=1)
        sums[s:e] = z.sub_(peak[s:e, None]).exp_().sum(dim=1)
    top = peak.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=rows.group)
    parts = torch.stack([sums * torch.exp(peak - top), picked])  # [2, n]
    dist.all_reduce(parts, group=rows.group)  # the target's logit: one rank's, others' zeros
    logp = parts[1] - top - torch.log(parts[0])
    rank = dist.get_rank(rows.group)
    return logp.reshape(every_t.shape)[rank, : sizes[rank]]


class VocabParallelEmbedding(nn.Module):
    """An input embedding whose ``weight`` is vocabulary-sharded (:func:`shard_vocab_tables`):
    its forward is :func:`vocab_parallel_lookup`, a collective of the weight's mesh."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = vocab_rows(self.weight)
        assert rows is not None, "VocabParallelEmbedding holds a vocabulary-sharded weight"
        local = self.weight.to_local().to(input_ids.device)  # offload: rows kept in CPU memory
        return vocab_parallel_lookup(input_ids, local, rows)


def _replace(model: nn.Module, table: str, old: Any, new: Any) -> None:
    """Every entry of a module's ``table`` (``_parameters``, ``_modules``) holding ``old`` (a tied
    weight: several) holds ``new`` instead."""
    for module in model.modules():
        entries = getattr(module, table)
        for name, x in list(entries.items()):
            if x is old:
                entries[name] = new


def vocab_tables(model: nn.Module) -> tuple[nn.Embedding, nn.Linear | None]:
    """The input embedding of ``model`` (a :class:`~lightrft.models.reward.RewardNet`, whose
    backbone has it, or an HF model) and its LM head, if any (the ``likelihood`` pooling's)."""
    owner = model if hasattr(model, "get_input_embeddings") else getattr(model, "base", None)
    embedding = owner.get_input_embeddings() if owner is not None else None
    if type(embedding) is not nn.Embedding:
        raise ValueError(
            f"{type(model).__name__}: vocabulary-parallel scoring needs a plain nn.Embedding "
            f"input embedding, got {type(embedding).__name__}"
        )
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is not None and not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}: vocabulary-parallel scoring needs a linear LM head, got "
            f"{type(head).__name__}"
        )
    return embedding, head


def shard_vocab_tables(model: nn.Module, mesh) -> set[nn.Parameter]:
    """Shard the input embedding and the LM head of the meta-built, frozen ``model`` (their
    forward has no backward) by vocabulary rows over the 1-D ``mesh`` (``Shard(0)`` DTensors, on
    meta until filled; a tied head shares the embedding's) and make the embedding a
    :class:`VocabParallelEmbedding`. Returns the tables' parameters, for FSDP2's
    ``ignored_params``: they are never gathered."""
    if mesh is None or mesh.ndim != 1:
        raise ValueError("vocabulary-parallel tables are sharded over a 1-D device mesh")
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("scoring=True is for frozen models: freeze it in prepare")
    from torch.distributed.tensor import Shard, distribute_tensor

    embedding, head = vocab_tables(model)
    tables = [embedding.weight] + ([head.weight, head.bias] if head is not None else [])
    sharded: set[nn.Parameter] = set()
    # dict.fromkeys: a tied head's weight is the embedding's, sharded once.
    for old in dict.fromkeys(t for t in tables if t is not None):
        if not old.is_meta:
            raise ValueError(
                "vocabulary-parallel tables are sharded before they are filled: build the model "
                "on the meta device (lightrft.models.sharded.build_on_meta)"
            )
        # src_data_rank=None: each rank takes its rows of the (meta) table, with no scatter.
        rows = distribute_tensor(old.detach(), mesh, [Shard(0)], src_data_rank=None)
        new = nn.Parameter(rows, requires_grad=False)
        _replace(model, "_parameters", old, new)
        sharded.add(new)
    embedding_module = VocabParallelEmbedding(embedding.weight, embedding.padding_idx)
    _replace(model, "_modules", embedding, embedding_module)
    return sharded
