"""The tool-use demo's task (lightrft.tasks.calc): deterministic data, disjoint splits,
transcripts whose observations are the calculator environment's, and configs that validate
(the control's `environment=null` override too)."""

from __future__ import annotations

import json

import pytest

from lightrft import cli
from lightrft.tasks import ensure_calc_dataset, write_calc_dataset
from lightrft.tasks.calc import FAILURES, estimate

SMALL = {"n_sft": 40, "n_train": 20, "n_test": 10, "tool_share": 0.5, "recover_share": 0.4}
FILES = ("sft.jsonl", "train.jsonl", "test.jsonl", "meta.json")


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_data_are_deterministic_and_the_splits_disjoint(tmp_path):
    a = write_calc_dataset(tmp_path / "a", **SMALL)
    b = write_calc_dataset(tmp_path / "b", **SMALL)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in FILES)
    other = write_calc_dataset(tmp_path / "c", **{**SMALL, "seed": 1})
    assert (other / "sft.jsonl").read_bytes() != (a / "sft.jsonl").read_bytes()
    sft = [r["messages"][0]["content"] for r in _read(a / "sft.jsonl")]
    train = [r["prompt"] for r in _read(a / "train.jsonl")]
    test = [r["prompt"] for r in _read(a / "test.jsonl")]
    assert (len(set(sft)), len(set(train)), len(set(test))) == (40, 20, 10)
    assert not (set(sft) & set(train) or set(sft) & set(test) or set(train) & set(test))
    for rec in _read(a / "test.jsonl"):
        x, y = map(int, rec["prompt"].rstrip("=").split("*"))
        assert 100 <= x < 1000 and 100 <= y < 1000 and rec["answer"] == str(x * y)
        assert len(rec["answer"]) == 6


def test_the_transcripts_mix_direct_answers_tool_calls_and_recoveries(tmp_path):
    out = write_calc_dataset(tmp_path, **SMALL)
    records = _read(out / "sft.jsonl")
    calls = [sum(m["role"] == "tool" for m in r["messages"]) for r in records]
    assert (calls.count(0), calls.count(1), calls.count(2)) == (20, 12, 8)
    for rec, n in zip(records, calls, strict=True):
        msgs = rec["messages"]
        assert rec["tools"] == ["calculator"] and msgs[-1]["role"] == "assistant"
        x, y = map(int, msgs[0]["content"].rstrip("=").split("*"))
        assert msgs[-1]["content"] == str(x * y if n else estimate(x, y))
        if n:  # the calculator's answer, just before the final turn
            assert msgs[-2] == {
                "role": "tool",
                "name": "calculator",
                "content": msgs[-1]["content"],
            }
        if n == 2:  # a refused call first, then the right one
            assert msgs[2]["content"].startswith("Error: tool 'calculator' failed")
    assert len(FAILURES) == 2


def test_the_direct_answers_teacher_estimates():
    assert [estimate(25, 762), estimate(14, 752), estimate(95, 357), estimate(20, 300)] == [
        24000,
        8000,
        40000,
        6000,
    ]


def test_ensure_rewrites_only_on_other_settings(tmp_path):
    out = ensure_calc_dataset(tmp_path, **SMALL)
    stamp = (out / "sft.jsonl").stat().st_mtime_ns
    assert ensure_calc_dataset(tmp_path, **SMALL) == out
    assert (out / "sft.jsonl").stat().st_mtime_ns == stamp
    ensure_calc_dataset(tmp_path, **{**SMALL, "n_test": 12})
    assert len(_read(out / "test.jsonl")) == 12
    with pytest.raises(ValueError, match="tool_shar"):
        ensure_calc_dataset(tmp_path, tool_shar=0.5)
    with pytest.raises(ValueError, match="recover_share"):
        write_calc_dataset(tmp_path, recover_share=1.5)


@pytest.mark.parametrize(
    "args", [["tiny/tool_sft"], ["tiny/tool_grpo"], ["tiny/tool_grpo", "environment=null"]]
)
def test_the_demo_configs_validate(args, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["validate", *args]) == 0, capsys.readouterr().err


def test_the_compact_tool_template_trains_every_assistant_turn(tmp_path):
    from lightrft.environments import ToolSFTDataset, tool_call_format
    from lightrft.models.loading import load_tokenizer
    from lightrft.tasks import make_tiny_model

    with pytest.raises(ValueError, match="chat_template"):
        make_tiny_model(tmp_path / "x", chat_template="nope")
    path = make_tiny_model(
        tmp_path / "m", layers=1, hidden=16, heads=2, kv_heads=1, chat_template="compact_tools"
    )
    tok = load_tokenizer(path)
    assert tool_call_format(tok) == "hermes"
    out = write_calc_dataset(tmp_path / "d", **SMALL)
    records = _read(out / "sft.jsonl")
    data = ToolSFTDataset(tok, records=records)
    for i, rec in enumerate(records):
        ids, labels = data[i]["input_ids"].tolist(), data[i]["labels"].tolist()
        assert ids[: ids.index(tok.convert_tokens_to_ids("<|im_end|>"))] == tok.encode(
            "<|im_start|>system\ntools: calculator"
        )
        trained = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != -100])
        turns = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert trained == "<|im_end|>".join(turns) + "<|im_end|>"
