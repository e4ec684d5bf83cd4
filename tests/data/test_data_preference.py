"""Preference data: formats, the bad-input rules (file, line, field), collation, arithmetic pairs."""

import json

import pytest
import torch
from conftest import write_jsonl

from lightrft.data import DataError, PreferenceCollator, PreferenceDataset
from lightrft.data.preference import render_for_scoring
from lightrft.tasks.arith import ensure_arith_preferences, near_miss, write_arith_dataset


def test_formats_and_rendering(tok, tmp_path):
    recs = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": 1.5, "head": "helpful"},
        {
            "chosen": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go"}],
        },
        {
            "prompt": "pick",
            "chosen": "a",
            "rejected": ["b", "c"],
            "rejected_safe": [True, False],
            "chosen_safe": True,
        },
    ]
    ds = PreferenceDataset(tok, write_jsonl(tmp_path / "p.jsonl", recs))
    assert len(ds) == 3 and ds.stats["pairs"] == 3 and ds.stats["identical"] == 0
    it = ds[0]
    assert it["margin"] == 1.5 and it["head"] == "helpful" and it["safe"] == [0, 0]
    text = render_for_scoring(tok, "2+2?", "4")
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert it["sequences"][0].tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert len(ds[2]["sequences"]) == 3 and ds[2]["safe"] == [1, 1, -1]
    # Raw text: prompt + response, as RewardModel(chat_template=False) scores it.
    raw = PreferenceDataset(tok, records=recs[:1], apply_chat_template=False)
    assert tok.decode(raw[0]["sequences"][1]) == "2+2?5"
    # Where each response starts (what the likelihood pooling scores): after the assistant
    # header with the template, after the prompt without; with no prompt, all but the first
    # token (which nothing predicts).
    chosen = it["sequences"][0].tolist()
    assert tok.decode(chosen[it["starts"][0] :]) == "4<|im_end|>\n"
    assert tok.decode(raw[0]["sequences"][1][raw[0]["starts"][1] :]) == "5"
    assert ds[1]["starts"] == [1, 1]
    assert "where" not in ds[0] and ds.where(1).endswith("line 2")


def test_bad_inputs_name_file_line_and_field(tok, tmp_path):
    def fails(recs, match, **kw):
        with pytest.raises(DataError, match=match):
            PreferenceDataset(tok, write_jsonl(tmp_path / "bad.jsonl", recs), **kw)

    fails(
        [{"chosen": "a", "rejected": "b"}, {"chosen": "a"}],
        r"bad.jsonl line 2: missing field 'rejected'",
    )
    fails([{"chosen": 3, "rejected": "b"}], r"line 1: field 'chosen' must be str or list")
    fails(
        [{"chosen": "a", "rejected": "b", "margin": "big"}],
        r"line 1: field 'margin' must be a number",
    )
    fails([{"chosen": "a", "rejected": "b", "head": 1}], r"field 'head' must be a string")
    fails([{"chosen": "a", "rejected": "b", "chosen_safe": "yes"}], r"'chosen_safe' must be true")
    fails([{"chosen": "a", "rejected": ["b", "c"], "rejected_safe": [True]}], r"2 rejected")
    fails(
        [{"chosen": "a", "rejected": "b", "images": ["x.png"]}],
        r"line 1: the record has images.*field 'images'",
    )
    fails([{"chosen": [{"role": "user"}], "rejected": "b"}], r"chosen\[0\] has no string 'content'")
    fails([{"chosen": "a", "rejected": "a"}], r"empty dataset.*1 identical")
    (tmp_path / "broken.jsonl").write_text('{"chosen": "a", "rejected": "b"}\n{"chosen": \n')
    with pytest.raises(DataError, match=r"broken.jsonl line 2: malformed JSON"):
        PreferenceDataset(tok, tmp_path / "broken.jsonl")


def test_identical_and_overlong_are_counted(tok, caplog):
    recs = [
        {"prompt": "p", "chosen": "same", "rejected": "same"},  # dropped: identical
        {"prompt": "p", "chosen": "a", "rejected": ["a", "b"]},  # one identical candidate dropped
        {"prompt": "p", "chosen": "x" * 40 + "1", "rejected": "x" * 40 + "2"},  # same first 20
        {"prompt": "p", "chosen": "a" * 30, "rejected": "b"},  # truncated
        {"prompt": "p", "chosen": "ok", "rejected": "no"},
    ]
    ds = PreferenceDataset(tok, records=recs, apply_chat_template=False, max_length=20)
    assert ds.stats == {"records": 5, "pairs": 3, "identical": 2, "truncated": 1, "dropped": 1}
    assert "max_length=20 truncated (sequences) 1 and dropped 1 of 5 records" in caplog.text
    assert len(ds[0]["sequences"]) == 2  # "a" vs "b"
    assert all(len(s) <= 20 for it in ds for s in it["sequences"])
    drop = PreferenceDataset(
        tok, records=recs, apply_chat_template=False, max_length=20, truncation="drop"
    )
    assert drop.stats["dropped"] == 2 and drop.stats["truncated"] == 0 and len(drop) == 2


def _items():
    def t(*xs):
        return torch.tensor(xs)

    return [
        {
            "sequences": [t(5, 6, 7), t(5, 6)],
            "starts": [2, 1],
            "margin": 0.5,
            "head": "b",
            "safe": [1, -1],
        },
        {
            "sequences": [t(9), t(8, 8), t(7, 7, 7, 7)],
            "starts": [1, 1, 2],
            "margin": 0.0,
            "head": None,
            "safe": [0, 0, 0],
        },
    ]


