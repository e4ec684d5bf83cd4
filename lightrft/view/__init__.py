"""``lightrft view RUN_DIR``: one self-contained HTML page of a run, to open in any browser.

The page (the template ``page.html`` beside this file: vanilla JS and CSS, nothing fetched)
shows the run's curves from ``metrics.jsonl`` and pages through the trajectory files
(``trajectories/step_NNNNNN.jsonl``, GRPO's ``trajectories: true``): prompt (with its record's
images, audio and videos inline), response tokens coloured by entropy, advantage or the trainer /
engine probability ratio (``trajectory_tokens: true``), rewards, group, multi-turn turns; filters
by step, reward and length, and the same prompt at two steps side by side.

Everything the page shows is embedded as JSON, so the size is capped: the last ``steps`` step
files and the first ``samples`` samples of each (groups are consecutive rows, so whole groups
stay together), newest first up to ``max_mib`` MiB; the page says what was left out.
"""

from __future__ import annotations

import base64
import io
import json
import math
import mimetypes
import re
from array import array
from itertools import accumulate
from pathlib import Path
from typing import Any

__all__ = ["CURVES", "ViewError", "load_run", "render_page", "write_view"]

TEMPLATE = Path(__file__).with_name("page.html")
DATA_MARK = "/*__LIGHTRFT_DATA__*/"

# The curves the page draws, each from its metrics key; ``reward/<fn>/mean`` and ``eval/reward``
# join the reward and eval charts as extra lines.
CURVES: list[tuple[str, str]] = [
    ("reward", "reward/total/mean"),
    ("eval accuracy", "eval/accuracy"),
    ("KL to reference", "train/kl"),
    ("entropy", "train/entropy"),
    ("response length", "rollout/response_length/mean"),
    ("clip fraction", "train/clip_frac"),
]
MEDIA_LIMIT = 2 * 2**20  # bytes: a larger media file is named on the page, not embedded
MAX_LINE_BYTES = 64 * 2**20  # a longer JSONL line is counted unreadable, not parsed
MAX_FILE_BYTES = 2**30  # a JSONL file is read up to this many bytes
OUTSIDE = "outside the run and data folders: not embedded"
VIDEO_FRAMES = 16  # a video shown as frames shows at most this many, spread evenly
FRAME_SIDE = 256  # pixels: frames decoded from a video file are scaled down to this longer side
# Video files a browser plays (checked in headless Chromium), by suffix: the MIME type of the data
# URI and the codecs (PyAV's decoder names) it plays in that container. Another container or
# codec (.avi, .mkv, .mov, MPEG-4 Part 2 as the motion demo writes, HEVC) is shown as frames.
PLAYABLE = {
    ".mp4": ("video/mp4", {"h264", "vp9", "av1", "libdav1d", "libaom-av1"}),
    ".m4v": ("video/mp4", {"h264", "vp9", "av1", "libdav1d", "libaom-av1"}),
    ".webm": ("video/webm", {"vp8", "vp9", "av1", "libdav1d", "libaom-av1"}),
}
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
# "<file> line N" (JSONL) and "<file> record N" (JSON list), as lightrft.data.io names records.
_WHERE = re.compile(r"^(?P<path>.+) (?P<kind>line|record) (?P<n>\d+)$")
_MEDIA_FIELDS = {
    "image": ("images", "image"),
    "audio": ("audios", "audio"),
    "video": ("videos", "video"),
}


class ViewError(ValueError):
    """A run directory the page cannot be made from; the message says what to change."""


