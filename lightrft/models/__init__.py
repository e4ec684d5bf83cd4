"""Loading actor, critic and reward models and their tokenizers from HF directories."""

from lightrft.models.loading import load_causal_lm, load_tokenizer
from lightrft.models.parallel import parallelize
from lightrft.models.tiny import make_tiny_model

__all__ = ["load_causal_lm", "load_tokenizer", "make_tiny_model", "parallelize"]
