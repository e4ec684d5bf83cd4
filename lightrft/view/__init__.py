"""``lightrft view RUN_DIR``: one self-contained HTML page of a run, to open in any browser.

The page (the template ``page.html`` beside this file: vanilla JS and CSS, nothing fetched)
shows the run's curves from ``metrics.jsonl`` and pages through the trajectory files
(``trajectories/step_NNNNNN.jsonl``, GRPO's ``trajectories: true``): prompt (with its record's
images and audio inline), response tokens coloured by entropy, advantage or the trainer /
engine probability ratio (``trajectory_tokens: true``), rewards, group, multi-turn turns; filters
by step, reward and length, and the same prompt at two steps side by side.

Everything the page shows is embedded as JSON, so the size is capped: the last ``steps`` step
files and the first ``samples`` samples of each (groups are consecutive rows, so whole groups
stay together), newest first up to ``max_mib`` MiB; the page says what was left out.
"""

from __future__ import annotations

import base64
import json
import math
import mimetypes
import re
from array import array
from pathlib import Path
from typing import Any

__all__ = ["CURVES", "ViewError", "load_run", "render_page", "write_view"]

TEMPLATE = Path(__file__).with_name("page.html")
DATA_MARK = "/*__LIGHTRFT_DATA__*/"

# The curves the page draws, each from the first of its keys the metrics file holds (several
# names: recipes log the same quantity under different keys). ``reward/<fn>/mean`` and ``eval/*``
# keys join the reward and eval charts as extra lines.
CURVES: list[tuple[str, list[str]]] = [
    ("reward", ["reward/total/mean"]),
    ("eval accuracy", ["eval/accuracy"]),
    ("KL to reference", ["train/kl"]),
    ("entropy", ["train/entropy"]),
    ("response length", ["rollout/response_length/mean"]),
    ("clip fraction", ["train/clip_frac"]),
]
MEDIA_LIMIT = 2 * 2**20  # bytes: a larger image or audio file is named on the page, not embedded
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
# "<file> line N" (JSONL) and "<file> record N" (JSON list), as lightrft.data.io names records.
_WHERE = re.compile(r"^(?P<path>.+) (?P<kind>line|record) (?P<n>\d+)$")
_MEDIA_FIELDS = {"image": ("images", "image"), "audio": ("audios", "audio")}


class ViewError(ValueError):
    """A run directory the page cannot be made from; the message says what to change."""