def _finite(text: str) -> float | None:
    """A JSON number as read, None when not finite (``1e999``; ``NaN`` and ``Infinity`` read as
    None too): the page's JSON.parse rejects them."""
    value = float(text)
    return value if math.isfinite(value) else None


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a file, and how many lines were not one (a running run's last line
    may be half written; a line over :data:`MAX_LINE_BYTES`, an integer past Python's 4300
    digits, nesting past the recursion limit). Only a regular file is read (its callers check:
    a link to ``/dev/zero`` is not), and at most :data:`MAX_FILE_BYTES` of it."""
    rows: list[dict[str, Any]] = []
    bad = 0
    with open(path, "rb") as f:
        read = 0
        while read < MAX_FILE_BYTES:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            read += len(raw)
            if len(raw) > MAX_LINE_BYTES:
                bad += 1
                while raw and not raw.endswith(b"\n") and read < MAX_FILE_BYTES:
                    raw = f.readline(MAX_LINE_BYTES)  # skip the rest of the long line
                    read += len(raw)
                continue
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8", errors="replace")
                row = json.loads(text, parse_float=_finite, parse_constant=lambda _: None)
            except (ValueError, RecursionError):  # JSONDecodeError, 4300-digit ints, deep nesting
                row = None
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
    for title, name in CURVES:
        chosen = [name] if name in keys else []
        if title == "reward":
            chosen += sorted(k for k in keys if re.fullmatch(r"reward/(?!total/)[^/]+/mean", k))
        if title == "eval accuracy" and "eval/reward" in keys:
            chosen.append("eval/reward")
        lines = []
        for key in chosen:
            points = [
                [row["step"], row[key]]
                for row in rows
                if isinstance(row.get(key), (int, float)) and isinstance(row.get("step"), int)
            ]
            if points:
                lines.append({"key": key, "points": sorted(points, key=lambda p: p[0])})
        if lines:
            out.append({"title": title, "lines": lines})
    return out


def _record_media(where: str, cache: dict[Path, Any], run: Path) -> list[dict[str, Any]]:
    """The images, audio and videos of the dataset record ``where`` names (``"<file> line
    N"``), read from its ``images`` / ``audios`` / ``videos`` fields (a path or a list;
    ``image`` / ``audio`` / ``video`` too; a video is a file or a list of frame images, as the
    data loader reads them) and from media parts of its messages, relative paths from the
    file's folder. Each is what :func:`_media_item` makes; only files inside the run folder
    ``run`` or that data file's folder, links followed, are embedded."""
    m = _WHERE.match(where or "")
    if m is None:
        return []
    path = Path(m["path"])
    if not path.is_file():
        return []
    if path not in cache:
        try:
            if m["kind"] == "line":
                # Where each line starts, in bytes: a data set of millions of records is indexed
                # in one pass without holding its text (lines split at \n, as the data loader
                # numbers them).
                with open(path, "rb") as f:
                    cache[path] = array("q", accumulate(map(len, f), initial=0))[:-1]
            else:
                if path.stat().st_size > MAX_FILE_BYTES:
                    raise OSError("too large")
                cache[path] = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(cache[path], dict):
                    cache[path] = cache[path].get("data", [])
        except (OSError, ValueError, RecursionError):  # also 4300-digit ints, deep nesting
            cache[path] = []
    try:
        n = int(m["n"])
        if m["kind"] == "line":
            if n < 1:  # lines count from 1: line 0 would read the file's last line
                return []
            with open(path, "rb") as f:
                f.seek(cache[path][n - 1])
                rec = json.loads(f.readline(MAX_LINE_BYTES).decode("utf-8", errors="replace"))
        else:
            rec = cache[path][n]
    except (IndexError, ValueError, TypeError, OSError, RecursionError):
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
    roots = (run.resolve(), path.parent.resolve())
    return [item for kind, value in found if (item := _media_item(kind, value, path.parent, roots))]


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _spread(count: int, k: int) -> list[int]:
    """``min(k, count)`` indices spread evenly from the first to the last of ``count``."""
    k = min(k, count)
    return [round(j * (count - 1) / (k - 1)) for j in range(k)] if k > 1 else [0]