def test_both_preference_datasets_check_max_length_from_python(tok):
    from lightrft.data import UnpairedPreferenceDataset

    pair = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    with pytest.raises(ValueError, match="max_length must be >= 1, got 0"):
        PreferenceDataset(tok, records=pair, apply_chat_template=False, max_length=0)
    row = [{"prompt": "p", "completion": "a", "label": True}]
    with pytest.raises(ValueError, match="max_length must be >= 1, got 0"):
        UnpairedPreferenceDataset(tok, records=row, apply_chat_template=False, max_length=0)


def test_collator_pads_and_packs_to_the_same_segments():
    pad = PreferenceCollator(0, ["a", "b"])(_items())
    assert pad["candidates"].tolist() == [[0, 1, -1], [2, 3, 4]]
    assert pad["head"].tolist() == [1, 0] and pad["margin"].tolist() == [0.5, 0.0]
    assert pad["safe"].tolist() == [[1, -1, 0], [0, 0, 0]]
    assert pad["input_ids"].shape == (5, 4) and pad["segment_ids"][1].tolist() == [1, 1, -1, -1]
    packed = PreferenceCollator(0, ["a", "b"], packing=True, max_tokens=6)(_items())
    assert "attention_mask" not in packed
    assert packed["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 2], [3, 3, 4, 4, 4, 4]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    # The response tokens (from each sequence's start on), in both layouts.
    assert packed["scored"].int().tolist() == [[0, 0, 1, 0, 1, 0], [0, 1, 0, 0, 1, 1]]
    assert pad["scored"].int().tolist()[:2] == [[0, 0, 1, 0], [0, 1, 0, 0]]
    short = PreferenceCollator(0, ["a", "b"], packing=True, max_tokens=5)(_items())
    # Row 0 is full after two sequences; the 4-token one does not fit after 2 and 3.
    assert short["segment_ids"].tolist() == [[0, 0, 0, 1, 1], [2, 3, 3, -1, -1], [4, 4, 4, 4, -1]]
    assert short["position_ids"][1].tolist() == [0, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="head 'zzz'"):
        PreferenceCollator(0, ["a"])([{**_items()[0], "head": "zzz"}])
    with pytest.raises(ValueError, match="max_tokens_per_row"):
        PreferenceCollator(0, ["a", "b"], packing=True, max_tokens=3)(_items())


def test_arith_preference_pairs(tmp_path):
    import random

    rng = random.Random(0)
    for answer in (0, 7, 46, 135):
        for _ in range(50):
            wrong = near_miss(answer, rng)
            assert wrong != answer and wrong >= 0
    src = write_arith_dataset(tmp_path / "arith", n_train=30, n_test=10)
    out = ensure_arith_preferences(tmp_path / "pairs", src, per_problem=2)
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert len(train) == 60
    answers = {
        json.loads(x)["prompt"]: json.loads(x)["answer"]
        for x in (src / "train.jsonl").read_text().splitlines()
    }
    assert all(r["chosen"] == answers[r["prompt"]] != r["rejected"] for r in train)
    before = (out / "train.jsonl").stat().st_mtime_ns
    ensure_arith_preferences(tmp_path / "pairs", src, per_problem=2)  # up to date: not rewritten
    assert (out / "train.jsonl").stat().st_mtime_ns == before


def test_arith_preference_pairs_on_reversed_answers_are_spelled_reversed(tmp_path):
    src = write_arith_dataset(tmp_path / "add", n_train=200, n_test=10, answer_order="reversed")
    out = ensure_arith_preferences(tmp_path / "pairs", src, per_problem=3)
    for r in (json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()):
        a, b = r["prompt"][:-1].split("+")
        assert r["chosen"] == str(int(a) + int(b)).zfill(3)[::-1]
        wrong = int(r["rejected"][::-1])  # a near miss of the true sum, in the same spelling
        assert len(r["rejected"]) == 3 and wrong != int(a) + int(b)
        diff = abs(wrong - (int(a) + int(b)))
        swapped = sorted(str(wrong).zfill(3)) == sorted(str(int(a) + int(b)).zfill(3))
        assert diff in (1, 2, 10) or swapped, r


def test_arith_pairs_with_the_teachers_dropped_carry_as_the_rejected_answer(tmp_path):
    src = write_arith_dataset(tmp_path / "add", n_train=200, n_test=10, answer_order="reversed")
    out = ensure_arith_preferences(tmp_path / "pairs", src, rejected="dropped_carry")
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    carries = 0
    for r in rows:
        a, b = r["prompt"][:-1].split("+")
        total, wrong = int(a) + int(b), int(r["rejected"][::-1])
        assert r["chosen"] == str(total).zfill(3)[::-1] and len(r["rejected"]) == 3
        if total >= 100:  # "49+97=" -> "641" over "640": the sloppy teacher's habit
            assert wrong == total - 100
            carries += 1
        else:
            assert wrong != total
    assert 0 < carries < len(rows)
    with pytest.raises(ValueError, match="rejected must be 'near_miss' or 'dropped_carry'"):
        ensure_arith_preferences(tmp_path / "other", src, rejected="carry")
