"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509).

``sequence_parallel: N`` puts N consecutive ranks in one SP group. Every rank of a
group receives the same micro-batch and keeps a contiguous 1/N of each row's positions: the
decoder's embeddings, MLPs, norms and the fused log-prob kernel run on that slice only.
Attention is the one place that needs the whole row: the registered attention function
all-to-alls ``[B, H, T/N, D] -> [B, H/N, T, D]`` (each rank now holds every position for
1/N of the heads), attends with the whole row's pattern, and all-to-alls back.

What a rank does with one micro-batch (:meth:`Ulysses.shard`):

1. the next-token targets are shifted *before* slicing (target ``i`` is token ``i + 1``; the
   last position has none), so the token across a slice boundary is scored exactly once;
2. the row is padded to a multiple of N (padding is never attended to and never scored);
3. the attention pattern of the whole row is read once: causal for padded rows (right padding:
   a real query only sees real keys), one causal block per sample of a packed row
   (``position_ids`` restarting at 0); no ``[T, T]`` mask is ever built;
4. ``input_ids``, ``position_ids`` and the targets are cut to this rank's slice (a
   vision-language row is cut later, at the decoder's entry, after the images are merged into
   its embeddings and its M-RoPE positions computed: :meth:`SequenceShard.trunk_inputs`).

