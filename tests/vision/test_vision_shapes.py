"""The synthetic counting task: boards, answers, disjoint splits, reuse, and loading with a VLM
processor (one vision token per cell)."""

import json

import pytest
from PIL import Image

from lightrft.data import PromptDataset, SFTDataset
from lightrft.models.multimodal import load_processor
from lightrft.tasks.shapes import ensure_shapes_dataset, write_shapes_dataset


def _count_cells(path, grid=3, cell=28):
    img = Image.open(path).convert("RGB")
    centre = cell // 2
    return sum(
        img.getpixel((x * cell + centre, y * cell + centre)) != (255, 255, 255)
        for y in range(grid)
        for x in range(grid)
    )


def test_answers_match_the_pictures_and_splits_are_disjoint(tmp_path):
    out = write_shapes_dataset(tmp_path / "s", n_train=40, n_test=10, n_rl=20, seed=3)
    splits = {}
    for split in ("train", "test", "rl"):
        recs = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
        splits[split] = recs
        for r in recs:
            assert r["answer"] == r["completion"] == str(_count_cells(out / r["images"][0]))
            assert 1 <= int(r["answer"]) <= 5 and r["prompt"].startswith("<image>")
    boards = {
        split: {(out / r["images"][0]).read_bytes() for r in recs} for split, recs in splits.items()
    }
    assert not boards["train"] & boards["test"]
    assert not boards["rl"] & (boards["train"] | boards["test"]) and len(splits["rl"]) == 20
    assert not (write_shapes_dataset(tmp_path / "no_rl", n_train=4, n_test=2) / "rl.jsonl").exists()
    # Uniform counts, not skewed towards the many distinct boards with many squares.
    big = write_shapes_dataset(tmp_path / "big", n_train=600, n_test=30, grid=2, max_count=3)
    lines = (big / "train.jsonl").read_text().splitlines()
    answers = [json.loads(line)["answer"] for line in lines]
    shares = [answers.count(str(k)) / len(answers) for k in (1, 2, 3)]
    assert all(0.27 < s < 0.40 for s in shares), shares


def test_ensure_reuses_and_rewrites_on_new_settings(tmp_path):
    out = ensure_shapes_dataset(tmp_path / "s", n_train=8, n_test=4)
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    assert ensure_shapes_dataset(tmp_path / "s", n_train=8, n_test=4) == out
    assert (out / "train.jsonl").stat().st_mtime_ns == stamp
    ensure_shapes_dataset(tmp_path / "s", n_train=9, n_test=4)
    assert len((out / "train.jsonl").read_text().splitlines()) == 9
    with pytest.raises(ValueError, match="unknown argument 'colours'"):
        ensure_shapes_dataset(tmp_path / "s", colours=3)
    with pytest.raises(ValueError, match="max_count <= grid\\*grid"):
        write_shapes_dataset(tmp_path / "x", grid=2, max_count=5)


def test_loads_with_a_vlm_processor_one_token_per_cell(tiny_vlm, tmp_path):
    out = write_shapes_dataset(tmp_path / "s", n_train=6, n_test=2)
    proc = load_processor(tiny_vlm("qwen2_vl"))
    prompts = PromptDataset(proc, out / "test.jsonl")
    assert prompts[0]["media"].image.num_tokens == [9]
    sft = SFTDataset(proc, out / "train.jsonl")
    assert len(sft) == 6 and sft.stats["images"] == 6


def test_preference_pairs_prefer_the_count_and_load_with_their_images(tiny_vlm, tmp_path):
    from lightrft.data import PreferenceDataset
    from lightrft.tasks import ensure_shapes_preferences

    src = ensure_shapes_dataset(tmp_path / "s", n_train=12, n_test=4, min_count=2, max_count=4)
    out = ensure_shapes_preferences(tmp_path / "pairs", src, per_board=2)
    pairs = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(pairs) == 24 and len((out / "test.jsonl").read_text().splitlines()) == 8
    for p in pairs:
        assert p["chosen"] == str(_count_cells(out / p["images"][0]))  # the board's count
        assert p["rejected"] != p["chosen"] and p["rejected"] in {"2", "3", "4"}
    # Skipped when already made from the same source and settings; the images load from it.
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    assert ensure_shapes_preferences(tmp_path / "pairs", src, per_board=2) == out
    assert (out / "train.jsonl").stat().st_mtime_ns == stamp
    ds = PreferenceDataset(load_processor(tiny_vlm("qwen2_vl")), out / "test.jsonl")
    assert len(ds) == 8 and len(ds[0]["media"].image) == 1
    with pytest.raises(ValueError, match="write the counting data set first"):
        ensure_shapes_preferences(tmp_path / "p2", tmp_path / "nothing")
    one = ensure_shapes_dataset(tmp_path / "one", n_train=2, n_test=1, min_count=2, max_count=2)
    with pytest.raises(ValueError, match="one count only"):
        ensure_shapes_preferences(tmp_path / "p3", one)


def test_judgments_are_balanced_verdicts_after_the_boards_count(tiny_vlm, tmp_path):
    from lightrft.tasks import ensure_shapes_judgments
    from lightrft.tasks.shapes import SHAPES_JUDGE_TEMPLATE

    src = ensure_shapes_dataset(tmp_path / "s", n_train=12, n_test=4, min_count=2, max_count=4)
    out = ensure_shapes_judgments(tmp_path / "j", src)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and len((out / "test.jsonl").read_text().splitlines()) == 8
    question = "How many squares are in the picture? Answer with a number."
    for right, wrong in zip(rows[::2], rows[1::2], strict=True):
        count = str(_count_cells(out / right["images"][0]))  # the board's count, judged first
        assert right["images"] == wrong["images"]
        assert right["prompt"] == "<image>" + SHAPES_JUDGE_TEMPLATE.format(
            prompt=question, response=count
        )
        candidate = wrong["prompt"].split("Answer: ")[1].split("\n")[0]
        assert right["completion"] == f"{count} vs {count}: yes"
        assert wrong["completion"] == f"{count} vs {candidate}: no"
        assert candidate != count and candidate in {"2", "3", "4"}  # the data set's counts
    ds = SFTDataset(load_processor(tiny_vlm("qwen2_vl")), out / "test.jsonl")
    assert len(ds) == 8 and ds.stats["images"] == 8
    with pytest.raises(ValueError, match="no {response} field"):
        ensure_shapes_judgments(tmp_path / "j2", src, template="{prompt}?")
    one = ensure_shapes_dataset(tmp_path / "one", n_train=2, n_test=1, min_count=2, max_count=2)
    with pytest.raises(ValueError, match="one count only"):
        ensure_shapes_judgments(tmp_path / "j3", one)