def _media_item(
    kind: str, value: Any, base: Path, roots: tuple[Path, ...]
) -> dict[str, Any] | None:
    """One medium of a record as the page shows it: ``{"kind", "name"}`` and its data URI
    (``"uri"``), a video's frames (``"frames"``: ``[{"index", "name", "uri" | "missing"}]``,
    with a ``"note"`` on what they are), or why it is not shown (``"missing"``). None for what
    names no file (inline bytes, a None slot).

    A page is made to be shared, so nothing from outside ``roots`` (the run folder and the data
    file's folder) is embedded, wherever a path or a link points, and a file must decode as
    the medium it claims to be (:func:`_looks_like`)."""
    if kind == "video" and isinstance(value, dict):  # {"path": ...} as the data loader takes
        value = value.get("path", value.get("video"))
    if kind == "video" and isinstance(value, (list, tuple)):
        # A video given as frame images: each shown frame embedded as an image is (at most
        # ``VIDEO_FRAMES``, spread evenly).
        names = [f for f in value if isinstance(f, str)]
        name = f"{len(value)} frames" + (f" ({names[0]} .. {names[-1]})" if names else "")
        if not value:
            return {"kind": "video", "name": name, "missing": "an empty frame list"}
        shown = _spread(len(value), VIDEO_FRAMES)
        frames = []
        for k in shown:
            frame = _media_item("image", value[k], base, roots) or {
                "name": f"frame {k}",
                "missing": "inline data, not a file path: not shown",
            }
            frames.append({"index": k, **{n: v for n, v in frame.items() if n != "kind"}})
        item = {"kind": "video", "name": name, "frames": frames}
        if len(shown) < len(value):
            item["note"] = f"{len(shown)} of its {len(value)} frames, spread evenly"
        return item
    if not isinstance(value, str) or not value:
        return None
    item: dict[str, Any] = {"kind": kind, "name": value[:300]}
    try:
        file = (Path(value) if Path(value).is_absolute() else base / value).resolve()
        if not any(file.is_relative_to(root) for root in roots):
            item["missing"] = OUTSIDE
        elif not file.is_file():
            item["missing"] = "file not found"
        elif file.stat().st_size > MEDIA_LIMIT:
            item["missing"] = f"over {MEDIA_LIMIT // 2**20} MiB, not embedded"
        elif kind == "video":
            item.update(_video_file(file))
        else:
            data = file.read_bytes()
            if not _looks_like(kind, data):
                item["missing"] = f"not an {kind} file: not embedded"
            else:
                mime = mimetypes.guess_type(file.name)[0] or f"{kind}/*"
                item["uri"] = _data_uri(data, mime)
    except (OSError, ValueError, RuntimeError) as e:  # a NUL in the name, a link loop
        item["missing"] = f"unreadable ({getattr(e, 'strerror', None) or e})"
    return item


