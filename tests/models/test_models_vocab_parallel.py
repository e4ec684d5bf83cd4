"""Vocabulary-parallel tables of sharded scoring models: what is refused, and how the logits are
chunked (the collective paths run on gloo in tests/rewards/test_rewards_sharded_rm.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightrft.models.parallel import parallelize
from lightrft.models.vocab_parallel import (
    LOGITS_WORKSPACE,
    logits_chunk_rows,
    shard_vocab_tables,
    vocab_rows,
    vocab_tables,
)


def test_logits_are_chunked_to_the_workspace_in_multiples_of_64_rows():
    assert logits_chunk_rows(1000, 8000) == LOGITS_WORKSPACE // 8000 // 64 * 64 == 256
    assert logits_chunk_rows(10, 8000) == 10  # never more than the rows
    # rounded down, so a chunk never passes the workspace (the fused kernel rounds to nearest)
    assert logits_chunk_rows(10**5, 12000) == LOGITS_WORKSPACE // 12000 // 64 * 64 == 128
    assert logits_chunk_rows(10**6, 10**7) == 64  # a huge slice: still 64 rows at a time
    assert logits_chunk_rows(0, 5) == 1  # no rows: one empty chunk size, not zero


def test_a_plain_weight_has_no_vocabulary_rows():
    assert vocab_rows(torch.zeros(4, 2)) is None


def _tiny(tmp_path, **kw):
    from lightrft.models import load_model
    from lightrft.tasks import make_tiny_model

    return load_model(make_tiny_model(tmp_path / "m", layers=1, hidden=32, **kw))


def test_the_tables_of_a_causal_lm_and_a_refused_embedding_class(tmp_path):
    model = _tiny(tmp_path)
    embedding, head = vocab_tables(model)
    assert embedding is model.model.embed_tokens and head is model.lm_head

    class Scaled(nn.Embedding):  # e.g. Gemma 3's: its forward is not a plain lookup
        pass

    model.model.embed_tokens = Scaled(*embedding.weight.shape)
    with pytest.raises(ValueError, match="plain nn.Embedding input embedding, got Scaled"):
        vocab_tables(model)


def test_scoring_layout_needs_sharding_over_a_1d_mesh(tmp_path):
    model = _tiny(tmp_path).requires_grad_(False)
    with pytest.raises(ValueError, match="scoring lays a model out over the ranks"):
        parallelize(model, shard=False, scoring=True)
    with pytest.raises(ValueError, match="over a 1-D device mesh"):
        shard_vocab_tables(model, None)
