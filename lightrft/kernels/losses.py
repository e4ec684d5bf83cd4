"""Losses on hidden states through the fused linear log-prob kernel: SFT cross-entropy and the
GRPO-family policy loss. Neither builds the ``[tokens x vocab]`` logits."""

from __future__ import annotations

import torch
from torch import Tensor

from .logprobs import (
    Backend,
    acc_dtype,
    check_inputs,
    chunked_sweep,
    default_chunk_size,
    fused_linear_logprobs,
    liger_flce,
    select_backend,
    valid_rows,
)

Number = int | float | Tensor


def _denominator(num_tokens: Number | None, count: int) -> float | Tensor:
    if num_tokens is None:
        return float(max(count, 1))  # all targets ignored: loss 0, not NaN
    tensor = isinstance(num_tokens, Tensor)
    if tensor and num_tokens.numel() != 1:
        raise ValueError(f"num_tokens must be a scalar, got shape {tuple(num_tokens.shape)}")
    if not num_tokens > 0:  # NaN too
        raise ValueError(
            f"num_tokens must be > 0, got {num_tokens.item() if tensor else num_tokens}"
        )
    return num_tokens.float() if tensor else float(num_tokens)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum of ``-log p(target)`` over the given rows times ``scale``, with the gradients
    computed in the forward sweep (the upstream gradient of each log-prob is ``-scale``, known
    up front), so each chunk's logits are built once instead of twice. Backward only rescales
    by the incoming scalar gradient (the approach of Liger-Kernel's fused linear cross-entropy).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, scale, chunk):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        acc = acc_dtype(hidden.dtype)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        grad_logp = torch.full((n,), -1.0, dtype=acc, device=hidden.device)
        grad_logp.mul_(scale.to(acc) if isinstance(scale, Tensor) else scale)
        g_h, g_w, g_b = chunked_sweep(
            hidden, weight, targets, bias, 1.0, chunk, grad_logp, None, None, need, logp_out=logp
        )
        ctx.save_for_backward(g_h, g_w, g_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return -(logp.sum() * scale)

    @staticmethod
    def backward(ctx, grad_out):
        scaled = not bool(grad_out == 1)  # else the saved gradients are the answer
        g_h, g_w, g_b = (
            None if g is None else (g * grad_out.to(g.dtype) if scaled else g).to(dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        )
        return g_h, g_w, None, g_b, None, None


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    num_tokens: Number | None = None,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Mean next-token negative log-likelihood from hidden states, for SFT.

    Args:
        hidden: ``[..., H]`` final hidden states; ``targets``: ``[...]`` token ids aligned with
            them (already shifted), ``ignore_index`` where no loss is taken.
        weight, bias: the LM head ``[V, H]`` and optional ``[V]``.
        num_tokens: divide the summed NLL by this instead of the number of non-ignored targets.
            Pass the loss-token count of the whole optimizer step (all micro-batches and ranks)
            so that gradient accumulation gives the gradient of one big batch.

    Returns:
        scalar fp32 loss (0 when every target is ignored and ``num_tokens`` is None).

    The torch backend computes the gradients in the forward sweep when autograd needs them
    (3 matmuls per chunk instead of 4); Liger's fused linear cross-entropy does the same on CUDA.
    """
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    t1 = targets.reshape(-1)  # [N]
    check_inputs(h2, weight, t1, bias, 1.0, chunk_size)  # the rows too: targets must be [N]
    idx = valid_rows(t1, weight.shape[0], ignore_index)
    count = h2.shape[0] if idx is None else idx.numel()
    denom = _denominator(num_tokens, count)
    if select_backend(h2, backend=backend) == "liger":
        return liger_flce(h2, weight, t1.long(), bias, 1.0, ignore_index, "sum") / denom
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if not needs_grad:
        logp = fused_linear_logprobs(
            h2,
            weight,
            t1,
            bias=bias,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
            backend="torch",
        )
        return -logp.sum() / denom
    if idx is not None:
        h2, t1 = h2.index_select(0, idx), t1.index_select(0, idx)  # autograd scatters back
    chunk = chunk_size or default_chunk_size(h2.shape[0], weight.shape[0])
    scale = 1.0 / denom if not isinstance(denom, Tensor) else denom.reciprocal()
    return _FusedLinearCrossEntropy.apply(h2, weight, t1.long(), bias, scale, chunk)