# The first bytes of the formats a browser shows, by medium ("decode as the claimed medium":
# a text file named .png is not embedded).
_MAGIC = {
    "image": (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM"),
    "audio": (b"fLaC", b"OggS", b"ID3", b"\xff\xfb", b"\xff\xf3", b"\xff\xf2", b"\xff\xf1"),
    "video": (b"\x1aE\xdf\xa3",),  # WebM / Matroska; MP4 is "ftyp" at byte 4
}


def _looks_like(kind: str, data: bytes) -> bool:
    """Whether ``data`` starts as a file of medium ``kind`` (RIFF: WAVE audio, WEBP image,
    AVI video; ISO media ``ftyp``: an M4A audio or MP4 video)."""
    if data.startswith(_MAGIC.get(kind, ())):
        return True
    if data[:4] == b"RIFF":
        return data[8:12] == {"image": b"WEBP", "audio": b"WAVE", "video": b"AVI "}.get(kind)
    return kind in ("audio", "video") and data[4:8] == b"ftyp"


def _video_file(file: Path) -> dict[str, Any]:
    """A video file's ``"uri"`` when a browser plays it (:data:`PLAYABLE`, its codec probed
    with PyAV), else up to ``VIDEO_FRAMES`` of its frames decoded with PyAV (JPEG, at most
    ``FRAME_SIDE`` pixels a side); ``"missing"`` when it cannot be read."""
    mime, codecs = PLAYABLE.get(file.suffix.lower(), (None, set()))
    try:
        import av
    except ImportError:
        if mime is not None:
            data = file.read_bytes()  # at most MEDIA_LIMIT bytes
            if not _looks_like("video", data):
                return {"missing": "not a video file: not embedded"}
            return {
                "uri": _data_uri(data, mime),
                "note": "codec not checked: PyAV is not installed (pip install av)",
            }
        return {
            "missing": f"a {file.suffix or 'suffix-less'} file plays in no browser, and showing "
            "its frames needs PyAV (pip install av)"
        }
    try:
        with av.open(str(file)) as container:
            if not container.streams.video:
                return {"missing": "no video stream"}
            stream = container.streams.video[0]
            codec = stream.codec_context.name
            count = sum(1 for packet in container.demux(stream) if packet.size)
        if mime is not None and codec in codecs:
            return {"uri": _data_uri(file.read_bytes(), mime)}
        wanted = set(_spread(count, VIDEO_FRAMES)) if count else set()
        frames = []
        with av.open(str(file)) as container:
            for k, frame in enumerate(container.decode(video=0)):
                if k in wanted:
                    image = frame.to_image()
                    image.thumbnail((FRAME_SIDE, FRAME_SIDE))
                    buf = io.BytesIO()
                    image.save(buf, format="JPEG", quality=85)
                    frames.append({"index": k, "uri": _data_uri(buf.getvalue(), "image/jpeg")})
    except Exception as e:  # PyAV raises FFmpegError subclasses, and ValueError for odd input
        return {"missing": f"cannot decode it ({type(e).__name__}: {e})"}
    if not frames:
        return {"missing": "no frames decoded"}
    where = f"a {file.suffix} file" if file.suffix else "a file without a suffix"
    shown = f"{len(frames)} of its {count} frames, spread evenly" if len(frames) < count else ""
    return {
        "frames": frames,
        "note": f"{codec} in {where} plays in no browser: its frames"
        + (f" ({shown})" if shown else ""),
    }


def load_run(
    run_dir: str | Path, *, steps: int = 20, samples: int = 64, max_mib: float = 64.0
) -> dict[str, Any]:
    """What the page embeds: the run's curves and its last ``steps`` trajectory files, the
    first ``samples`` lines of each, newest first until the samples and media reach ``max_mib``
    MiB (per-token lines of long responses are large; at least one sample is kept).

    A run saved without trajectories gets its curves and ``cap["no_trajectories"]``, the
    sentence saying how to save them.

    Raises:
        ViewError: ``run_dir`` is no directory, it holds neither metrics nor trajectory files,
            or a limit is not positive.
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
        if (m := _STEP_FILE.match(p.name)) and p.is_file()  # not a link to /dev/zero
    )
    metrics_path = run / "metrics.jsonl"
    no_trajectories = (
        f"This run saved no trajectories ({folder.name}/step_*.jsonl), so only its curves are "
        "shown. To page through samples, run the recipe with `trajectories: true` (and "
        "`trajectory_tokens: true` to colour the tokens)."
    )
    if not files and not metrics_path.is_file():
        raise ViewError(
            f"{run} has neither metrics.jsonl nor saved trajectories. {no_trajectories}"
        )
    rows, bad_metrics = _read_jsonl(metrics_path) if metrics_path.is_file() else ([], 0)
    budget, used, size_cut = max_mib * 2**20, 0, False
    records: list[dict[str, Any]] = []  # oldest step first
    media: dict[str, list[dict[str, Any]]] = {}
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
            rec = dict(rec, step=rec.get("step", step), index=index)
            rec["group"] = groups.setdefault(key, len(groups))
            where = rec.get("where") if isinstance(rec.get("where"), str) else ""
            size = len(json.dumps(rec))
            if where and where not in media:
                media[where] = _record_media(where, cache, run)
                # The characters its media's data URIs (a video's frames' too) add to the page.
                items = [x for m in media[where] for x in (m, *m.get("frames", ()))]
                size += sum(len(x.get("uri", "")) for x in items)
            if used + size > budget and (records or kept):
                size_cut = True
                break
            used += size
            kept.append(rec)
        if kept:
            records[:0] = kept
            total_samples += len(lines)
        if size_cut:
            break
    shown = sorted({rec["step"] for rec in records})
    return {
        "run": run.resolve().name,
        "curves": curves(rows),
        "metrics_file": metrics_path.is_file(),
        "samples": records,
        "media": {k: v for k, v in media.items() if v},
        "tokens": any("tokens" in r for r in records),
        "cap": {
            "no_trajectories": None if files else no_trajectories,
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
