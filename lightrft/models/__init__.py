"""Loading actor, critic and reward models and their tokenizers from HF directories."""

from lightrft.models.loading import load_causal_lm, load_tokenizer
from lightrft.models.parallel import parallelize
from lightrft.models.tiny import ensure_tiny_model, make_tiny_model

__all__ = [
    "ensure_tiny_model",
    "load_causal_lm",
    "load_tokenizer",
    "make_tiny_model",
    "parallelize",
]