Losses over the slice are partial sums: the FSDP2 reduce-scatter over all ranks (the mesh
spans dp x sp) adds the SP ranks' parameter gradients, so a loss normalised by the global
token count needs nothing more. Per-token values a loss needs whole (GRPO's per-sample
normalisations) are gathered with :meth:`Ulysses.gather`, whose backward keeps this rank's
slice of the gradient (every rank of the group computes the same loss from the same gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from lightrft.distributed import collective_timeout
from lightrft.sections import check_sequence_parallel_model

ATTENTION = "lightrft_ulysses"


def check_model(config: Any, size: int) -> None:
    """Refuse a model SP cannot split ``size`` ways: its type, its head counts, a sliding window.
    ``config``: the model's HF config (the rule: ``lightrft.sections``, which the planner
    shares)."""
    if size == 1:
        return
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    check_sequence_parallel_model(
        size,
        getattr(config, "model_type", None),
        heads,
        getattr(text, "num_key_value_heads", None) or heads,
        sliding_window=bool(getattr(text, "use_sliding_window", False)),
    )


def sp_groups(size: int) -> tuple[Any, int]:
    """This rank's SP group (``size`` consecutive ranks) and its index in it. Collective: every
    rank creates every group, as ``dist.new_group`` requires."""
    mine, _ = dist.new_subgroups(size, timeout=collective_timeout())
    return mine, dist.get_rank() % size


# ------------------------------------------------------------------ collectives with autograd


def all_to_all(x: Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> Tensor:
    """Scatter ``scatter_dim`` of ``x`` over the ``size`` ranks of ``group`` and gather
    ``gather_dim`` (rank-major); its backward is the reverse all-to-all.

    One functional collective (``all_to_all_single_autograd``): dynamo traces it into the
    compiled graph (no graph break in a compiled block), inductor waits for it where its
    result is first read, and eager runs the same op (its autograd is torch's)."""
    # [.., S, ..] -> [size, .., S / size, ..]: chunk i of the scatter dim goes to rank i.
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    recv = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))
    # [size, .., T, ..]: chunk i came from rank i -> [.., size * T, ..]
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _GatherSeq(torch.autograd.Function):
    """All-gather dim 1 over the group; backward: this rank's slice of the gradient (every rank
    of the group computes the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any, rank: int) -> Tensor:
        ctx.rank, ctx.width = rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        start = ctx.rank * ctx.width
        return grad[:, start : start + ctx.width].contiguous(), None, None


# ------------------------------------------------------------------ one micro-batch


class SequenceShard:
    """This rank's slice of one micro-batch and the whole row's attention pattern; passed
    through the model's forward as the ``ulysses`` keyword, which reaches the attention
    function (also when activation checkpointing recomputes a block in backward)."""

    def __init__(self, sp: Ulysses, bounds: list[list[int]] | None, padded: int):
        # bounds: per row, the start of each packed sample and the padded length (None: one
        # causal block per row).
        self.sp, self.bounds, self.padded = sp, bounds, padded
        self.input_ids: Tensor | None = None  # [B, T_pad / N]
        self.position_ids: Tensor | None = None  # [B, T_pad / N]
        self.targets: Tensor | None = None  # [B, T_pad / N]
        self.num_tokens: int = 0  # scored targets of the whole row(s)
        # The whole padded row, for a multimodal model (cut at the trunk, not before).
        self.whole_input_ids: Tensor | None = None  # [B, T_pad]
        self.whole_attention_mask: Tensor | None = None  # [B, T_pad]: padded rows only
        self.whole_position_ids: Tensor | None = None  # [B, T_pad]: packed rows only

    def trunk_inputs(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of the decoder trunk: its embeddings (images merged) and positions
        (M-RoPE ``[3 or 4, B, T_pad]``) cut to this rank's slice; no mask (the attention reads
        the row's pattern from the shard)."""
        if args:
            raise ValueError("sequence_parallel expects the decoder trunk called by keywords")
        kwargs = dict(kwargs)
        for key in ("inputs_embeds", "input_ids"):
            if kwargs.get(key) is not None:
                kwargs[key] = self.local(kwargs[key], 1)
        pos = kwargs.get("position_ids")
        kwargs["position_ids"] = (
            self.position_ids if pos is None else self.local(pos, pos.dim() - 1)
        )
        kwargs["attention_mask"] = None
        kwargs["ulysses"] = self
        return args, kwargs

    def local(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's contiguous slice of ``x`` (padded length ``padded`` along ``dim``)."""
        width = self.padded // self.sp.size
        return x.narrow(dim, self.sp.rank * width, width)


class Ulysses:
    """One rank's view of its SP group: how to cut a micro-batch and put it back together."""

    def __init__(self, group: Any, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self._enabled: set[int] = set()

    def prepare(self, model: nn.Module) -> None:
        """Route ``model``'s attention through the Ulysses function (once per model: the
        trained one, a frozen reference beside it)."""
        if id(model) not in self._enabled:
            enable(model)
            self._enabled.add(id(model))

    def shard(
        self,
        input_ids: Tensor,
        targets: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        ignore_index: int = -100,
    ) -> SequenceShard:
        """Cut ``input_ids`` ``[B, T]`` and its next-token ``targets`` ``[B, T-1]`` (see the
        module docstring). Padded rows come with ``attention_mask``; packed rows with
        ``position_ids`` that restart at 0 per sample."""
        b, t = input_ids.shape
        dev = input_ids.device
        padded = -(-t // self.size) * self.size
        extra = padded - t
        # [B, T_pad]: position i predicts token i + 1
        full_targets = torch.nn.functional.pad(targets, (0, extra + 1), value=ignore_index)
        ids = torch.nn.functional.pad(input_ids, (0, extra))  # [B, T_pad]
        if attention_mask is not None:
            keep = attention_mask.bool()
            if (keep[:, 1:] & ~keep[:, :-1]).any():
                raise ValueError(
                    "sequence_parallel needs right-padded rows (an attention mask of ones, then "
                    "zeros); this micro-batch has a zero before a one"
                )
        tail = torch.arange(extra, device=dev).expand(b, extra)  # the SP padding's positions
        if position_ids is None or attention_mask is not None:
            # Padded or plain rows: causal attention over the whole row is exact for every real
            # query (right padding: the keys before a real query are real).
            pos = torch.arange(padded, device=dev).expand(b, padded)  # the model's default
            bounds = None
        else:
            pos = torch.cat([position_ids, tail], dim=1)  # [B, T_pad]
            # Packed rows: one causal block per sample (and one for the SP padding), each from
            # a position 0 (and the row's start) to the next.
            bounds = [sorted({0, *(row == 0).nonzero().flatten().tolist(), padded}) for row in pos]
        shard = SequenceShard(self, bounds, padded)
        shard.input_ids = shard.local(ids)
        shard.position_ids = shard.local(pos)
        shard.targets = shard.local(full_targets)
        shard.num_tokens = int((targets != ignore_index).sum())
        shard.whole_input_ids = ids
        if attention_mask is not None:
            shard.whole_attention_mask = torch.nn.functional.pad(attention_mask, (0, extra))
        elif position_ids is not None:
            shard.whole_position_ids = pos
        return shard

    def gather(self, x: Tensor, length: int) -> Tensor:
        """``x`` ``[B, T_pad / N, ...]`` of every rank of the group -> ``[B, length, ...]``."""
        return _GatherSeq.apply(x, self.group, self.rank)[:, :length]


# ------------------------------------------------------------------ the attention function


def _ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    ulysses: SequenceShard | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: ``query`` ``[B, H, S, D]``, ``key`` / ``value``
    ``[B, KV, S, D]`` -> ``[B, S, H, D]``. Without a ``ulysses`` shard: plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if ulysses is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    group, n = ulysses.sp.group, ulysses.sp.size
    q = all_to_all(query, group, n, 1, 2)  # [B, H/N, T_pad, D]
    k = all_to_all(key, group, n, 1, 2)  # [B, KV/N, T_pad, D]
    v = all_to_all(value, group, n, 1, 2)
    dropout, scaling = kwargs.get("dropout", 0.0), kwargs.get("scaling")

    def causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return causal_attention(module, q, k, v, dropout=dropout, scaling=scaling)

    if ulysses.bounds is None:
        out = causal(q, k, v)  # [B, T_pad, H/N, D]
    else:  # one causal attention per packed sample
        rows = []
        for r, bounds in enumerate(ulysses.bounds):
            row = slice(r, r + 1)
            blocks = [
                causal(q[row, :, s:e], k[row, :, s:e], v[row, :, s:e])
                for s, e in zip(bounds[:-1], bounds[1:], strict=True)
            ]
            rows.append(torch.cat(blocks, dim=1))
        out = torch.cat(rows, dim=0)  # [B, T_pad, H/N, D]
    out = all_to_all(out.transpose(1, 2), group, n, 2, 1)  # [B, H, S, D]
    return out.transpose(1, 2).contiguous(), None  # [B, S, H, D]


def causal_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> Tensor:
    """Causal sdpa, ``query`` ``[B, H, T, D]``, ``key`` / ``value`` ``[B, KV, T, D]`` ->
    ``[B, T, H, D]``: transformers' sdpa path without a mask (its GQA choice, its layout).

    Not ``sdpa_attention_forward`` itself: it sets ``is_causal = q_length > 1 and ...``, which
    under ``torch.compile(dynamic=True)`` is a ``SymBool`` for a one-token block (a packed
    sample or the SP padding), which sdpa refuses (a graph break); causal is exact at any
    length."""
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

    gqa = {}
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        if use_gqa_in_sdpa(None, key, value):
            gqa["enable_gqa"] = True
        else:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=True, **gqa
    )  # [B, H, T, D]
    return out.transpose(1, 2).contiguous()


def enable(model: nn.Module) -> nn.Module:
    """Route ``model``'s attention through :func:`_ulysses_attention` (plain sdpa unless a
    forward passes ``ulysses=``). The model must use sdpa attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks of a plain forward
    # Every distinct HF config of the decoder's attention modules.
    configs = [getattr(m, "config", None) for m in model.modules() if hasattr(m, "q_proj")]
    configs = list({id(c): c for c in configs if c is not None}.values())
    if not configs:
        raise ValueError(f"{type(model).__name__} has no attention module with a q_proj")
    for config in configs:
        impl = getattr(config, "_attn_implementation", None)
        if impl not in ("sdpa", ATTENTION):
            raise ValueError(
                f"sequence_parallel needs the model's attention to be sdpa, got "
                f"attn_implementation={impl!r}"
            )
        config._attn_implementation = ATTENTION
    return model
