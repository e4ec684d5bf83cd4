"""Fused linear log-prob / entropy kernels (installed as ``lightrft.kernels``; never import this
folder as a top-level ``kernels``, which is Hugging Face's kernel-hub package name).

- :func:`fused_linear_logprobs`: log-probs (and entropy) of targets from hidden states and the
  LM-head weight, chunked, with a recomputing backward; Liger-Kernel's Triton path on CUDA.
- :func:`fused_linear_cross_entropy`: the SFT loss on hidden states.
- ``grad_hint`` / :func:`response_grad_hint`: a per-token loss's gradients computed in the
  kernel's forward (the GRPO recipe's training step).
- :func:`causal_lm_token_logprobs`, :func:`causal_lm_cross_entropy`: next-token log-probs / the
  SFT loss of an HF causal LM (plain or FSDP2); :func:`forward_on_hidden` for other heads.

See docs/kernels.md.
"""

from .hf import causal_lm_cross_entropy, causal_lm_token_logprobs, forward_on_hidden
from .hints import response_grad_hint
from .logprobs import (
    BACKENDS,
    GradHint,
    default_chunk_size,
    fused_linear_logprobs,
    select_backend,
)
from .losses import fused_linear_cross_entropy

__all__ = [
    "BACKENDS",
    "GradHint",
    "causal_lm_cross_entropy",
    "causal_lm_token_logprobs",
    "default_chunk_size",
    "forward_on_hidden",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
    "response_grad_hint",
    "select_backend",
]
