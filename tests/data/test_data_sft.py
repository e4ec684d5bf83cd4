"""SFTDataset: what gets loss, chat and raw rendering, max_length policy, and data errors."""

import pytest
from conftest import write_jsonl

from lightrft.data import IGNORE_INDEX, DataError, SFTDataset


def loss_text(tok, item):
    pairs = zip(item["input_ids"].tolist(), item["labels"].tolist(), strict=True)
    ids = [i for i, lab in pairs if lab != -100]
    return tok.decode(ids)


def check_labels_match_ids(item):
    ids, labels = item["input_ids"], item["labels"]
    on = labels != IGNORE_INDEX
    assert (labels[on] == ids[on]).all()
    assert labels[0] == IGNORE_INDEX  # the first token is never a target


def test_prompt_completion_with_chat_template(tok):
    ds = SFTDataset(tok, records=[{"prompt": "12+34=", "completion": "46"}])
    x = ds[0]
    assert tok.decode(x["input_ids"]) == (
        "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n46<|im_end|>"
    )
    assert loss_text(tok, x) == "46<|im_end|>"  # completion plus eos, nothing else
    assert x["input_ids"][-1] == tok.eos_token_id
    check_labels_match_ids(x)
    assert ds.stats == {
        "records": 1,
        "samples": 1,
        "truncated": 0,
        "dropped": 0,
        "tokens": len(x["input_ids"]),
        "loss_tokens": 3,
    }


def test_system_prompt_and_message_list_prompt(tok):
    ds = SFTDataset(
        tok,
        records=[
            {"prompt": "hi", "completion": "yo"},
            {
                "prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}],
                "completion": "yo",
            },
        ],
        system_prompt="S",
    )
    assert tok.decode(ds[0]["input_ids"]).startswith("<|im_start|>system\nS<|im_end|>\n")
    # A prompt that brings its own system message keeps it.
    assert tok.decode(ds[1]["input_ids"]).startswith("<|im_start|>system\nown<|im_end|>\n")
    assert loss_text(tok, ds[0]) == loss_text(tok, ds[1]) == "yo<|im_end|>"


def test_raw_concatenation(tok):
    ds = SFTDataset(
        tok,
        records=[{"q": "1+1=", "a": "2"}],
        prompt_field="q",
        completion_field="a",
        apply_chat_template=False,
        system_prompt="Add.",
    )
    x = ds[0]
    assert tok.decode(x["input_ids"]) == "Add.\n1+1=2<|im_end|>"
    assert loss_text(tok, x) == "2<|im_end|>"
    check_labels_match_ids(x)


def test_chat_records_loss_on_assistant_turns_only(tok):
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bb"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "dd"},
        {"role": "user", "content": "trailing turn"},
    ]
    x = SFTDataset(tok, records=[{"messages": msgs}])[0]
    text = tok.decode(x["input_ids"])
    assert text.endswith("<|im_start|>assistant\ndd<|im_end|>")  # trailing user turn dropped
    assert "sys" in text and "<|im_start|>user\nc<|im_end|>" in text
    assert loss_text(tok, x) == "bb<|im_end|>dd<|im_end|>"
    check_labels_match_ids(x)


def test_from_file_with_field_names(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "x", "answer": "y"}] * 3)
    ds = SFTDataset(tok, p, prompt_field="question", completion_field="answer")
    assert len(ds) == 3 and ds.where(2) == f"{p} line 3"
    assert ds.lengths == [len(ds[i]["input_ids"]) for i in range(3)]


def test_max_length_truncate_and_drop_are_counted(tok):
    recs = [{"prompt": "p", "completion": "c" * n} for n in (1, 30, 60)]
    full = SFTDataset(tok, records=recs)
    n0, n1, _ = full.lengths
    limit = n1 - 5  # sample 0 fits, 1 and 2 do not

    trunc = SFTDataset(tok, records=recs, max_length=limit, truncation="truncate")
    assert trunc.lengths == [n0, limit, limit]
    assert trunc.stats["truncated"] == 2 and trunc.stats["dropped"] == 0
    assert trunc.stats["samples"] == 3 and trunc.stats["records"] == 3
    # Truncation keeps the start: same tokens as the full sample, no eos at the cut.
    assert trunc[1]["input_ids"].tolist() == full[1]["input_ids"][:limit].tolist()

    drop = SFTDataset(tok, records=recs, max_length=limit, truncation="drop")
    assert drop.lengths == [n0] and drop.stats["dropped"] == 2 and drop.stats["truncated"] == 0


