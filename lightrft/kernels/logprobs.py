"""Fused linear log-probs and entropy: ``log_softmax((h @ W.T + b) / T)[target]`` without logits.

The naive path materialises ``[N, V]`` logits, their log-softmax and, in backward, two more
``[N, V]`` gradients: 10 GB per tensor for 16k tokens of a 152k vocabulary in fp32. Here the rows
are processed in chunks; one ``[chunk, V]`` fp32 workspace is reused for every chunk, and the
backward recomputes each chunk's logits instead of storing them (the chunking of Liger-Kernel's
fused linear cross-entropy, Hsu et al. 2024, arXiv:2410.10989, applied to per-token log-probs,
whose upstream gradient is only known in backward).

Per chunk the forward is one matmul into the workspace and one row-fused in-place log-softmax.
The backward rebuilds ``P = softmax(z)`` in place, subtracts the one-hot of the targets in place
(``d logp / dz = onehot - p``) and puts the per-row upstream gradient ``g`` on the small
``[chunk, H]`` operands instead of the ``[chunk, V]`` one::

    grad_h  = -(g / T) * ((P - onehot) @ W)
    grad_W += (P - onehot).T @ (-(g / T) * h)

so a chunk costs one elementwise pass and three matmuls. The last chunk of the forward is still in
the workspace when the backward starts, so the backward does it first without rebuilding it.
Entropy ``H = -sum p log p`` has ``dH/dz = -p (log p + H)``: one more ``[chunk, V]`` pass.

With a ``grad_hint`` (a loss whose gradient w.r.t. each log-prob follows from that row's values,
e.g. the PPO policy loss), ``g`` is known as soon as a chunk's log-probs are: the forward then
does the backward's work on the chunk while its log-softmax is in the workspace (three matmuls
per chunk in all, like the naive path) and the backward returns the stored gradients, after
checking that the gradient autograd delivers is the one the hint gave.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

Backend = Literal["auto", "torch", "liger"]
BACKENDS = ("auto", "torch", "liger")

GradHint = Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor | None]]
"""``grad_hint(rows [c], logprobs [c], entropy [c] | None) -> (d loss / d logprobs [c],
d loss / d entropy [c] | None)``: the gradient of the scalar loss with respect to the log-probs
(and entropy) of the given rows (indices into the kernel's ``N`` rows), from their values alone.
See :func:`fused_linear_logprobs`."""

# A hint agrees with the upstream gradient autograd delivers when no element differs by more than
# this fraction of the largest one: a few fp32 roundings.
_HINT_RTOL = 1e-6

# Elements of the per-chunk fp32 workspace (64 Mi = 256 MiB): a few hundred rows for real
# vocabularies, where the chunk's three matmul shapes run near the machine's peak, while staying
# far below the naive path's several [N, V] tensors. See docs/kernels.md for the measurements.
_WORKSPACE_ELEMENTS = 1 << 26
_ROW_MULTIPLE = 64  # BLAS kernels block rows in multiples of 16/32/64


def default_chunk_size(n_rows: int, vocab: int) -> int:
    """Rows per chunk: the workspace budget over V, rounded to a multiple of 64, at most N."""
    rows = round(_WORKSPACE_ELEMENTS / max(vocab, 1) / _ROW_MULTIPLE) * _ROW_MULTIPLE
    return max(1, min(max(rows, _ROW_MULTIPLE), n_rows))


def check_inputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    chunk_size: int | None,
) -> None:
    """Raise a ``ValueError`` naming the first bad shape, dtype or option of a kernel call."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, "
            f"got shape {tuple(weight.shape)}"
        )
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"targets must be [N] with N = hidden.shape[0] = {hidden.shape[0]}, "
            f"got shape {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor (int64), got {targets.dtype}")
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(hidden, DTensor) or isinstance(weight, DTensor):
            raise ValueError(
                "hidden/weight is a sharded DTensor (FSDP2): compute inside the root module's "
                "forward, e.g. with lightrft.models.forward.causal_lm_token_logprobs / forward_on_hidden"
            )
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must be [V] = [{weight.shape[0]}] of dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def valid_rows(targets: Tensor, vocab: int, ignore_index: int) -> Tensor | None:
    """Indices of the rows whose target is not ignored; None when every row counts."""
    valid = targets != ignore_index  # [N]
    bad = valid & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        t = targets[bad][0].item()
        raise ValueError(
            f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}, found {t}"
        )
    if bool(valid.all()):
        return None
    return valid.nonzero().squeeze(1)  # [N_valid]