def _finite(value: Any) -> Any:
    """NaN and infinities as None: the page's JSON.parse rejects them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a file, and how many lines were not one (a running run's last line
    may be half written)."""
    rows, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def curves(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The charts the metrics rows allow: ``{"title", "lines": [{"key", "points"}]}``, each
    line's points ``[step, value]`` in step order (rows without the key skipped)."""
    keys = {k for row in rows for k in row}
    out = []
    for title, names in CURVES:
        chosen = [k for k in names if k in keys][:1]
        if title == "reward":
            chosen += sorted(
                k
                for k in keys
                if re.fullmatch(r"reward/[^/]+/mean", k) and k not in ("reward/total/mean",)
            )
        if title == "eval accuracy":
            chosen += [k for k in ("eval/reward",) if k in keys]
        lines = []
        for key in chosen:
            points = [
                [row["step"], row[key]]
                for row in rows
                if isinstance(row.get(key), (int, float)) and isinstance(row.get("step"), int)
            ]
            points = [p for p in _finite(points) if p[1] is not None]
            if points:
                lines.append({"key": key, "points": sorted(points, key=lambda p: p[0])})
        if lines:
            out.append({"title": title, "lines": lines})
    return out


def _line_offsets(path: Path) -> array:
    """Where each line of a file starts, in bytes: a data set of millions of records is
    indexed in one pass without holding its text (lines split at ``\\n``, as the data loader
    numbers them)."""
    offsets, at = array("q"), 0
    with open(path, "rb") as f:
        for line in f:
            offsets.append(at)
            at += len(line)
    return offsets


def _record_media(where: str, cache: dict[Path, Any]) -> list[dict[str, str]]:
    """The images and audio of the dataset record ``where`` names (``"<file> line N"``), read
    from its ``images`` / ``audios`` fields (a path or a list; ``image`` / ``audio`` too) and
    from image / audio parts of its messages, relative paths from the file's folder. Each is
    ``{"kind", "name", "uri"}`` (a data URI) or ``{"kind", "name", "missing": why}``."""
    m = _WHERE.match(where or "")
    if m is None:
        return []
    path = Path(m["path"])
    if not path.is_file():
        return []
    if path not in cache:
        try:
            if m["kind"] == "line":
                cache[path] = _line_offsets(path)
            else:
                cache[path] = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(cache[path], dict):
                    cache[path] = cache[path].get("data", [])
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            cache[path] = []
    try:
        n = int(m["n"])
        if m["kind"] == "line":
            with open(path, "rb") as f:
                f.seek(cache[path][n - 1])
                rec = json.loads(f.readline().decode("utf-8", errors="replace"))
        else:
            rec = cache[path][n]
    except (IndexError, ValueError, TypeError, OSError):
        return []
    if not isinstance(rec, dict):
        return []
    found: list[tuple[str, Any]] = []
    for kind, fields in _MEDIA_FIELDS.items():
        for field in fields:
            value = rec.get(field)
            found += [(kind, v) for v in (value if isinstance(value, list) else [value])]
    for msg in rec.get("messages") or rec.get("prompt") or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in _MEDIA_FIELDS:
                kind = part["type"]
                found += [(kind, part.get(k)) for k in (kind, "path", "url") if part.get(k)][:1]
    out = []
    for kind, value in found:
        if not isinstance(value, str) or not value:
            continue  # inline bytes or a None slot: nothing to name
        file = Path(value) if Path(value).is_absolute() else path.parent / value
        item = {"kind": kind, "name": value}
        if not file.is_file():
            item["missing"] = "file not found"
        elif file.stat().st_size > MEDIA_LIMIT:
            item["missing"] = f"over {MEDIA_LIMIT // 2**20} MiB, not embedded"
        else:
            mime = mimetypes.guess_type(file.name)[0] or f"{kind}/*"
            item["uri"] = f"data:{mime};base64," + base64.b64encode(file.read_bytes()).decode()
        out.append(item)
    return out


def load_run(
    run_dir: str | Path, *, steps: int = 20, samples: int = 64, max_mib: float = 64.0
) -> dict[str, Any]:
    """What the page embeds: the run's curves and its last ``steps`` trajectory files, the
    first ``samples`` lines of each, newest first until the samples and media reach ``max_mib``
    MiB (per-token lines of long responses are large; at least one sample is kept).

    Raises:
        ViewError: ``run_dir`` is no directory, it holds no trajectory files, or a limit is
            not positive.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ViewError(f"run directory not found: {run}")
    if steps < 1 or samples < 1 or not max_mib > 0:
        raise ViewError(
            f"--steps and --samples must be >= 1 and --max-mib > 0, got {steps}, {samples} "
            f"and {max_mib}"
        )
    folder = run / "trajectories"
    files = sorted(
        (int(m[1]), p)
        for p in (folder.iterdir() if folder.is_dir() else [])
        if (m := _STEP_FILE.match(p.name))
    )
    if not files:
        raise ViewError(
            f"{run} has no saved trajectories ({folder}/step_*.jsonl): the page pages through "
            "them; run the recipe with `trajectories: true` (and `trajectory_tokens: true` to "
            "colour the tokens)"
        )
    metrics_path = run / "metrics.jsonl"
    rows, bad_metrics = _read_jsonl(metrics_path) if metrics_path.is_file() else ([], 0)
    budget, used, size_cut = max_mib * 2**20, 0, False
    per_step: list[list[dict[str, Any]]] = []
    media: dict[str, list[dict[str, str]]] = {}
    cache: dict[Path, Any] = {}
    total_samples = bad_lines = 0
    for step, path in reversed(files[-steps:]):
        lines, bad = _read_jsonl(path)
        bad_lines += bad
        groups: dict[str, int] = {}
        kept: list[dict[str, Any]] = []
        for index, rec in enumerate(lines[:samples]):
            # A group is a prompt's n samples; rows of one group are consecutive and share the
            # prompt's record (``where``) and text.
            key = json.dumps([rec.get("where"), rec.get("prompt")])
            rec = dict(_finite(rec), step=rec.get("step", step), index=index)
            rec["group"] = groups.setdefault(key, len(groups))
            where = rec.get("where") or ""
            size = len(json.dumps(rec))
            if where and where not in media:
                media[where] = _record_media(where, cache)
                size += sum(len(m.get("uri", "")) for m in media[where])
            if used + size > budget and (per_step or kept):
                size_cut = True
                break
            used += size
            kept.append(rec)
        if kept:
            per_step.append(kept)
            total_samples += len(lines)
        if size_cut:
            break
    records = [rec for step_records in reversed(per_step) for rec in step_records]
    shown = sorted({rec["step"] for rec in records})
    return {
        "run": run.resolve().name,
        "curves": curves(rows),
        "metrics_file": metrics_path.is_file(),
        "samples": records,
        "media": {k: v for k, v in media.items() if v},
        "tokens": any("tokens" in r for r in records),
        "cap": {
            "steps": steps,
            "samples": samples,
            "max_mib": max_mib,
            "size_cut": size_cut,
            "step_files": len(files),
            "shown_steps": shown,
            "total_samples": total_samples,
            "shown_samples": len(records),
            "unreadable_lines": bad_lines + bad_metrics,
        },
    }


def render_page(data: dict[str, Any]) -> str:
    """The HTML page with ``data`` embedded (``<`` escaped so no string closes the script)."""
    blob = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
    page = TEMPLATE.read_text(encoding="utf-8")
    assert page.count(DATA_MARK) == 1, f"{TEMPLATE} must hold {DATA_MARK} once"
    return page.replace(DATA_MARK, blob)


def write_view(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    steps: int = 20,
    samples: int = 64,
    max_mib: float = 64.0,
) -> tuple[Path, dict[str, Any]]:
    """Write the page of ``run_dir`` to ``out`` (default ``RUN_DIR/view.html``); returns the
    path and the embedded data (:func:`load_run` takes the limits)."""
    data = load_run(run_dir, steps=steps, samples=samples, max_mib=max_mib)
    target = Path(out) if out is not None else Path(run_dir) / "view.html"
    if not target.parent.is_dir():
        raise ViewError(f"--out {target}: folder {target.parent} does not exist")
    target.write_text(render_page(data), encoding="utf-8")
    return target, data
