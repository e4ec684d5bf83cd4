"""GSM8K (Cobbe et al., 2021, "Training Verifiers to Solve Math Word Problems") in our format.

Each source record ``{"question", "answer"}``, where the answer is a worked solution ending in
``#### N``, becomes::

    {"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question}],
     "completion": "<solution without <<calculator>> notes>\\nThe answer is \\\\boxed{N}.",
     "answer": "N", "label": "gsm8k", "question": question}

so :class:`~lightrft.data.PromptDataset` (RL) and :class:`~lightrft.data.SFTDataset` (SFT) read
it with their default field names. ``N`` has thousands separators removed (``1,080`` -> ``1080``).

    python -m lightrft.tasks.gsm8k --src ../shared/data/gsm8k --out data/gsm8k
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightrft.data.io import (
    DataError,
    Records,
    load_records,
    made_with,
    require_field,
)
from lightrft.tasks.made import write_made

SYSTEM_PROMPT = (
    "Solve the math word problem step by step. "
    "End with the final answer, a number only, in \\boxed{}."
)
_CALC = re.compile(r"<<[^>]*>>")


def _record(src: Records, i: int, system_prompt: str) -> dict[str, Any]:
    question = require_field(src, i, "question", str)
    solution = require_field(src, i, "answer", str)
    if "####" not in solution:
        raise DataError(f"{src.where(i)}: field 'answer' has no '#### <number>' final answer")
    steps, final = solution.rsplit("####", 1)
    answer = final.strip().replace(",", "")
    if not answer:
        raise DataError(f"{src.where(i)}: field 'answer' has nothing after '####'")
    steps = _CALC.sub("", steps).strip()
    return {
        "prompt": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": question.strip()},
        ],
        "completion": f"{steps}\nThe answer is \\boxed{{{answer}}}.",
        "answer": answer,
        "label": "gsm8k",
        "question": question.strip(),
    }


def prepare_gsm8k(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    splits: Sequence[str] = ("train", "test"),
    system_prompt: str = SYSTEM_PROMPT,
) -> dict[str, Path]:
    """Convert ``src/<split>.jsonl`` (or .json / .parquet) to ``out/<split>.jsonl`` for each split.

    Returns the written file of each split.
    """
    # Our records from the raw ones; errors name the file and line.
    raw = {s: load_records(src, split=s) for s in splits}
    converted = {s: [_record(r, i, system_prompt) for i in range(len(r))] for s, r in raw.items()}
    out_dir = Path(out)
    meta = {"src": str(Path(src).resolve()), "splits": list(splits), "system_prompt": system_prompt}
    write_made(out_dir, converted.items(), meta)
    return {split: out_dir / f"{split}.jsonl" for split in converted}


def ensure_gsm8k(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    splits: Sequence[str] = ("train", "test"),
    system_prompt: str = SYSTEM_PROMPT,
) -> Path:
    """:func:`prepare_gsm8k` unless ``out`` already holds its output for these arguments."""
    out_dir = Path(out)
    splits = [str(s) for s in splits]
    want = {"src": str(Path(src).resolve()), "splits": splits, "system_prompt": system_prompt}
    if not made_with(out_dir, [f"{s}.jsonl" for s in splits], want):
        prepare_gsm8k(src, out_dir, splits=splits, system_prompt=system_prompt)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lightrft.tasks.gsm8k",
        description="Turn GSM8K {question, answer} files into LightRFT prompt/completion records.",
    )
    p.add_argument("--src", required=True, help="directory with train.jsonl / test.jsonl")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--splits", nargs="+", default=["train", "test"])
    p.add_argument("--system-prompt", default=SYSTEM_PROMPT)
    args = p.parse_args(argv)
    try:
        written = prepare_gsm8k(
            args.src, args.out, splits=args.splits, system_prompt=args.system_prompt
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, path in written.items():
        n = sum(1 for _ in path.open(encoding="utf-8"))
        print(f"{split}: {n} records -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
