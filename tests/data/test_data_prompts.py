"""PromptDataset: rendering with the generation prompt, references, labels, length policy, errors."""

import json

import pytest
from conftest import write_jsonl

from lightrft.data import DataError, PromptDataset, SFTDataset, build_dataloader, collate_prompts

GEN = "<|im_start|>assistant\n"


def test_item_fields_and_chat_rendering(tok):
    ds = PromptDataset(
        tok, records=[{"prompt": "1+2=", "answer": 3, "label": "arith"}], system_prompt="S"
    )
    x = ds[0]
    assert (
        x["prompt"] == f"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n{GEN}"
    )
    assert tok.decode(x["prompt_ids"]) == x["prompt"]
    assert x["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "1+2="},
    ]
    assert x["reference"] == "3" and x["label"] == "arith" and x["index"] == 0
    assert ds.stats == {"records": 1, "prompts": 1, "truncated": 0, "dropped": 0}


def test_prompt_ids_equal_the_sft_prefix(tok):
    """RL starts from exactly the tokens SFT trained before the completion."""
    rec = {"prompt": "12+34=", "completion": "46", "answer": "46"}
    prompt = PromptDataset(tok, records=[rec])[0]["prompt_ids"]
    sft = SFTDataset(tok, records=[rec])[0]
    first_loss = int((sft["labels"] != -100).nonzero()[0])
    assert sft["input_ids"][:first_loss].tolist() == prompt


def test_messages_records_labels_and_raw_mode(tmp_path, tok):
    p = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"messages": [{"role": "user", "content": "q1"}], "ref": "a1", "task": "math"},
            {"q": "q2", "ref": "a2"},
        ],
    )
    ds = PromptDataset(
        tok, p, prompt_field="q", reference_field="ref", label_field="task", default_label="other"
    )
    assert [x["label"] for x in ds] == ["math", "other"]
    assert ds[0]["prompt"].endswith(f"user\nq1<|im_end|>\n{GEN}") and ds.where(1) == f"{p} line 2"
    raw = PromptDataset(
        tok,
        records=[{"prompt": "2+2=", "answer": "4"}],
        system_prompt="Add.",
        apply_chat_template=False,
    )
    assert raw[0]["prompt"] == "Add.\n2+2=" and raw[0]["messages"] is None
    assert tok.decode(raw[0]["prompt_ids"]) == "Add.\n2+2="


def test_optional_reference(tok):
    ds = PromptDataset(tok, records=[{"prompt": "x"}], reference_required=False, label_field=None)
    assert ds[0]["reference"] is None and ds[0]["label"] is None


def test_long_prompts_dropped_or_left_truncated_and_counted(tok):
    recs = [
        {"prompt": "short", "answer": "1"},
        {"prompt": "a much longer prompt " * 3, "answer": "2"},
    ]
    n_short = len(PromptDataset(tok, records=recs[:1])[0]["prompt_ids"])
    limit = n_short + 2
    drop = PromptDataset(tok, records=recs, max_prompt_length=limit)
    assert len(drop) == 1 and drop.stats["dropped"] == 1 and drop.stats["truncated"] == 0
    trunc = PromptDataset(tok, records=recs, max_prompt_length=limit, truncation="truncate")
    x = trunc[1]
    assert trunc.stats["truncated"] == 1 and len(x["prompt_ids"]) == limit
    assert x["prompt"].endswith(GEN)  # the left is cut: the generation prompt stays
    assert tok.decode(x["prompt_ids"]) == x["prompt"] and x["reference"] == "2"


def test_collate_prompts_keeps_lists(tok):
    recs = [{"prompt": "a" * (i + 1), "answer": str(i)} for i in range(4)]
    ds = PromptDataset(tok, records=recs)
    batch = next(
        iter(build_dataloader(ds, batch_size=4, shuffle=False, collate_fn=collate_prompts))
    )
    assert batch["reference"] == ["0", "1", "2", "3"]
    assert [len(p) for p in batch["prompt_ids"]] == [len(ds[i]["prompt_ids"]) for i in range(4)]


# ------------------------------------------------------------------------------ bad input


def test_missing_reference_names_field_and_line(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=rf"{p} line 2: missing field 'answer'"):
        PromptDataset(tok, p)


def test_missing_prompt_and_bad_types(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}])
    with pytest.raises(
        DataError,
        match=rf"{p} line 1: missing field 'prompt'.*has: answer, "
        "question",
    ):
        PromptDataset(tok, p)
    with pytest.raises(
        DataError,
        match=r"records\[0\]: field 'answer' must be a string or "
        "number, got bool",
    ):
        PromptDataset(tok, records=[{"prompt": "a", "answer": True}])
    with pytest.raises(DataError, match="message-list prompt needs apply_chat_template"):
        PromptDataset(
            tok,
            records=[{"prompt": [{"role": "user", "content": "a"}], "answer": 1}],
            apply_chat_template=False,
        )


def test_all_dropped_is_an_error(tok):
    with pytest.raises(DataError, match=r"empty dataset: all 1 prompts .* max_prompt_length=3"):
        PromptDataset(tok, records=[{"prompt": "abcdef", "answer": "1"}], max_prompt_length=3)
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        PromptDataset(tok, records=[{"prompt": "a", "answer": "1"}], max_prompt_length=0)


def test_dropped_prompts_are_logged(tok, caplog):
    recs = [{"prompt": "short", "answer": "1"}, {"prompt": "long " * 20, "answer": "2"}]
    with caplog.at_level("WARNING", logger="lightrft.data.prompts"):
        PromptDataset(tok, records=recs, max_prompt_length=40)
    assert "max_prompt_length=40 truncated (left) 0 and dropped 1 of 2 prompts" in caplog.text


def test_prompts_checked_against_the_engine_limit_at_load(tmp_path, tok):
    """Issue 16 item 11: a prompt the engine cannot take fails at load, naming file and line."""
    from lightrft.data.io import DataError

    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hi", "answer": "1"}, {"prompt": "x" * 200, "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    short = len(PromptDataset(tok, records=rows[:1])[0]["prompt_ids"])
    max_model_len = short + 10  # room for the short prompt, not the long one

    # A bad value names the three PromptDataset takes ('error' included), before any reading.
    with pytest.raises(ValueError, match="truncation must be 'drop' or 'truncate' or 'error'"):
        PromptDataset(tok, path, truncation="trunc")
    refuse = PromptDataset(tok, path, truncation="error")
    with pytest.raises(
        DataError,
        match=rf"{path} line 2: the prompt has \d+ tokens, over "
        rf"engine.max_model_len-1={max_model_len - 1}",
    ):
        refuse.fit_to_engine(max_model_len)

    drop = PromptDataset(tok, path)  # default: drop
    assert drop.fit_to_engine(max_model_len) == 1
    assert len(drop) == 1 and drop[0]["index"] == 0 and drop.stats["engine_dropped"] == 1

    trunc = PromptDataset(tok, path, truncation="truncate")
    assert trunc.fit_to_engine(max_model_len) == 1
    assert len(trunc[1]["prompt_ids"]) == max_model_len - 1 and trunc.stats["engine_truncated"] == 1
    assert (
        trunc[1]["prompt_ids"] == PromptDataset(tok, path)[1]["prompt_ids"][-(max_model_len - 1) :]
    )