def test_truncation_that_leaves_no_loss_token_drops(tok):
    recs = [{"prompt": "a long prompt " * 4, "completion": "c"}, {"prompt": "p", "completion": "c"}]
    ds = SFTDataset(tok, records=recs, max_length=30)
    assert len(ds) == 1 and ds.stats["dropped"] == 1 and ds.stats["truncated"] == 0


def test_all_dropped_is_an_empty_dataset_error(tok):
    with pytest.raises(
        DataError, match=r"empty dataset: max_length=5 \(truncation='drop'\) dropped all 1 records"
    ):
        SFTDataset(
            tok, records=[{"prompt": "p", "completion": "c" * 10}], max_length=5, truncation="drop"
        )


# ------------------------------------------------------------------------------ bad input


def test_missing_field_names_field_file_and_line(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    with pytest.raises(DataError, match=rf"{p} line 2: missing field 'completion'"):
        SFTDataset(tok, p)


def test_record_of_neither_format_names_both(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(
        DataError,
        match=rf"{p} line 1: missing field 'messages' .* 'prompt' and "
        r"'completion'.*the record has: text",
    ):
        SFTDataset(tok, p)


def test_wrong_field_type_names_field(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": 3}])
    with pytest.raises(DataError, match=rf"{p} line 1: field 'completion' must be str, got int"):
        SFTDataset(tok, p)


def test_bad_chat_records(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError, match=rf"{p} line 1: the conversation has no assistant turn"):
        SFTDataset(tok, p)
    p = write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=rf"{p} line 1: messages\[0\] has no string 'content'"):
        SFTDataset(tok, p)
    p = write_jsonl(tmp_path / "f.jsonl", [{"messages": "hello"}])
    with pytest.raises(DataError, match=r"field 'messages' must be a non-empty list"):
        SFTDataset(tok, p)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(DataError, match=r"records\[0\]: chat records .* apply_chat_template"):
        SFTDataset(tok, records=[{"messages": msgs}], apply_chat_template=False)


def test_bad_arguments(tok):
    recs = [{"prompt": "a", "completion": "b"}]
    with pytest.raises(ValueError, match="truncation must be 'truncate' or 'drop'"):
        SFTDataset(tok, records=recs, truncation="cut")
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        SFTDataset(tok, records=recs, max_length=1)
    with pytest.raises(ValueError, match="exactly one of path"):
        SFTDataset(tok)
    with pytest.raises(DataError, match="empty dataset"):
        SFTDataset(tok, records=[])


def _tok_with_template(tiny_model_dir, template):
    from lightrft.models import load_tokenizer

    t = load_tokenizer(tiny_model_dir)
    t.chat_template = template
    return t


def test_template_without_eos_gets_eos_appended(tiny_model_dir):
    t = _tok_with_template(
        tiny_model_dir,
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}",
    )
    x = SFTDataset(t, records=[{"prompt": "1+1=", "completion": "2"}])[0]
    assert t.decode(x["input_ids"]) == "user: 1+1=\nassistant: 2\n<|im_end|>"
    assert loss_text(t, x) == "2\n<|im_end|>"


def test_template_that_rewrites_history_is_refused(tiny_model_dir):
    t = _tok_with_template(tiny_model_dir, "{{ messages[-1]['content'] }}")
    with pytest.raises(DataError, match=r"records\[0\]: the chat template renders earlier turns"):
        SFTDataset(t, records=[{"prompt": "1+1=", "completion": "2"}])


def test_truncation_is_logged(tok, caplog):
    recs = [{"prompt": "p", "completion": "c" * n} for n in (1, 60)]
    with caplog.at_level("WARNING", logger="lightrft.data.sft"):
        SFTDataset(tok, records=recs, max_length=30)
    assert "max_length=30 truncated 1 and dropped 0 of 2 samples" in caplog.text
