"""What the ``ensure_*`` data makers share: their settings checked, and data sets made once."""

from __future__ import annotations

import inspect
import json
import os
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightrft.data.io import load_records, made_with, write_jsonl

META = "meta.json"


def ensure_made(
    write: Callable[..., Path],
    out_dir: str | os.PathLike,
    files: Iterable[str],
    settings: Mapping[str, Any],
    normalise: Callable[..., dict] = dict,
) -> Path:
    """``write(out_dir, **want)`` unless ``out_dir`` already holds ``files`` made with ``want``:
    ``settings`` over ``write``'s keyword-only defaults, through ``normalise``. An unknown key is
    a ``ValueError`` naming ``ensure_<what write writes>``."""
    params = inspect.signature(write).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(settings) - set(defaults))
    if unknown:
        who = "ensure_" + write.__name__.removeprefix("write_")
        raise ValueError(f"{who}: unknown argument {unknown[0]!r}; valid: {sorted(defaults)}")
    want = normalise(**{**defaults, **settings})
    out = Path(out_dir)
    if made_with(out, tuple(files), want):
        return out
    return write(out, **want)


def write_made(
    out: Path, splits: Iterable[tuple[str, Sequence[Mapping[str, Any]]]], settings: Mapping
) -> Path:
    """Write each ``(name, records)`` of ``splits`` to ``out/<name>.jsonl``, then a
    ``meta.json`` recording ``settings`` (what :func:`ensure_made` compares); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, records in splits:
        write_jsonl(out / f"{name}.jsonl", records)
    (out / META).write_text(json.dumps(settings, indent=2) + "\n")
    return out


def derive_splits(
    src: Path,
    out: Path,
    want: Mapping[str, Any],
    rows: Callable[[dict[str, Any], random.Random], Iterable[dict[str, Any]]],
) -> Path:
    """Write ``out/{train,test}.jsonl``, each record of ``src``'s split giving ``rows(record,
    rng)`` (``rng`` seeded per split from ``want["seed"]``), and a ``meta.json`` recording
    ``want``; skipped when ``out`` already holds them made with ``want``."""
    if made_with(out, ("train.jsonl", "test.jsonl"), want):
        return out
    splits = []
    for k, split in enumerate(("train", "test")):
        rng = random.Random(want["seed"] * 2 + k)
        records = load_records(src / f"{split}.jsonl")
        splits.append((split, [row for rec in records for row in rows(rec, rng)]))
    return write_made(out, splits, want)
