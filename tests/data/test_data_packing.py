"""Packing and padding: layout, determinism, and logits equal to each sample run alone."""

import pytest
import torch

from lightrft.data import (
    IGNORE_INDEX,
    PackCollator,
    PackedDataset,
    PadCollator,
    SFTDataset,
    StepCollator,
    pack_indices,
    pack_or_pad_collator,
    packed_sft_dataset,
    plan_micro_batches,
)


def _sample(ids, loss_from=1):
    ids = torch.tensor(ids)
    labels = ids.clone()
    labels[:loss_from] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


# ------------------------------------------------------------------------------ pack_indices


def test_pack_indices_fits_covers_and_is_deterministic():
    lengths = [5, 9, 3, 7, 2, 8, 6, 4, 1, 10] * 5
    rows = pack_indices(lengths, 12, seed=3)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 12 for r in rows)
    assert rows == pack_indices(lengths, 12, seed=3)
    assert rows != pack_indices(lengths, 12, seed=4)
    # Best fit wastes little: within one row of the lower bound here.
    assert len(rows) <= -(-sum(lengths) // 12) + 1


def test_pack_indices_in_order_best_fit():
    # In order: 6 opens row 0, 6 opens row 1 (does not fit in 0's 4 free), 4 fills row 0,
    # 3 goes to row 1 (fullest that fits), 3 opens row 2.
    assert pack_indices([6, 6, 4, 3, 3], 10, shuffle=False) == [[0, 2], [1, 3], [4]]


def test_pack_indices_rejects_too_long():
    with pytest.raises(
        ValueError,
        match=r"1 samples are longer than max_tokens=10, the first is sample 1 with 11 tokens",
    ):
        pack_indices([3, 11], 10)


# ------------------------------------------------------------------------------ collators


def test_pack_collator_one_row_positions_reset_and_pads():
    batch = PackCollator(pad_id=0, pad_to_multiple_of=8)([_sample([5, 6, 7]), _sample([8, 9])])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100]]
    assert int(batch["num_loss_tokens"]) == 3
    assert "attention_mask" not in batch


def test_pack_collator_max_tokens_opens_rows_in_order():
    items = [_sample([1] * 4), _sample([2] * 3), _sample([3] * 2), _sample([4] * 5)]
    batch = PackCollator(pad_id=0, max_tokens=7)(items)
    assert batch["input_ids"].tolist() == [
        [1, 1, 1, 1, 2, 2, 2],
        [3, 3, 4, 4, 4, 4, 4],
    ]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="an item has 8 tokens, more than the collator's"):
        PackCollator(pad_id=0, max_tokens=7)([_sample([1] * 8)])


def test_pad_collator_right_pads_with_mask():
    batch = PadCollator(pad_id=0)([_sample([5, 6, 7]), _sample([8, 9], loss_from=0)])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, 9, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert int(batch["num_loss_tokens"]) == 4


def test_pad_collator_refuses_packed_rows():
    row = {**_sample([1, 2, 3]), "position_ids": torch.tensor([0, 0, 1])}
    with pytest.raises(ValueError, match="use packing=true"):
        PadCollator(pad_id=0)([row])


def test_pack_or_pad_collator_picks_and_checks(tok):
    assert isinstance(pack_or_pad_collator(tok, packing=True), PackCollator)
    pad = pack_or_pad_collator(tok)
    assert isinstance(pad, PadCollator) and pad.pad_id == tok.pad_token_id
    with pytest.raises(ValueError, match="max_tokens applies only with packing=true"):
        pack_or_pad_collator(tok, max_tokens=64)


# ------------------------------------------------------------------------------ PackedDataset


def _recs(n):
    return [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(n)]


def test_packed_dataset_rows(tok):
    sft = SFTDataset(tok, records=_recs(12))
    packed = PackedDataset(sft, max_tokens=100, seed=1)
    assert packed.stats["packed_rows"] == len(packed) < len(sft)
    assert packed.stats["samples"] == 12 and 0 < packed.stats["pack_fill"] <= 1
    seen = []
    for r in range(len(packed)):
        row = packed[r]
        n = len(row["input_ids"])
        assert n <= 100 and len(row["labels"]) == len(row["position_ids"]) == n
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
        ends = starts[1:] + [n]
        for i, a, b in zip(packed.rows[r], starts, ends, strict=True):
            assert torch.equal(row["input_ids"][a:b], sft[i]["input_ids"])
            assert torch.equal(row["labels"][a:b], sft[i]["labels"])
            seen.append(i)
    assert sorted(seen) == list(range(12))
    assert PackedDataset(sft, max_tokens=100, seed=1).rows == packed.rows


def test_packed_dataset_too_long_sample_names_it(tok):
    sft = SFTDataset(tok, records=_recs(3) + [{"prompt": "x" * 50, "completion": "y"}])
    with pytest.raises(
        ValueError,
        match=r"1 samples are longer than max_tokens=40, the first is "
        r"sample 3 \(records\[3\]\)",
    ):
        PackedDataset(sft, max_tokens=40)


def test_packed_sft_dataset_defaults_max_length(tok):
    recs = _recs(4) + [{"prompt": "x" * 50, "completion": "y"}]
    packed = packed_sft_dataset(tok, records=recs, max_tokens=40)
    assert packed.stats["dropped"] == 1 and packed.stats["samples"] == 4


# ------------------------------------------------------------------------------ model equivalence


