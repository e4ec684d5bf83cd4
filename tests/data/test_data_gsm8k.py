"""GSM8K preparation on the real files in ../shared/data/gsm8k."""

import json
from pathlib import Path

import pytest
from conftest import write_jsonl

from lightrft.data import DataError, PromptDataset
from lightrft.rewards import GSM8KVerifier, MathVerifier, Sample
from lightrft.tasks import ensure_gsm8k, prepare_gsm8k
from lightrft.tasks.gsm8k import SYSTEM_PROMPT, main

SRC = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k"
pytestmark = pytest.mark.skipif(not (SRC / "test.jsonl").is_file(), reason="no GSM8K files")


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    return prepare_gsm8k(SRC, out)


def test_counts_and_format(prepared):
    raw = _read(SRC / "test.jsonl")
    ours = _read(prepared["test"])
    assert len(ours) == len(raw) == 1319 and len(_read(prepared["train"])) == 7473
    for r, o in zip(raw, ours, strict=True):
        assert o["prompt"] == [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": r["question"].strip()},
        ]
        assert o["answer"] == r["answer"].split("####")[-1].strip().replace(",", "")
        assert "<<" not in o["completion"] and o["completion"].endswith(
            f"\\boxed{{{o['answer']}}}."
        )
        assert o["label"] == "gsm8k"
    assert sum("," in r["answer"].split("####")[-1] for r in raw) > 0  # separators were removed


def test_references_and_completions_verify(prepared):
    ours = _read(prepared["test"])
    raw = _read(SRC / "test.jsonl")
    refs = [o["answer"] for o in ours]
    # Our SFT completions are correct answers for the math verifier ...
    ok = MathVerifier()(Sample.batch([""] * len(ours), [o["completion"] for o in ours], refs))
    assert all(v == 1.0 for v in ok)
    # ... and so are the original solutions for the GSM8K verifier against our references.
    ok = GSM8KVerifier()(Sample.batch([""] * len(raw), [r["answer"] for r in raw], refs))
    assert all(v == 1.0 for v in ok)


def test_prompt_dataset_reads_it(prepared, tok):
    ds = PromptDataset(tok, prepared["test"].parent, split="test")
    assert len(ds) == 1319 and ds[0]["label"] == "gsm8k"
    assert ds[0]["prompt"].startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>")


def test_cli_and_ensure(tmp_path, capsys):
    assert main(["--src", str(SRC), "--out", str(tmp_path), "--splits", "test"]) == 0
    assert "test: 1319 records" in capsys.readouterr().out
    out = tmp_path / "test.jsonl"
    assert not (tmp_path / "train.jsonl").exists()
    stamp = out.stat().st_mtime_ns
    ensure_gsm8k(SRC, tmp_path, splits=["test"])
    assert out.stat().st_mtime_ns == stamp  # present with the same arguments: untouched
    ensure_gsm8k(SRC, tmp_path, splits=["test"], system_prompt="Answer in \\boxed{}.")
    assert _read(out)[0]["prompt"][0]["content"] == "Answer in \\boxed{}."


def test_bad_source_errors(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(
        src / "test.jsonl",
        [{"question": "q", "answer": "1 #### 1"}, {"question": "q", "answer": "no final answer"}],
    )
    with pytest.raises(
        DataError,
        match=rf"{src / 'test.jsonl'} line 2: field 'answer' has no "
        "'#### <number>'",
    ):
        prepare_gsm8k(src, tmp_path / "out", splits=["test"])
    write_jsonl(src / "test.jsonl", [{"answer": "#### 1"}])
    with pytest.raises(DataError, match=r"line 1: missing field 'question'"):
        prepare_gsm8k(src, tmp_path / "out", splits=["test"])
    assert main(["--src", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "data file not found" in capsys.readouterr().err
