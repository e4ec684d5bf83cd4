"""A synthetic visual counting task with verifiable answers, for tiny vision-language demos.

Each image is a ``grid x grid`` board of ``cell``-pixel cells on a white background; some cells hold
a filled square of a random colour. The question asks how many squares there are; the answer is
the count (an integer, scored by the math verifier's ``last_number`` extractor). With the default
28-pixel cells every cell is exactly one Qwen-VL vision token (14-pixel patches merged 2x2), so a
tiny model can learn the task from its vision tokens alone.

Records (``train.jsonl``, ``test.jsonl``) carry ``prompt`` (with an ``<image>`` tag), ``images``
(a PNG path relative to the data file), ``completion`` (the answer, for SFT), ``answer`` (the
reference, for RL verifiers) and ``label``. Train and test boards are disjoint; with ``n_rl > 0``
an ``rl.jsonl`` split holds boards in neither (prompts for RL that SFT never saw).
:func:`ensure_shapes_dataset` writes them only when absent or made with other settings, so a
config can call it on every start.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from lightrft.config import at_least
from lightrft.tasks.made import META, derive_splits, ensure_made, write_made

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 20),
    "purple": (140, 50, 170),
}
QUESTION = "<image>How many squares are in the picture? Answer with a number."
# The judge's text, after the board: GenerativeReward(mode="score", template=...) fills it with
# the question (the conversation's text) and the actor's answer. The judge writes its own count,
# the answer it judges, then the verdict, "yes" or "no" ("3 vs 4: no").
SHAPES_JUDGE_TEMPLATE = (
    "{prompt}\nAnswer: {response}\nIs the answer right? Count, then say yes or no."
)


def _board(rng: random.Random, grid: int, count: int) -> tuple:
    """A board with ``count`` squares: one entry per cell, a colour name or None."""
    cells = set(rng.sample(range(grid * grid), count))
    names = sorted(COLOURS)
    return tuple(rng.choice(names) if k in cells else None for k in range(grid * grid))


def draw_board(board: tuple, grid: int, cell: int):
    """The PIL image of a board: each filled cell holds a square inset by a fifth of a cell."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (grid * cell, grid * cell), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    pad = max(1, cell // 5)
    for k, colour in enumerate(board):
        if colour is None:
            continue
        x, y = (k % grid) * cell, (k // grid) * cell
        draw.rectangle([x + pad, y + pad, x + cell - pad - 1, y + cell - pad - 1], COLOURS[colour])
    return img


def shapes_records(
    n: int,
    *,
    grid: int = 3,
    min_count: int = 1,
    max_count: int = 5,
    seed: int = 0,
    exclude: set[tuple] | None = None,
) -> list[tuple[tuple, dict[str, Any]]]:
    """``n`` ``(board, record)`` pairs, none with a board in ``exclude``; the records' ``images``
    are filled in when the boards are written.

    Counts are uniform in ``min_count..max_count``. Boards may repeat within a split: small
    counts have few distinct boards (9 cells and 5 colours give 45 one-square boards against
    thousands of five-square ones), and drawing distinct boards would skew the answers towards
    large counts, which a model then learns as a prior instead of counting.
    """
    at_least("n", n, 0)
    rng = random.Random(seed)
    exclude = exclude or set()
    out = []
    tries = 0
    while len(out) < n:
        # The count first, then a board with it outside ``exclude``: rejecting whole draws would
        # favour the counts with more boards left.
        count = rng.randint(min_count, max_count)
        while (board := _board(rng, grid, count)) in exclude:
            tries += 1
            if tries > 50 * (n + 10):
                raise ValueError(
                    f"could not draw {n} boards outside the {len(exclude)} excluded "
                    f"(grid={grid}, counts {min_count}..{max_count}): ask for fewer test "
                    "boards or raise grid"
                )
        answer = str(count)
        out.append(
            (board, {"prompt": QUESTION, "completion": answer, "answer": answer, "label": "count"})
        )
    return out


def write_shapes_dataset(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 2000,
    n_test: int = 200,
    n_rl: int = 0,
    grid: int = 3,
    min_count: int = 1,
    max_count: int = 5,
    cell: int = 28,
    seed: int = 0,
) -> Path:
    """Write ``images/*.png``, ``train.jsonl``, ``test.jsonl`` (disjoint boards), ``meta.json``;
    with ``n_rl > 0`` also ``rl.jsonl``, whose boards are in neither train nor test."""
    settings = {k: v for k, v in locals().items() if k != "out_dir"}  # what meta.json records
    if grid < 1 or cell < 4:
        raise ValueError(f"need grid >= 1 and cell >= 4 pixels, got grid={grid}, cell={cell}")
    if not 0 <= min_count <= max_count <= grid * grid:
        raise ValueError(
            f"need 0 <= min_count <= max_count <= grid*grid ({grid * grid}), got "
            f"min_count={min_count}, max_count={max_count}"
        )
    common = dict(grid=grid, min_count=min_count, max_count=max_count)
    test = shapes_records(n_test, seed=seed + 1, **common)
    train = shapes_records(n_train, seed=seed, exclude={b for b, _ in test}, **common)
    splits = [("train", train), ("test", test)]
    if n_rl:
        seen = {b for b, _ in test} | {b for b, _ in train}
        splits.append(("rl", shapes_records(n_rl, seed=seed + 2, exclude=seen, **common)))
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    written = []
    for split, pairs in splits:
        records = []
        for k, (board, rec) in enumerate(pairs):
            name = f"images/{split}_{k:06d}.png"
            draw_board(board, grid, cell).save(out / name)
            records.append({**rec, "images": [name]})
        written.append((split, records))
    return write_made(out, written, settings)


def ensure_shapes_dataset(out_dir: str | os.PathLike, **settings: Any) -> Path:
    """:func:`write_shapes_dataset` unless ``out_dir`` already holds it with these settings."""
    return ensure_made(write_shapes_dataset, out_dir, ("train.jsonl", "test.jsonl"), settings)


def _source_counts(src: Path, per_board: int, why_two: str) -> tuple[dict[str, Any], list[str]]:
    """What derived data records of its counting source (its path and meta file's time), and
    the source's counts (as answers); ``why_two``: what a single count would leave nothing for."""
    at_least("per_board", per_board, 1)
    meta = src / META
    if not meta.is_file():
        raise ValueError(f"no {META} in {src}: write the counting data set first")
    made = json.loads(meta.read_text())
    counts = [str(c) for c in range(made["min_count"], made["max_count"] + 1)]
    if len(counts) < 2:
        raise ValueError(f"{src} has one count only ({counts[0]}): {why_two}")
    return {"source": str(src.resolve()), "source_mtime_ns": meta.stat().st_mtime_ns}, counts


def ensure_shapes_preferences(
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    *,
    per_board: int = 1,
    seed: int = 0,
) -> Path:
    """Preference pairs with images from a counting data set (:func:`ensure_shapes_dataset`):
    the board's count preferred over another count of the data set's range.

    Reads ``source_dir/{train,test}.jsonl`` and writes ``out_dir/{train,test}.jsonl`` with
    ``prompt``, ``images`` (the source's PNGs, as paths relative to ``out_dir``), ``chosen`` and
    ``rejected``, ``per_board`` pairs per board (each a fresh wrong count); skipped when already
    written from the same source and settings.
    """
    src, out = Path(source_dir), Path(out_dir)
    source, counts = _source_counts(src, per_board, "nothing to prefer it over")
    want = {**source, "per_board": per_board, "seed": seed}

    def rows(rec: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
        images = [os.path.relpath(src / path, out) for path in rec["images"]]
        wrong = [c for c in counts if c != rec["answer"]]
        return [
            {
                "prompt": rec["prompt"],
                "images": images,
                "chosen": rec["completion"],
                "rejected": rng.choice(wrong),
            }
            for _ in range(per_board)
        ]

    return derive_splits(src, out, want, rows)


def ensure_shapes_judgments(
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    *,
    template: str = SHAPES_JUDGE_TEMPLATE,
    per_board: int = 1,
    seed: int = 0,
) -> Path:
    """Judgment data with images for a vision-language generative reward model, from a counting
    data set (:func:`ensure_shapes_dataset`): SFT records whose prompt shows the board and
    ``template`` filled with the question and a candidate answer, and whose completion is the
    board's count, the candidate copied, then the verdict, ``yes`` or ``no`` (``"3 vs 4: no"``).

    The judge counts and copies before it judges, so that the verdict compares two neighbouring
    tokens it wrote itself. Trained to write the verdict alone, or its count and then the
    verdict, the tiny judge of configs/tiny/vision_judge_sft.yaml did not learn to compare the
    count with the candidate in the prompt (docs/reward_models.md has the measurements).

    Per board, ``per_board`` candidates that are right (the board's count) and as many that are
    wrong (another count of the data set's range), so the verdicts are balanced and a candidate's
    value says nothing about its verdict. (Wrong counts from one below the range to one above it
    made "the candidate is in the range" a rule that scores 75 %: the tiny judge learnt it, and
    said "yes" to every answer an actor gives, while it counted every board right.) The prompt is what :class:`~lightrft.rewards.GenerativeReward`
    renders for a conversation holding the board and the question: the board first, then the
    filled template. Train with the SFT recipe (configs/tiny/vision_judge_sft.yaml); skipped
    when already written from the same source and settings.
    """
    src, out = Path(source_dir), Path(out_dir)
    for field in ("{prompt}", "{response}"):
        if field not in template:
            raise ValueError(f"template has no {field} field: {template!r}")
    source, counts = _source_counts(src, per_board, "no wrong answer to judge")
    want = {
        **source,
        "template": template,
        "per_board": per_board,
        "seed": seed,
        "kind": "judgments",
        "completion": "{count} vs {candidate}: {verdict}",
    }
    question = QUESTION.replace("<image>", "")

    def rows(rec: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
        images = [os.path.relpath(src / path, out) for path in rec["images"]]
        wrong = [c for c in counts if c != rec["answer"]]
        out_rows = []
        for _ in range(per_board):
            for answer, verdict in ((rec["answer"], "yes"), (rng.choice(wrong), "no")):
                text = template.format(prompt=question, response=answer)
                out_rows.append(
                    {
                        "prompt": "<image>" + text,
                        "images": images,
                        "completion": f"{rec['answer']} vs {answer}: {verdict}",
                    }
                )
        return out_rows

    return derive_splits(src, out, want, rows)
