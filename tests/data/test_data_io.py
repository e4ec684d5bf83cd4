"""Record loading from jsonl / json / parquet / HF dirs, and the errors that name file and line."""

import json

import pytest

from lightrft.data import DataError, load_records

RECS = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}]


def _jsonl(path, recs=RECS):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_jsonl_skips_blank_lines_and_records_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(RECS[0]) + "\n\n" + json.dumps(RECS[1]) + "\n")
    recs = load_records(p)
    assert list(recs) == RECS
    assert recs.where(1) == f"{p} line 3"


@pytest.mark.parametrize("wrap", [False, True], ids=["list", "data_key"])
def test_json_list_or_data_key(tmp_path, wrap):
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"data": RECS} if wrap else RECS))
    recs = load_records(p)
    assert list(recs) == RECS and recs.where(0) == f"{p} record 0"


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(RECS), p)
    recs = load_records(p)
    assert list(recs) == RECS and recs.where(1) == f"{p} row 1"


def test_hf_dataset_and_dataset_dict_dirs(tmp_path):
    import datasets

    datasets.Dataset.from_list(RECS).save_to_disk(tmp_path / "one")
    assert list(load_records(tmp_path / "one")) == RECS

    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list(RECS), test=datasets.Dataset.from_list(RECS[:1])
    )
    dd.save_to_disk(tmp_path / "dd")
    test = load_records(tmp_path / "dd", split="test")
    assert list(test) == RECS[:1] and test.where(0) == f"{tmp_path / 'dd'}[test] row 0"
    with pytest.raises(DataError, match=r"holds splits \['test', 'train'\]: set split"):
        load_records(tmp_path / "dd")
    with pytest.raises(DataError, match=r"has no split 'dev'"):
        load_records(tmp_path / "dd", split="dev")


def test_split_directory_and_several_paths(tmp_path):
    _jsonl(tmp_path / "train.jsonl")
    (tmp_path / "test.json").write_text(json.dumps(RECS[:1]))
    assert list(load_records(tmp_path, split="test")) == RECS[:1]
    both = load_records([tmp_path / "train.jsonl", tmp_path / "test.json"])
    assert len(both) == 3 and both.where(2) == f"{tmp_path / 'test.json'} record 0"
    with pytest.raises(DataError, match="set split"):
        load_records(tmp_path)
    with pytest.raises(DataError, match=r"no dev.jsonl, dev.json or dev.parquet in directory"):
        load_records(tmp_path, split="dev")


# ------------------------------------------------------------------------------ bad input


def test_missing_file_names_path(tmp_path):
    with pytest.raises(DataError, match=r"data file not found: .*nope\.jsonl"):
        load_records(tmp_path / "nope.jsonl")


def test_malformed_json_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(RECS[0]) + "\n" + json.dumps(RECS[1]) + "\n{'prompt': 1}\n")
    with pytest.raises(DataError, match=rf"{p} line 3: malformed JSON"):
        load_records(p)


def test_non_object_line_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(RECS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=rf"{p} line 2: expected a JSON object, got list"):
        load_records(p)


def test_malformed_json_file_names_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[\n{"a": 1},\n{"a": 2,}\n]')
    with pytest.raises(DataError, match=rf"{p} line 3: malformed JSON"):
        load_records(p)
    p.write_text('{"rows": []}')
    with pytest.raises(DataError, match=r"expected a JSON list of objects"):
        load_records(p)
    p.write_text('[{"a": 1}, 3]')
    with pytest.raises(DataError, match=rf"{p} record 1: expected a JSON object, got int"):
        load_records(p)


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_dataset_names_file(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=rf"empty dataset: no records in {p}"):
        load_records(p)


def test_unsupported_suffix_and_empty_path_list(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'"):
        load_records(p)
    with pytest.raises(DataError, match="empty list"):
        load_records([])


# --- issue 16: bad bytes and interrupted writes ------------------------------------------------


def test_non_utf8_bytes_name_file_line_and_byte_offset(tmp_path):
    from lightrft.data.io import DataError, load_records

    good = b'{"prompt": "caf\xc3\xa9"}\n'
    bad = b'{"prompt": "na\xefve"}\n'  # latin-1, not UTF-8
    jl = tmp_path / "d.jsonl"
    jl.write_bytes(good * 2 + bad)
    with pytest.raises(DataError) as info:
        load_records(jl)
    off = 2 * len(good) + bad.index(b"\xef")
    msg = str(info.value)
    assert f"{jl} line 3: not valid UTF-8" in msg and f"byte offset {off} of the file" in msg
    js = tmp_path / "d.json"
    js.write_bytes(b'[\n {"prompt": "a"},\n {"prompt": "na\xefve"}\n]\n')
    with pytest.raises(DataError, match=rf"{js} line 3: not valid UTF-8 .* byte offset 35 "):
        load_records(js)


def test_interrupted_jsonl_write_leaves_no_temporary_file(tmp_path):
    from lightrft.data.io import write_jsonl

    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"a": 1}])

    def records():
        yield {"a": 2}
        raise KeyboardInterrupt  # what Ctrl-C raises in the middle of data preparation

    with pytest.raises(KeyboardInterrupt):
        write_jsonl(path, records())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]
    assert path.read_text() == '{"a": 1}\n'  # the previous complete file is untouched