def _mm_fp32_out_supported(x: Tensor) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` runs for low-precision ``x`` (CUDA only)."""
    low = x.dtype in (torch.bfloat16, torch.float16)
    return x.is_cuda and low and _probe_fp32_out_mm(x.device, x.dtype)


@functools.cache
def _probe_fp32_out_mm(device: torch.device, dtype: torch.dtype) -> bool:
    # torch >= 2.8 has mm(..., out_dtype=) on CUDA; probe once per device instead of trusting the
    # version, so an older torch or an unsupported GPU falls back to rounding the chunk.
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def logits_into(
    out: Tensor,
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    inv_t: float,
    scratch: Tensor | None,
) -> Tensor:
    """Write the scaled logits ``(h @ W.T + b) / T`` of one chunk into ``out`` [c, V] (fp32/64)."""
    if h.dtype == out.dtype:
        if bias is None:
            # beta=0 ignores out's stale contents (NaN-safe); alpha folds 1/T into the matmul.
            return torch.addmm(out, h, weight.t(), beta=0.0, alpha=inv_t, out=out)
        return torch.addmm(bias, h, weight.t(), beta=inv_t, alpha=inv_t, out=out)
    if _mm_fp32_out_supported(h):
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    else:
        # CPU has no low-precision matmul with fp32 output: round the chunk once, like the naive
        # path's logits, then do everything after it in fp32.
        assert scratch is not None
        low = scratch[: h.shape[0]]
        torch.mm(h, weight.t(), out=low)
        out.copy_(low)
    if bias is not None:
        out.add_(bias)
    if inv_t != 1.0:
        out.mul_(inv_t)
    return out


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel computes in: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Per thread: CPU chunk buffers kept for the next call, {(slot, dtype): flat tensor}.
_host_scratch = threading.local()


def _scratch(slot: int, rows: int, vocab: int, dtype: torch.dtype) -> Tensor:
    """A ``[rows, vocab]`` CPU buffer that this thread's later calls reuse (grown as needed).

    On CPU a fresh buffer of this size is a fresh ``mmap`` from glibc, unmapped again when it is
    freed, so every call faulted its hundreds of MiB in again, zero-filled: 15% of the kernel's
    time at 2,048 x 32k (docs/performance.md, "Freed memory"). CUDA's caching allocator already
    reuses GPU memory, so only the CPU keeps these; each thread holds at most its largest
    chunk's buffers (the workspace budget, 256 MiB, per slot) for the life of the process."""
    store = _host_scratch.__dict__
    flat = store.get((slot, dtype))
    if flat is None or flat.numel() < rows * vocab:
        # A normal tensor even when first asked for under inference_mode (a reward model's or
        # an eval's scoring): an inference tensor could not be written by a later training call.
        with torch.inference_mode(False):
            flat = store[(slot, dtype)] = torch.empty(rows * vocab, dtype=dtype)
    return flat[: rows * vocab].view(rows, vocab)


def logit_workspaces(
    rows: int,
    vocab: int,
    like: Tensor,
    entropy: bool,
    reuse: Tensor | None = None,
    scratch: bool = False,
) -> tuple[Tensor, ...]:
    """Chunk buffers: logits [c, V] (``reuse`` if given), a second one for the entropy, and a
    low-precision scratch when the matmul cannot write fp32 directly.

    ``scratch``: the buffers live only until the call returns, so on CPU they are this
    thread's kept buffers (:func:`_scratch`) instead of fresh allocations."""
    acc = acc_dtype(like.dtype)
    keep = scratch and like.device.type == "cpu"

    def new(slot: int, dtype: torch.dtype) -> Tensor:
        if keep:
            return _scratch(slot, rows, vocab, dtype)
        return torch.empty(rows, vocab, dtype=dtype, device=like.device)

    buf = reuse if reuse is not None else new(0, acc)
    buf2 = new(1, acc) if entropy else None
    low = new(2, like.dtype) if like.dtype != acc and not _mm_fp32_out_supported(like) else None
    return buf, buf2, low


def chunked_sweep(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    inv_t: float,
    chunk: int,
    grad_logp: Tensor | None,
    grad_ent: Tensor | None,
    entropy: Tensor | None,
    need: tuple[bool, bool, bool],
    *,
    logp_out: Tensor | None = None,
    cached: Tensor | None = None,
    hint: tuple[GradHint, Tensor] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The kernel's one chunk loop over the given (all valid) rows: the forward, the backward, or
    both in one sweep. Returns the gradients (fp32/64) of hidden rows [n, H], weight [V, H] and
    bias [V] that ``need`` asks for.

    Per chunk, with ``d logp / dz = onehot - p`` and ``d H / dz = -p (log p + H)``, the gradient
    of the scaled logits is ``dz = -r * D`` with ``D = P - onehot`` and ``r = g`` per row (log-probs
    only: the row factor goes onto the small [c, H] operands), or
    ``D = P * (g + g_H (log p + H)) - g * onehot`` and ``r = 1`` (entropy gradient too).
    Both are built in place in the logits workspace, then
    ``grad_h = -(r/T) * (D @ W)``, ``grad_W += D.T @ (-(r/T) * h)``, ``grad_b += D.T @ -(r/T)``.

    ``logp_out`` [n]: a forward: write the log-probs, and the entropy into ``entropy`` when
    given; with gradients, one sweep for a loss whose gradient w.r.t. the log-probs is known up
    front (cross-entropy, or a ``hint``). ``cached``: in a backward, the forward's workspace
    holding the last chunk's log-softmax, consumed here (the backward starts with that chunk and
    skips rebuilding it); in a forward without gradients, a ``[min(chunk, n), V]`` buffer to use
    as the workspace, which it leaves holding the last chunk's log-softmax.

    ``hint`` ``(grad_hint, rows)`` (with ``logp_out``; ``rows``: the kernel rows of the given
    ones): the forward's sweep of a :data:`GradHint`. Each chunk's upstream gradients come from
    the hint on its log-probs (and entropy) and are written into ``grad_logp`` and, where the
    hint gives one, ``grad_ent`` (zeros elsewhere), so no chunk's logits are built twice.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    dev, acc = hidden.device, acc_dtype(hidden.dtype)
    # The gradient accumulators, as ``need`` says: written by the first chunk (beta=0), then
    # accumulated in place, so no zero fill; with no rows (every target ignored) no chunk writes
    # them, and the weight and bias gradients are zeros.
    new = torch.zeros if n == 0 else torch.empty
    g_h = new(n, hidden.shape[1], dtype=acc, device=dev) if need[0] else None
    g_w = new(weight.shape, dtype=acc, device=dev) if need[1] else None
    g_b = new(vocab, dtype=acc, device=dev) if need[2] else None
    if n == 0:  # every target ignored (a hint is never asked)
        return g_h, g_w, g_b
    if grad_logp is None:
        grad_logp = torch.zeros(n, dtype=acc, device=dev)
    grad_logp = grad_logp.to(acc)
    # The probabilities get a buffer of their own when the entropy is computed or differentiated.
    two = grad_ent is not None or (logp_out is not None and entropy is not None)
    buf, buf2, low = logit_workspaces(min(chunk, n), vocab, hidden, two, reuse=cached, scratch=True)
    chunks = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    backward_cached = cached is not None and logp_out is None
    if backward_cached:
        chunks = chunks[-1:] + chunks[:-1]  # the chunk still in the workspace goes first
    for i, (s, e) in enumerate(chunks):
        h_c, t_c = hidden[s:e], targets[s:e, None]  # [c, H], [c, 1]
        z = buf[: e - s]  # [c, V]
        have_logp = backward_cached and i == 0
        if not have_logp:
            logits_into(z, h_c, weight, bias, inv_t, low)
        p = ge = None
        if logp_out is not None:
            # Row-fused in-place log-softmax: each 600 KB row stays in cache for its three passes.
            torch.log_softmax(z, dim=-1, out=z)
            logp_out[s:e] = z.gather(1, t_c).squeeze(1)
            have_logp = True
            if entropy is not None:
                p = torch.exp(z, out=buf2[: e - s])  # [c, V]
                entropy[s:e] = -torch.linalg.vecdot(p, z)
            if hint is not None:
                ent_c = None if entropy is None else entropy[s:e]
                grad_logp[s:e], ge = _call_hint(hint[0], hint[1][s:e], logp_out[s:e], ent_c)
                if ge is not None:
                    grad_ent[s:e] = ge
                    ge = ge[:, None]  # [c, 1]
        elif grad_ent is not None:
            ge = grad_ent[s:e, None].to(acc)  # [c, 1]
        if not any(need):  # the forward alone
            continue
        g = grad_logp[s:e, None]  # [c, 1]
        if ge is None:
            if p is None:
                p = z.exp_() if have_logp else torch.softmax(z, dim=-1, out=z)
            d = p.scatter_add_(1, t_c, torch.full_like(g, -1.0))  # P - onehot
            r = g * -inv_t  # [c, 1]
        else:
            if p is None:
                if not have_logp:
                    torch.log_softmax(z, dim=-1, out=z)
                p = torch.exp(z, out=buf2[: e - s])
            u = g + ge * entropy[s:e, None]  # [c, 1]
            d = torch.addcmul(u, z, ge, out=z).mul_(p).scatter_add_(1, t_c, -g)
            r = torch.full_like(g, -inv_t)
        # The chunk's share of the gradients from dz = r * D (D [c, V], r [c, 1]):
        # g_h[s:e] = r * (D @ W), g_w += D.T @ (r * h), g_b += D.T @ r; the first chunk writes
        # the accumulators (beta=0) instead of adding to them.
        beta = 0.0 if i == 0 else 1.0
        d_low = None
        if d.dtype != weight.dtype:
            # Low precision: round D once to the weight's dtype (as the naive path's logits
            # gradient is).
            d_low = low[: e - s].copy_(d) if low is not None else d.to(weight.dtype)
        if d_low is not None and _mm_fp32_out_supported(weight):
            # CUDA: both [c, V] matmuls on tensor cores with fp32 outputs. An fp32 D.T @ h here
            # ran as a SIMT sgemm: 62% of the kernel's time on an H100.
            if g_h is not None:
                g_h[s:e] = torch.mm(d_low, weight, out_dtype=torch.float32).mul_(r)
            if g_w is not None:
                hr = (h_c.to(r.dtype) * r).to(weight.dtype)  # [c, H]
                torch.addmm(g_w, d_low.t(), hr, out_dtype=torch.float32, beta=beta, out=g_w)
        else:
            if g_h is not None:
                g_h[s:e] = (d @ weight if d_low is None else (d_low @ weight).to(d.dtype)).mul_(r)
            if g_w is not None:
                g_w.addmm_(d.t(), h_c.to(d.dtype) * r, beta=beta)
        if g_b is not None:
            g_b.addmv_(d.t(), r.squeeze(1), beta=beta)
    return g_h, g_w, g_b


def _call_hint(
    hint: GradHint, rows: Tensor, logp: Tensor, ent: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """The hint's gradients for one chunk, checked; called with autograd enabled (the kernel runs
    inside an autograd forward, where it is off) on copies, so a hint may use ``autograd.grad``."""
    c = logp.shape[0]
    with torch.enable_grad():
        out = hint(rows, logp.clone(), None if ent is None else ent.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(
            "grad_hint must return a pair (d loss / d logprobs [c], d loss / d entropy [c] or "
            f"None), got {type(out).__name__}"
        )
    g, ge = out
    for name, t, optional in (("d loss / d logprobs", g, False), ("d loss / d entropy", ge, True)):
        if (t is None and optional) or (isinstance(t, Tensor) and t.shape == (c,)):
            continue
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"grad_hint's {name} must be a tensor of shape [{c}], got {got}")
    if ge is not None and ent is None:
        raise ValueError("grad_hint returned an entropy gradient but return_entropy is False")
    acc = logp.dtype
    return g.detach().to(acc), None if ge is None else ge.detach().to(acc)


def _agrees(actual: Tensor | None, hinted: Tensor | None) -> bool:
    """Whether autograd's upstream gradient is the one the hint gave (None = zeros)."""
    if actual is None or hinted is None:
        other = actual if hinted is None else hinted
        return other is None or not bool(other.any())
    if actual.numel() == 0:
        return True
    actual = actual.to(hinted.dtype)
    scale = torch.maximum(actual.abs().amax(), hinted.abs().amax())
    return bool(((actual - hinted).abs() <= _HINT_RTOL * scale).all())


class _FusedLinearLogprobs(torch.autograd.Function):
    """Autograd wrapper: the forward keeps the inputs, the entropy and one chunk's log-softmax;
    the backward recomputes the other chunks."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, bias, temperature, chunk, ignore_index, want_entropy, hint
    ):
        n = hidden.shape[0]
        idx = valid_rows(targets, weight.shape[0], ignore_index)
        h_v = hidden if idx is None else hidden.index_select(0, idx)  # [n_valid, H]
        t_v = targets if idx is None else targets.index_select(0, idx)
        inv_t = 1.0 / float(temperature)
        g = ctx.needs_input_grad  # which of hidden, weight, bias need a gradient
        need = ctx.need = (g[0], g[1], bias is not None and g[3])
        n_v = h_v.shape[0]
        logp_v = torch.empty(n_v, dtype=acc_dtype(hidden.dtype), device=hidden.device)
        ent_v = torch.empty_like(logp_v) if want_entropy else None
        sweep = hint is not None and any(need)
        hinted, workspace = (None, None), None
        if sweep:
            rows = idx if idx is not None else torch.arange(n, device=hidden.device)
            # The upstream gradients the hint gives, d loss / d logp and d loss / d entropy.
            hinted = torch.empty_like(logp_v), None if ent_v is None else torch.zeros_like(logp_v)
        elif any(need) and n_v:
            # Kept for the backward, which starts with the chunk the forward leaves in it.
            shape = (min(chunk, n_v), weight.shape[0])
            workspace = torch.empty(shape, dtype=logp_v.dtype, device=hidden.device)
        grads = chunked_sweep(
            h_v,
            weight,
            t_v,
            bias,
            inv_t,
            chunk,
            *hinted,
            ent_v,
            need if sweep else (False, False, False),
            logp_out=logp_v,
            cached=workspace,
            hint=(hint, rows) if sweep else None,
        )
        # Stored in the inputs' dtypes: no fp32 [V, H] copy survives to the backward.
        ctx.sweep = (hinted, _to_input_dtypes(grads, hidden, weight, bias, idx)) if sweep else None
        logp, ent = logp_v, ent_v
        if idx is not None:
            logp = logp_v.new_zeros(n).index_copy_(0, idx, logp_v)
            ent = None if ent_v is None else ent_v.new_zeros(n).index_copy_(0, idx, ent_v)
        ctx.save_for_backward(hidden, weight, targets, bias, idx, ent_v)
        ctx.inv_t, ctx.chunk = inv_t, chunk
        # Only held on to when a backward will follow (not for reference log-probs).
        ctx.workspace = workspace
        ctx.set_materialize_grads(False)
        return logp if ent is None else (logp, ent)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        hidden, weight, targets, bias, idx, ent_v = ctx.saved_tensors
        # The cached chunk is overwritten below: a second backward (retain_graph) recomputes it.
        cached, ctx.workspace = ctx.workspace, None
        # Released here so autograd can take the stored gradients over without copying them; a
        # second backward (retain_graph) takes the recomputing path.
        sweep, ctx.sweep = ctx.sweep, None
        need = ctx.need
        if (grad_logp is None and grad_ent is None) or not any(need):
            return (None,) * 9
        if idx is not None:
            h_v, t_v = hidden.index_select(0, idx), targets.index_select(0, idx)
            grad_logp = None if grad_logp is None else grad_logp.index_select(0, idx)
            grad_ent = None if grad_ent is None else grad_ent.index_select(0, idx)
        else:
            h_v, t_v = hidden, targets
        if sweep is not None:
            hinted, grads = sweep
            if _agrees(grad_logp, hinted[0]) and _agrees(grad_ent, hinted[1]):
                return (*grads[:2], None, grads[2], None, None, None, None, None)
            warnings.warn(
                "fused_linear_logprobs: the gradient reaching the log-probs differs from the "
                "one grad_hint gave in the forward; recomputing it exactly (slower). Is the loss "
                "a per-token function of the log-probs, and the hint that loss's gradient?",
                stacklevel=2,
            )
            del sweep, grads
        g_h, g_w, g_b = chunked_sweep(
            h_v,
            weight,
            t_v,
            bias,
            ctx.inv_t,
            ctx.chunk,
            grad_logp,
            grad_ent,
            ent_v,
            need,
            cached=cached,
        )
        g_h, g_w, g_b = _to_input_dtypes((g_h, g_w, g_b), hidden, weight, bias, idx)
        return g_h, g_w, None, g_b, None, None, None, None, None


def _to_input_dtypes(
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    idx: Tensor | None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Valid-row gradients (fp32/64) -> gradients of the inputs: hidden's scattered to all
    rows (0 at ignored ones), each in its input's dtype."""
    g_h, g_w, g_b = grads
    if g_h is not None:
        if idx is not None:
            g_h = g_h.new_zeros(hidden.shape).index_copy_(0, idx, g_h)
        g_h = g_h.to(hidden.dtype)
    g_w = None if g_w is None else g_w.to(weight.dtype)
    g_b = None if g_b is None else g_b.to(bias.dtype)
    return g_h, g_w, g_b


def liger_available(hidden: Tensor) -> bool:
    """Whether Liger-Kernel's Triton path can run on ``hidden`` (CUDA, Liger and Triton)."""
    if not hidden.is_cuda:
        return False
    try:  # Liger's module imports Triton
        from liger_kernel.ops.fused_linear_cross_entropy import (  # noqa: F401
            LigerFusedLinearCrossEntropyFunction,
        )
    except Exception:  # an import error or a broken Triton install: fall back to torch
        return False
    return True


def select_backend(
    hidden: Tensor,
    *,
    return_entropy: bool = False,
    backend: Backend = "auto",
    grad_hint: bool = False,
) -> str:
    """The implementation that :func:`fused_linear_logprobs` runs: ``"torch"`` or ``"liger"``.

    ``"auto"`` picks Liger-Kernel's Triton fused linear cross-entropy on CUDA when it is installed
    and neither entropy nor a ``grad_hint`` is asked for (it has neither), else the chunked torch
    path. A forced ``"liger"`` that cannot run raises instead of silently falling back.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    usable = liger_available(hidden) and not return_entropy and not grad_hint
    if backend == "liger" and not usable:
        why = (
            "return_entropy=True"
            if return_entropy
            else "grad_hint is given"
            if grad_hint
            else "it needs CUDA, Triton and liger-kernel"
        )
        raise ValueError(f"backend='liger' cannot run here: {why}; use backend='torch' or 'auto'")
    return "liger" if usable else "torch"


def liger_flce(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    ignore_index: int,
    reduction: str,
) -> Tensor:
    """Liger's fused linear cross-entropy: per-token ``-log p`` [N] (``"none"``) or its sum."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if temperature != 1.0:
        # (h W^T + b) / T == (h / T) W^T + b / T: scale the small operands, not the logits.
        hidden = hidden / temperature
        bias = None if bias is None else bias / temperature
    accum = torch.float32 if hidden.dtype != torch.float32 else None
    # Positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
    # label_smoothing, reduction, softcap, return_z_loss, accum_dtype. With "none" Liger
    # recomputes in backward; with "sum" it computes the gradients in the forward.
    return LigerFusedLinearCrossEntropyFunction.apply(
        hidden, weight, targets, bias, None, ignore_index, 0.0, 0.0, reduction, None, False, accum
    )[0]


def fused_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    backend: Backend = "auto",
    grad_hint: GradHint | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: final hidden states [N, H] (fp32, bf16 or fp16).
        weight: LM-head weight [V, H], same dtype as ``hidden``.
        targets: token ids [N]; rows equal to ``ignore_index`` give 0 (log-prob and entropy),
            receive no gradient and cost no compute.
        bias: optional LM-head bias [V].
        temperature: divides the logits (sampling temperature of the rollout).
        chunk_size: rows per chunk; default :func:`default_chunk_size` (a 256 MiB workspace).
        return_entropy: also return the differentiable entropy ``-sum_v p log p`` [N].
        backend: ``"auto"``, ``"torch"`` or ``"liger"``; see :func:`select_backend`.
        grad_hint: when the loss's gradient with respect to each log-prob (and entropy) follows
            from that row's values alone (a per-token function of the log-probs, summed with
            fixed weights: the PPO/CPGD policy loss, KL in the loss, the entropy bonus), a
            :data:`GradHint` that returns it. The gradients are then computed chunk by chunk
            during the forward (3 vocabulary-sized matmuls per chunk instead of 4) and the
            backward returns them. If the gradient autograd delivers in backward differs from
            the hint's (beyond fp32 rounding), the backward recomputes exactly, with a warning.
            Ignored when no input needs a gradient; runs on the torch backend.

    Returns:
        log-probs [N] in fp32, or ``(log-probs, entropy)``. Gradients flow to ``hidden``,
        ``weight`` and ``bias`` in their own dtypes; low-precision inputs accumulate in fp32.
    """
    check_inputs(hidden, weight, targets, bias, temperature, chunk_size)
    if grad_hint is not None and not callable(grad_hint):
        raise ValueError(f"grad_hint must be callable or None, got {type(grad_hint).__name__}")
    chosen = select_backend(
        hidden, return_entropy=return_entropy, backend=backend, grad_hint=grad_hint is not None
    )
    if chosen == "liger":
        nll = liger_flce(hidden, weight, targets, bias, temperature, ignore_index, "none")
        return -nll  # [N] fp32, 0 at ignored targets
    chunk = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0])
    if not torch.is_grad_enabled():
        grad_hint = None  # no backward will come (the Function sees its inputs' flags only)
    return _FusedLinearLogprobs.apply(
        hidden,
        weight,
        targets.long(),
        bias,
        float(temperature),
        chunk,
        ignore_index,
        return_entropy,
        grad_hint,
    )
