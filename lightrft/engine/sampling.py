"""Batched token sampling with per-row parameters and a counter-based random stream per row.

Every row of a decoding batch has its own temperature, top-k, top-p and seed. Randomness comes
from a stateless integer hash of ``(row seed, step)`` rather than from a ``torch.Generator``:
a row draws the same uniform at the same step whatever else is in the batch and on any device,
so a seeded request reproduces exactly, and the whole batch is sampled with a few vector ops.
A token is drawn by inverting the cumulative distribution at that uniform.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: decorrelates the words fed to the hash


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32) without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' "lowbias32") on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_words(first: torch.Tensor, *rest: torch.Tensor | int) -> torch.Tensor:
    """Hash uint32 words (held in int64 tensors or ints, broadcast) into one uint32 each."""
    h = mix32((first & _MASK32) ^ _GOLDEN)
    for w in rest:
        h = mix32(((h + _GOLDEN) & _MASK32) ^ (w & _MASK32))
    return h


def row_seeds(request_seed: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """A 63-bit seed per sample of a request: ``[R]`` int64 from ``[R]`` seeds and indices."""
    hi = request_seed >> 32  # the seed's high word (hash_words keeps the low one of each)
    a = hash_words(request_seed, hi, sample_index, 1)
    b = hash_words(request_seed, hi, sample_index, 2)
    return ((a & 0x7FFFFFFF) << 32) | b


def uniforms(seed: torch.Tensor, step: int) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row for decoding step ``step``: ``[A]``."""
    h = hash_words(seed, seed >> 32, step)  # the seed's low and high words
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature-scale, then keep the top-k, then the top-p nucleus; the rest become -inf.

    ``logits``: [A, V] float32. ``temperature``: [A] (> 0). ``top_k``: [A] int64, values < 1 or
    >= V keep everything. ``top_p``: [A] in (0, 1]; 1 keeps everything. The order (temperature,
    top-k, top-p on the renormalised top-k) is vLLM's and Hugging Face's.
    """
    # x / 1 == x bitwise: the common T=1 batch skips a pass over [A, V].
    scaled = logits if bool((temperature == 1).all()) else logits / temperature[:, None]  # [A, V]
    vocab = scaled.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if not bool(use_k.any()) and not bool(use_p.any()):
        return scaled
    vals, idx = scaled.sort(dim=-1, descending=True)  # [A, V]
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(use_k, top_k, vocab)
    vals = vals.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = vals.softmax(dim=-1)
    # Mass strictly before each token; the most likely token is always kept since top_p > 0.
    before = probs.cumsum(dim=-1) - probs
    p = torch.where(use_p, top_p, float("inf")).to(before.dtype)
    vals = vals.masked_fill(before >= p[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, idx, vals)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    suppress: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return ``(tokens [A], logprobs [A])``.

    Rows with temperature 0 take the argmax and report its log-prob at temperature 1 (the
    point-mass log-prob, 0, would tell a trainer nothing); other rows invert the CDF of the
    processed distribution at ``u`` ([A] float64 in (0, 1)). Log-probs are under the processed
    distribution, i.e. what the trainer's temperature-scaled log-softmax gives when top-k / top-p
    are off.

    ``suppress``: token ids ([S]) never drawn (a VLM's image placeholders). They are removed
    from the draw (the rest renormalised) but not from the reported log-probs, which stay the
    model's own, as the trainer computes them.
    """
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    masked = process_logits(logits, temp, top_k, top_p)  # [A, V]
    logp = masked.log_softmax(dim=-1)  # [A, V]
    suppressing = suppress is not None and suppress.numel() > 0
    # float64 CDF: resolves tokens far below fp32's 6e-8 steps near 1. In place where the
    # values are the same bits (a fresh [A, V] float64 tensor per op costs page faults on CPU).
    probs = logp.double()  # [A, V]
    if suppressing:
        probs.index_fill_(-1, suppress, float("-inf"))
    cdf = probs.exp_().cumsum_(dim=-1)  # [A, V]
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [A, 1]
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    tokens = drawn.clamp_(max=logits.shape[-1] - 1)  # [A]
    if bool(greedy.any()):  # the argmax is a pass over [A, V]: only when a row is greedy
        pick_from = logits.index_fill(-1, suppress, float("-inf")) if suppressing else logits
        tokens = torch.where(greedy, pick_from.argmax(dim=-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
) -> torch.Tensor:
    """Log-probs of ``targets`` ([L]) under processed ``logits`` ([L, V]) with one setting."""
    n = logits.shape[0]
    temp = temperature if temperature > 0 else 1.0
    masked = process_logits(
        logits.float(),
        torch.full((n,), temp, device=logits.device),
        torch.full((n,), top_k, dtype=torch.int64, device=logits.device),
        torch.full((n,), top_p, device=logits.device),
    )
    return masked.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
