"""A :data:`~lightrft.kernels.logprobs.GradHint` from a loss written on ``[b, R]`` tensors.

Recipes write their loss on a response-aligned layout (``[b, R]``: one row per sample, one column
per response token) gathered from the kernel's flat rows. When that loss is a sum over tokens of
functions of each token's own log-prob and entropy (the PPO/CPGD policy loss with any
aggregation and importance weights, KL in the loss, the entropy bonus), the gradient with respect
to a token's log-prob follows from that token's values alone, so the fused kernel can compute the
LM-head gradients during its forward. :func:`response_grad_hint` turns the recipe's own loss
function into that hint: for each chunk it places the chunk's log-probs in an otherwise zero
``[b, R]`` leaf, evaluates the loss and takes ``autograd.grad``. No derivative is written twice,
and the values the hint returns are those autograd later delivers through the same loss
(elementwise ops give the same bits at the same position), so the kernel's check passes.

A loss that is not per-token (GSPO's and GMPO's sequence ratios) must not get a hint: its
gradient at one token depends on the other tokens of the sequence. The kernel would notice the
disagreement in backward and recompute exactly, having wasted the forward's gradient work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .logprobs import GradHint

LossOnResponse = Callable[[Tensor, Tensor | None], Tensor]
"""``loss(logprobs [b, R], entropy [b, R] | None) -> scalar``: the loss as autograd will see it."""


def response_grad_hint(
    loss: LossOnResponse,
    index: Tensor,
    mask: Tensor,
    n_rows: int,
    *,
    entropy_grad: bool = False,
) -> GradHint:
    """A grad hint for kernel rows gathered into ``[b, R]`` as ``flat[index]`` where ``mask``.

    Args:
        loss: the scalar loss of the ``[b, R]`` log-probs (and entropy). It must be a sum over
            tokens of per-token terms with weights that do not depend on the log-probs.
        index: ``[b, R]`` kernel row (index into the ``N`` flattened rows) of each position.
        mask: ``[b, R]`` positions that hold a kernel row (each row at most once).
        n_rows: ``N``, the kernel's number of rows.
        entropy_grad: whether the loss differentiates the entropy (the entropy bonus); the hint
            then returns its gradient too. Otherwise the entropy is passed as data (or None when
            the kernel computes none).
    """
    if index.shape != mask.shape or index.dim() != 2:
        raise ValueError(
            f"index and mask must both be [b, R], got {tuple(index.shape)} and {tuple(mask.shape)}"
        )
    flat_mask = mask.reshape(-1).bool()
    rows = index.reshape(-1)[flat_mask].long()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_rows):
        raise ValueError(f"index must lie in [0, {n_rows}) where mask is set")
    if rows.unique().numel() != rows.numel():
        raise ValueError("index maps two masked positions to one kernel row")
    # Kernel row -> flat [b * R] position, -1 for rows outside the loss.
    where = torch.full((n_rows,), -1, dtype=torch.long, device=index.device)
    where[rows] = flat_mask.nonzero().squeeze(1).to(index.device)
    shape = tuple(mask.shape)

    def place(values: Tensor, at: Tensor, have: Tensor) -> Tensor:
        out = values.new_zeros(shape[0] * shape[1])
        out[at[have]] = values[have]
        return out.view(shape)

    def hint(chunk_rows: Tensor, logp: Tensor, ent: Tensor | None):
        at = where[chunk_rows.to(where.device)].to(logp.device)  # [c]
        have = at >= 0
        lp = place(logp, at, have).requires_grad_()
        en = None if ent is None else place(ent, at, have)
        wrt = [lp]
        if entropy_grad:
            if en is None:
                raise ValueError("entropy_grad=True needs the kernel to compute the entropy")
            wrt.append(en.requires_grad_())
        # An input the loss does not use gets zeros; rows outside the loss get zeros too.
        grads = torch.autograd.grad(loss(lp, en), wrt, materialize_grads=True)
        picked = [g.reshape(-1)[at[have]].to(logp.dtype) for g in grads]
        out = [torch.zeros_like(logp).masked_scatter_(have, p) for p in picked]
        return out[0], (out[1] if entropy_grad else None)

    return hint
