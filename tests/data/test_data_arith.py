"""Synthetic arithmetic: correct answers, difficulty knobs, determinism, disjoint splits, ensure."""

import json
import re

import pytest

from lightrft.data import SFTDataset
from lightrft.tasks import arith_records, ensure_arith_dataset, write_arith_dataset


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expr(prompt):
    return prompt[len("What is ") : -1] if prompt.startswith("What is ") else prompt[:-1]


def test_answers_are_correct_and_knobs_respected():
    recs = arith_records(300, digits=3, ops="+-*", terms=3, seed=1)
    ops_seen = set()
    for r in recs:
        expr = _expr(r["prompt"])
        assert r["prompt"].endswith("=") and re.fullmatch(r"\d{1,3}([-+*]\d{1,3}){2}", expr)
        assert r["answer"] == r["completion"] == str(eval(expr))  # plain integer arithmetic
        assert int(r["answer"]) >= 0  # allow_negative=False
        ops_seen |= set(re.findall(r"[-+*]", expr))
        assert r["label"] == "arith"
    assert ops_seen == {"+", "-", "*"}
    assert len({r["prompt"] for r in recs}) == 300


def test_reversed_answers_are_padded_column_order():
    recs = arith_records(400, answer_order="reversed", seed=3)
    for r in recs:
        a, b = map(int, r["prompt"][:-1].split("+"))
        assert r["answer"] == r["completion"] and len(r["answer"]) == 3  # 99+99=198: 3 digits
        assert int(r["answer"][::-1]) == a + b
    assert {r["answer"] for r in arith_records(1, answer_order="reversed", seed=0)} == {"641"}
    three = arith_records(50, digits=1, terms=3, answer_order="reversed")  # 9+9+9=27: 2 digits
    assert all(
        len(r["answer"]) == 2 and int(r["answer"][::-1]) == eval(r["prompt"][:-1]) for r in three
    )
    # the same problems as the natural order, only the answers' spelling differs
    natural = arith_records(400, seed=3)
    assert [r["prompt"] for r in natural] == [r["prompt"] for r in recs]


def test_precedence_and_styles():
    q = arith_records(5, style="question", min_digits=2, digits=2)
    for r in q:
        a, b = _expr(r["prompt"]).split("+")
        assert r["prompt"].startswith("What is ") and 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    neg = arith_records(200, ops="-", allow_negative=True, seed=0)
    assert any(int(r["answer"]) < 0 for r in neg)


def test_deterministic_and_seeded():
    assert arith_records(20, seed=3) == arith_records(20, seed=3)
    assert arith_records(20, seed=3) != arith_records(20, seed=4)


def test_write_splits_are_disjoint_and_loadable(tmp_path, tok):
    out = write_arith_dataset(tmp_path / "a", n_train=300, n_test=50, seed=2)
    train, test = _read(out / "train.jsonl"), _read(out / "test.jsonl")
    assert len(train) == 300 and len(test) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len(SFTDataset(tok, out, split="train")) == 300


def test_ensure_writes_only_when_absent_or_changed(tmp_path):
    d = tmp_path / "arith"
    ensure_arith_dataset(d, n_train=100, n_test=10)
    train = d / "train.jsonl"
    first = train.read_text()
    train.write_text(first)  # marker: a rewrite would change the inode's mtime_ns below
    stamp = train.stat().st_mtime_ns
    ensure_arith_dataset(d, n_train=100, n_test=10)
    assert train.stat().st_mtime_ns == stamp  # same settings: untouched
    ensure_arith_dataset(d, n_train=100, n_test=10, ops=["+", "-"])
    assert train.read_text() != first  # other settings: regenerated
    assert json.loads((d / "meta.json").read_text())["ops"] == ["+", "-"]
    (d / "test.jsonl").unlink()
    ensure_arith_dataset(d, n_train=100, n_test=10, ops=["+", "-"])
    assert len(_read(d / "test.jsonl")) == 10  # a missing split: regenerated


def test_bad_settings():
    with pytest.raises(ValueError, match=r"ops must be a non-empty list of \['\+', '-', '\*'\]"):
        arith_records(3, ops=["/"])
    with pytest.raises(ValueError, match="min_digits <= digits"):
        arith_records(3, digits=1, min_digits=2)
    with pytest.raises(ValueError, match="terms must be >= 2"):
        arith_records(3, terms=1)
    with pytest.raises(ValueError, match="style must be one of"):
        arith_records(3, style="words")
    with pytest.raises(ValueError, match="asked for 60 distinct problems .* allow only about 100"):
        arith_records(60, digits=1)
    with pytest.raises(ValueError, match="answer_order must be one of"):
        arith_records(3, answer_order="backwards")
    with pytest.raises(ValueError, match="additions"):
        arith_records(3, ops="+-", answer_order="reversed")
    with pytest.raises(ValueError, match="unknown argument 'n_tran'"):
        ensure_arith_dataset("unused", n_tran=5)


@pytest.mark.parametrize("order", ["reversed", "natural"])
def test_dropped_carry_spoils_only_training_completions(tmp_path, order):
    """The sloppy teacher of the text demo: about that share of the training sums >= 100 lose
    their carry in the completion; answers (RL's references) and the test split stay right."""
    write_arith_dataset(tmp_path, n_train=2000, n_test=200, answer_order=order, dropped_carry=0.75)
    value = (lambda a: int(a[::-1])) if order == "reversed" else int
    train, test = _read(tmp_path / "train.jsonl"), _read(tmp_path / "test.jsonl")
    carried = [r for r in train if value(r["answer"]) >= 100]
    dropped = [r for r in carried if r["completion"] != r["answer"]]
    assert 0.70 < len(dropped) / len(carried) < 0.80
    for r in dropped:
        assert value(r["completion"]) == value(r["answer"]) - 100
        if order == "reversed":
            assert len(r["completion"]) == 3 and r["completion"].endswith("0")
    assert all(r["completion"] == r["answer"] for r in train if value(r["answer"]) < 100)
    assert all(r["completion"] == r["answer"] for r in test)
    plain = tmp_path / "plain"
    write_arith_dataset(plain, n_train=2000, n_test=200, answer_order=order)
    assert [r["prompt"] for r in _read(plain / "train.jsonl")] == [r["prompt"] for r in train]


def test_dropped_carry_is_checked():
    with pytest.raises(ValueError, match=r"dropped_carry must be in \[0, 1\], got 1.5"):
        write_arith_dataset("unused", dropped_carry=1.5)
    with pytest.raises(ValueError, match="two terms"):
        write_arith_dataset("unused", terms=3, dropped_carry=0.5)
