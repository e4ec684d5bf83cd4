"""Load records (one dict per sample) from local files, with errors that say where the problem is.

Supported sources:

- ``*.jsonl``: one JSON object per line; blank lines are skipped.
- ``*.json``: a list of objects, or an object whose ``"data"`` key holds that list.
- ``*.parquet``: one record per row.
- a directory written by ``datasets.Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``.
- a plain directory holding ``<split>.jsonl`` / ``<split>.json`` / ``<split>.parquet``.

Every record remembers where it came from (file and line or row), so a missing field in record
1234 of a 10 GB file is reported as ``train.jsonl line 1235`` instead of a bare ``KeyError``.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from lightrft.config import UserError

PathLike = str | os.PathLike


class DataError(UserError, ValueError):
    """A problem with the user's data: names the file and the line, record or field."""


@dataclass(eq=False, repr=False)  # identity and object repr, not a dump of every record
class Records(Sequence[dict[str, Any]]):
    """A list of record dicts plus, for each, where it came from (``where(i)``)."""

    _records: list[dict[str, Any]]
    _origins: list[str]
    name: str  # the source(s), for messages about the whole dataset
    # Per record: the directory that relative paths in it (e.g. images) are relative to.
    _dirs: list[Path | None]

    def __post_init__(self) -> None:
        assert len(self._records) == len(self._origins) == len(self._dirs)

    @classmethod
    def from_list(cls, records: Sequence[Mapping[str, Any]], name: str = "records") -> Records:
        """Wrap in-memory records; each is checked to be a mapping."""
        out = []
        for i, rec in enumerate(records):
            if not isinstance(rec, Mapping):
                raise DataError(f"{name}[{i}]: expected an object (dict), got {type(rec).__name__}")
            out.append(dict(rec))
        return cls(out, [f"{name}[{i}]" for i in range(len(out))], name, [None] * len(out))

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i):  # type: ignore[override]
        return self._records[i]

    def where(self, i: int) -> str:
        """Human-readable location of record ``i``, e.g. ``data/train.jsonl line 12``."""
        return self._origins[i]

    def base_dir(self, i: int) -> Path | None:
        """The directory of record ``i``'s data file (None for in-memory records)."""
        return self._dirs[i]

    def __add__(self, other: Records) -> Records:
        return Records(
            self._records + other._records,
            self._origins + other._origins,
            f"{self.name}, {other.name}",
            self._dirs + other._dirs,
        )


def local_file(value: str | Path, base_dir: Path | None, where: str, field: str, what: str) -> Path:
    """The file a record names (``~`` expanded, relative to ``base_dir``, the data file's
    directory), or a :class:`DataError` naming ``where``, ``field`` and the missing ``what``."""
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise DataError(f"{where}: {field}: {what} file not found: {path}")
    return path


class MediaItems:
    """Base of a dataclass holding the processed media of one kind of a sample (or, after
    :meth:`cat`, of a micro-batch): its first field lists the items, ``model_keys`` names the
    fields the model's forward takes."""

    kind: ClassVar[str]
    model_keys: ClassVar[tuple[str, ...]]

    def __len__(self) -> int:
        return len(getattr(self, fields(self)[0].name))  # type: ignore[arg-type]

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The model's keyword arguments (``model_keys`` that are set), on ``device``."""
        out = {k: getattr(self, k) for k in self.model_keys if getattr(self, k) is not None}
        return {k: v.to(device) for k, v in out.items()} if device else out

    @classmethod
    def cat(cls, items: Sequence[Any]) -> Any:
        """The media of several samples, in order (None entries, samples without this kind,
        skipped): lists and tensors joined, settings taken from the first."""
        present = [x for x in items if x is not None and len(x)]
        if len(present) <= 1:
            return present[0] if present else None
        joined: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            values = [getattr(x, f.name) for x in present]
            if isinstance(values[0], list):
                joined[f.name] = [v for vs in values for v in vs]
            elif any(isinstance(v, torch.Tensor) for v in values):
                if any(v is None for v in values):
                    raise ValueError(
                        f"cannot batch {cls.kind}s of different processors ({f.name} mixed)"
                    )
                joined[f.name] = torch.cat(values)
            else:
                joined[f.name] = values[0]
        return cls(**joined)


def require_field(records: Records, i: int, field: str, types: type | tuple[type, ...]) -> Any:
    """``records[i][field]``, or a :class:`DataError` naming the field and the record."""
    rec = records[i]
    if field not in rec or rec[field] is None:
        keys = ", ".join(sorted(map(str, rec))) or "none"
        raise DataError(
            f"{records.where(i)}: missing field {field!r} (the record has: {keys}); "
            "set the dataset's *_field option if your data names it differently"
        )
    value = rec[field]
    if not isinstance(value, types):
        want = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise DataError(
            f"{records.where(i)}: field {field!r} must be {want}, got {type(value).__name__}"
        )
    return value


# ------------------------------------------------------------------------------ file formats


