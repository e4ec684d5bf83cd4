"""A critic (value model) for PPO with GAE: an HF causal-LM backbone whose LM head is replaced
by a scalar value head, so loading, ``parallelize`` and ``forward_on_hidden`` treat it exactly
like the actor."""

from __future__ import annotations

from torch import nn


def with_value_head(model: nn.Module) -> nn.Module:
    """``model`` with its LM head replaced by ``hidden -> 1`` (zero-initialised: values start
    at 0); a ``prepare`` step of ``load_parallel``, before sharding."""
    hidden = model.config.hidden_size
    param = next(model.parameters())
    # A meta-device body (sharded loading) gets a real head: it is in no checkpoint, and
    # fully_shard moves it to the mesh's device.
    device = "cpu" if param.is_meta else param.device
    head = nn.Linear(hidden, 1, bias=True, device=device, dtype=param.dtype)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(head)
    return model
