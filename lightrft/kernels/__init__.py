"""Fused linear log-prob / entropy kernels (installed as ``lightrft.kernels``; never import this
folder as a top-level ``kernels``, which is Hugging Face's kernel-hub package name).

- :func:`fused_linear_logprobs`: log-probs (and entropy) of targets from hidden states and the
  LM-head weight, chunked, with a recomputing backward; Liger-Kernel's Triton path on CUDA.
- :func:`fused_linear_cross_entropy`: the SFT loss on hidden states.
- ``grad_hint`` / :func:`response_grad_hint`: a per-token loss's gradients computed in the
  kernel's forward (the GRPO recipe's training step).

The HF forward funnel that runs these kernels inside a model's forward lives in
:mod:`lightrft.models.forward`.

See docs/kernels.md.
"""

from .hints import response_grad_hint
from .logprobs import GradHint, default_chunk_size, fused_linear_logprobs, select_backend
from .losses import fused_linear_cross_entropy

__all__ = [
    "GradHint",
    "default_chunk_size",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
    "response_grad_hint",
    "select_backend",
]