def _alone_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0]  # [L, V]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_logits_equal_samples_alone(tok, tiny_model_dir, tiny_llama_dir, arch, attn):
    from lightrft.models import load_causal_lm

    path = tiny_model_dir if arch == "qwen2" else tiny_llama_dir
    model = load_causal_lm(path, dtype="float32", device="cpu", attn_implementation=attn).eval()
    sft = SFTDataset(tok, records=_recs(3) + [{"prompt": "a", "completion": "b"}])
    items = [sft[i] for i in range(len(sft))]
    batch = PackCollator(tok.pad_token_id, max_tokens=70, pad_to_multiple_of=16)(items)
    assert batch["input_ids"].shape[0] == 2  # two rows, both with padding at the end
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits  # [R, T, V]
    r, a = 0, 0
    for x in items:
        n = len(x["input_ids"])
        if a + n > batch["input_ids"].shape[1] or (batch["position_ids"][r, a] != 0):
            r, a = r + 1, 0
        assert torch.equal(batch["input_ids"][r, a : a + n], x["input_ids"])
        torch.testing.assert_close(
            logits[r, a : a + n], _alone_logits(model, x["input_ids"]), atol=1e-5, rtol=1e-5
        )
        a += n
    # Without position resets the second sample would see the first: the check above can fail.
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"][:1], use_cache=False).logits[0]
    n0, n1 = len(items[0]["input_ids"]), len(items[1]["input_ids"])
    alone = _alone_logits(model, items[1]["input_ids"])
    assert not torch.allclose(leaky[n0 : n0 + n1], alone, atol=1e-3)


def test_padded_batch_logits_equal_samples_alone(tok, tiny_model_dir):
    from lightrft.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir, dtype="float32", device="cpu").eval()
    sft = SFTDataset(tok, records=_recs(3) + [{"prompt": "a", "completion": "b"}])
    items = [sft[i] for i in range(len(sft))]
    batch = PadCollator(tok.pad_token_id)(items)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
    for b, x in enumerate(items):
        n = len(x["input_ids"])
        torch.testing.assert_close(
            logits[b, :n], _alone_logits(model, x["input_ids"]), atol=1e-5, rtol=1e-5
        )


def test_pack_collator_keeps_packed_rows_as_rows(tok):
    packed = PackedDataset(SFTDataset(tok, records=_recs(12)), max_tokens=100, seed=0)
    rows = [packed[0], packed[1]]
    batch = pack_or_pad_collator(tok, packing=True)(rows)
    assert batch["input_ids"].shape[0] == 2
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        assert torch.equal(batch["input_ids"][r, :n], row["input_ids"])
        assert torch.equal(batch["position_ids"][r, :n], row["position_ids"])
        assert (batch["labels"][r, n:] == IGNORE_INDEX).all()


# ------------------------------------------------------------------------------ micro-batches


def test_plan_micro_batches_respects_rows_and_token_budgets():
    lengths = [5, 5, 6, 10, 12, 30]
    rows = list(range(6))
    assert plan_micro_batches(rows, lengths, 4) == [[0, 1, 2, 3], [4, 5]]  # rows only
    # Packed: the sum of lengths; padded: rows x the longest (padding is paid for).
    assert plan_micro_batches(rows, lengths, 8, 20, packing=True) == [[0, 1, 2], [3], [4], [5]]
    assert plan_micro_batches(rows, lengths, 8, 20) == [[0, 1, 2], [3], [4], [5]]
    assert plan_micro_batches(rows, lengths, 8, 24, packing=True) == [[0, 1, 2], [3, 4], [5]]
    assert plan_micro_batches(rows, lengths, 8, 24) == [[0, 1, 2], [3, 4], [5]]
    assert plan_micro_batches(rows, lengths, 8, 22, packing=True) == [[0, 1, 2], [3, 4], [5]]
    assert plan_micro_batches(rows, lengths, 8, 22) == [[0, 1, 2], [3], [4], [5]]  # 2 x 12 > 22
    assert plan_micro_batches([], lengths, 4, 10) == []
    # Every row lands exactly once, in the order given.
    assert plan_micro_batches([5, 0, 3], lengths, 2, 1000) == [[5, 0], [3]]


def test_step_collator_cuts_a_step_by_rows_or_by_a_sorted_token_budget():
    items = [_sample(list(range(1, n + 1))) for n in (9, 3, 8, 2, 4)]
    pad = StepCollator(PadCollator(0), max_rows=2)
    # Rows only: the loader's order, groups of max_rows, each micro-batch padded on its own.
    batches = pad(items)
    assert [b["input_ids"].shape for b in batches] == [(2, 9), (2, 8), (1, 4)]
    # A token budget sorts by length first: short samples share a micro-batch, long ones get
    # their own, and every micro-batch stays within the budget (rows x longest when padded).
    budget = StepCollator(PadCollator(0), max_rows=8, max_tokens=9)
    batches = budget(items)
    assert [tuple(b["input_ids"].shape) for b in batches] == [(2, 3), (1, 4), (1, 8), (1, 9)]
    assert all(b["input_ids"].numel() <= 9 for b in batches)
    # Packed, the budget counts real tokens; nothing is lost or repeated.
    packed = StepCollator(PackCollator(0), max_rows=8, max_tokens=9, packing=True)(items)
    assert [int((b["position_ids"] == 0).sum()) for b in packed] == [3, 1, 1]
    assert sum(b["num_loss_tokens"] for b in packed) == sum(len(x["input_ids"]) - 1 for x in items)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        StepCollator(PadCollator(0), max_rows=2, max_tokens=0)