def _bad_utf8(
    path: Path, lineno: int, e: UnicodeDecodeError, line_start: int = 0, base: int = 0
) -> DataError:
    """``e`` of bytes at file byte ``base`` that hold line ``lineno`` from byte ``line_start``."""
    bad = e.object[e.start : e.start + 4]
    return DataError(
        f"{path} line {lineno}: not valid UTF-8 ({e.reason}) at byte offset "
        f"{base + e.start} of the file (byte {e.start - line_start} of the line: {bad!r}); "
        "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )


def _read_jsonl(path: Path) -> Records:
    records, origins = [], []
    with path.open("rb") as f:  # bytes, so a bad byte is reported by line and offset
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _bad_utf8(path, lineno, e, base=f.tell() - len(raw)) from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path} line {lineno}: malformed JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(rec, dict):
                raise DataError(
                    f"{path} line {lineno}: expected a JSON object, got {type(rec).__name__}"
                )
            records.append(rec)
            origins.append(f"{path} line {lineno}")
    return Records(records, origins, str(path), [path.parent] * len(records))


def _read_json(path: Path) -> Records:
    data = path.read_bytes()
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise _bad_utf8(path, lineno, e, data.rfind(b"\n", 0, e.start) + 1) from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path} line {e.lineno}: malformed JSON ({e.msg} at column {e.colno}); "
            "a file with one object per line must be named *.jsonl"
        ) from None
    if isinstance(obj, dict) and "data" in obj:
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(
            f"{path}: expected a JSON list of objects or an object with a 'data' list, "
            f"got {type(obj).__name__}"
        )
    for i, rec in enumerate(obj):
        if not isinstance(rec, dict):
            raise DataError(f"{path} record {i}: expected a JSON object, got {type(rec).__name__}")
    origins = [f"{path} record {i}" for i in range(len(obj))]
    return Records(obj, origins, str(path), [path.parent] * len(obj))


def _rows(name: str, to_list: Callable[[], list[dict[str, Any]]], base_dir: Path) -> Records:
    """The rows ``to_list()`` reads from a parquet table or an HF dataset (``name``)."""
    try:
        rows = to_list()
    except UnicodeDecodeError as e:  # a binary column declared as string
        raise DataError(f"{name}: a string column holds bytes that are not UTF-8 ({e})") from None
    return Records(
        rows, [f"{name} row {i}" for i in range(len(rows))], name, [base_dir] * len(rows)
    )


def _read_parquet(path: Path) -> Records:
    import pyarrow.parquet as pq

    return _rows(str(path), pq.read_table(path).to_pylist, path.parent)


def _read_hf_dir(path: Path, split: str | None) -> Records:
    import datasets

    ds = datasets.load_from_disk(str(path))
    name = str(path)
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise DataError(f"{path} holds splits {sorted(ds)}: set split to one of them")
            split = next(iter(ds))
        if split not in ds:
            raise DataError(f"{path} has no split {split!r}; it has {sorted(ds)}")
        ds, name = ds[split], f"{path}[{split}]"
    elif split is not None and ds.split is not None and str(ds.split) != split:
        raise DataError(f"{path} holds split {str(ds.split)!r}, not the requested {split!r}")
    return _rows(name, ds.to_list, path)


READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def _read_one(path: Path, split: str | None) -> Records:
    if not path.exists():
        raise DataError(f"data file not found: {path} (resolved to {path.resolve()})")
    if not path.is_file():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # by HF
            return _read_hf_dir(path, split)
        # A folder of per-split files, e.g. gsm8k/{train,test}.jsonl.
        if split is None:
            raise DataError(
                f"{path} is a directory but not a saved HF dataset: set split (e.g. 'train') to "
                f"read {path}/<split>.jsonl|.json|.parquet, or point path at a file"
            )
        found = [f for suffix in READERS if (f := path / f"{split}{suffix}").is_file()]
        if not found:
            raise DataError(
                f"no {split}.jsonl, {split}.json or {split}.parquet in directory {path}"
            )
        path = found[0]
    if path.suffix not in READERS:
        raise DataError(
            f"{path}: unsupported file type {path.suffix!r}; use one of {tuple(READERS)}"
        )
    return READERS[path.suffix](path)


def load_records(path: PathLike | Sequence[PathLike], *, split: str | None = None) -> Records:
    """Read all records of one source or of several (concatenated in order).

    Args:
        path: a file, a directory (see module docstring), or a list of them.
        split: the split of a saved ``DatasetDict`` or of a per-split directory.

    Raises:
        DataError: a missing path, malformed JSON (file and line), a non-object record, an
            unknown split, or no records at all.
    """
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise DataError("path is an empty list: name at least one data file")
    out = functools.reduce(operator.add, [_read_one(Path(p).expanduser(), split) for p in paths])
    if len(out) == 0:
        shown = ", ".join(str(p) for p in paths)
        where = f" (split {split!r})" if split else ""
        raise DataError(f"empty dataset: no records in {shown}{where}")
    return out


# ------------------------------------------------------------------------------ generated data


def write_jsonl(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Write one JSON object per line, atomically: a reader never sees a half-written file.

    The data goes to ``.<name>.tmp<pid>`` first, then is renamed; an interruption (Ctrl-C, an
    exception) removes that temporary file instead of leaving it behind.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for rec in records:
                # ASCII escapes keep U+2028 and friends from looking like line breaks.
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def made_with(out: Path, files: Sequence[str], settings: Mapping[str, Any]) -> bool:
    """Whether ``out`` holds ``files`` and a ``meta.json`` recording exactly ``settings`` (what
    the ``ensure_*`` data makers check before regenerating)."""
    meta = out / "meta.json"
    if not meta.is_file() or not all((out / f).is_file() for f in files):
        return False
    try:
        return json.loads(meta.read_text()) == dict(settings)
    except json.JSONDecodeError:
        return False  # a damaged meta file: regenerate
