"""The typed micro-batch (packed and padded layouts, the response gather), the rank's
micro-batch plan, epoch_batches and a reward model's held-out statistics, with hand-derived
values."""

from __future__ import annotations

import torch
from test_rollout_batch import make_batch

from lightrft.algorithms.reward_losses import PreferenceStats
from lightrft.data import build_dataloader, epoch_batches
from lightrft.distributed import DistInfo
from lightrft.rollout.micro import build_micro_batch, rank_micro_batches

PAD = 0


def test_gathered_targets_are_the_responses_in_both_layouts():
    # Prompts [1], [1, 1], [1, 1, 1]; responses of 2, 3 and 1 tokens.
    batch = make_batch([[5, 6], [7, 8, 9], [4]])
    for packing in (True, False):
        mb = build_micro_batch(batch, [0, 1, 2], PAD, packing=packing)
        assert mb.tokens == (1 + 2) + (2 + 3) + (3 + 1)
        got = mb.gather(mb.targets)  # [b, R]: the next token at each response position
        assert got.tolist() == [[5, 6, 0], [7, 8, 9], [4, 0, 0]], packing
        assert mb.mask.sum(1).tolist() == [2, 3, 1]
        rows = 1 if packing else 3
        assert mb.input_ids.shape[0] == rows
        assert (mb.position_ids is None) != packing  # positions restart per sample, packed
        assert (mb.attention_mask is None) == packing


def test_an_empty_rank_runs_a_dummy_micro_batch():
    mb = build_micro_batch(make_batch([[5]]), [], PAD, packing=False)
    assert mb.tokens == 0 and not mb.mask.any()
    assert mb.gather(torch.ones(1, 1)).tolist() == [[0.0]]


def test_each_rank_gets_every_world_size_th_row_shortest_first():
    lengths = [5, 1, 4, 2, 3, 6]
    plans = [
        rank_micro_batches(list(range(6)), lengths, 2, None, False, DistInfo(r, 2, r, "cpu"))
        for r in (0, 1)
    ]
    assert plans[0] == [[4, 2], [0]]  # rows 0, 2, 4 (lengths 5, 4, 3), shortest first
    assert plans[1] == [[1, 3], [5]]
    # More micro-batches than rows on a rank: empty ones keep the collectives paired.
    lone = rank_micro_batches([0], [3], 1, None, False, DistInfo(1, 2, 1, "cpu"))
    assert lone == [[]]


def test_epoch_batches_moves_on_and_reseeds_each_epoch():
    loader = build_dataloader(list(range(4)), batch_size=2, shuffle=True, seed=3)
    it = epoch_batches(loader, 0)
    first = [next(it) for _ in range(4)]
    assert [e for e, _ in first] == [0, 0, 1, 1]
    assert sorted(x for _, b in first[:2] for x in b.tolist()) == [0, 1, 2, 3]
    assert [b.tolist() for _, b in first[:2]] != [b.tolist() for _, b in first[2:]]


def test_preference_stats_per_head_by_hand():
    stats = PreferenceStats(["helpful", "cost"])
    raw = torch.tensor([[2.0, 1.0], [0.0, 1.0], [3.0, -1.0]])  # [B, K]: chosen, rejected
    valid = torch.ones(3, 2, dtype=torch.bool)
    head = torch.tensor([0, 0, 1])
    stats.add(raw, raw, valid, head)
    metrics, per_head = stats.metrics()
    assert metrics["eval/accuracy/helpful"] == 0.5  # 2 > 1 right, 0 < 1 wrong
    assert metrics["eval/margin/helpful"] == 0.0  # (1 + -1) / 2
    assert metrics["eval/accuracy/cost"] == 1.0
    assert metrics["eval/reward_mean/helpful"] == 1.0  # (2 + 1 + 0 + 1) / 4
    assert metrics["eval/accuracy"] == 2 / 3
    assert per_head["cost"] == {"mean": 1.0, "std": 2.0, "pairs": 1}
