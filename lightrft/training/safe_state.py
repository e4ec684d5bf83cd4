"""Checkpoint files that cannot run code when loaded.

Two parts:

* Per-rank state (dataloader positions, RNG states, counters, ``extra``) is written as JSON plus
  one safetensors file holding every tensor and numpy array. Loading parses JSON and reads raw
  tensor bytes: nothing is unpickled. Tuples, non-string dict keys, numpy arrays and scalars are
  tagged so they come back as they went in (the python RNG state is a tuple of tuples; numpy's is
  a tuple holding an array), which keeps resume bitwise.
* DCP parts. ``torch.distributed.checkpoint`` unpickles its ``.metadata`` file and loads
  non-tensor entries (optimizer hyperparameters, LR scheduler state) with
  ``torch.load(weights_only=False)``. :class:`SafeFileSystemReader` reads ``.metadata`` with an
  unpickler that only builds DCP's own metadata classes (plus ``torch.Size``, dtypes, layouts and
  paths), and :class:`SafeLoadPlanner` loads the non-tensor entries with ``weights_only=True``.
"""

from __future__ import annotations

import glob
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from lightrft.config import UserError

TAG = "__lightrft__"


class UnsafeCheckpointError(UserError, ValueError):
    """A checkpoint file holds something that would run code or is not in our format."""


class DamagedStateError(UnsafeCheckpointError):
    """A per-rank state or DCP metadata file that is missing or does not parse (truncated,
    overwritten): damage, not a refused format, so a resume may fall back to an older
    checkpoint."""


# ---------------------------------------------------------------------------------------------
# per-rank state: JSON + safetensors


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if obj is None or type(obj) in (bool, str, int, float):  # exact: np.float64 is a float
        return obj
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {TAG: "tensor", "key": key}
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [_encode(x, tensors) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x, tensors) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k != TAG for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {
            TAG: "dict",
            "items": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()],
        }
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        # safetensors stores uint16/32/64 as they are (numpy's MT19937 state is a uint32 array);
        # the dtype in JSON also reads the signed bytes older checkpoints kept them as.
        tensors[key] = torch.from_numpy(np.array(obj, order="C"))
        return {TAG: "ndarray", "key": key, "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return {TAG: "npscalar", "dtype": obj.dtype.str, "value": obj.item()}
    raise TypeError(
        f"cannot store a {type(obj).__name__} in checkpoint state: use None, bool, int, float, "
        "str, list, tuple, dict, torch.Tensor or numpy arrays"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(TAG)
    if tag is None:
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if tag == "tensor":
        return tensors[obj["key"]]
    if tag == "tuple":
        return tuple(_decode(x, tensors) for x in obj["items"])
    if tag == "dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["items"]}
    if tag == "ndarray":
        return tensors[obj["key"]].numpy().view(np.dtype(obj["dtype"])).copy()
    if tag == "npscalar":
        return np.dtype(obj["dtype"]).type(obj["value"])
    raise UnsafeCheckpointError(f"unknown tag {tag!r} in checkpoint state")


def save_state(obj: Any, stem: Path) -> None:
    """Write ``obj`` to ``<stem>.json`` and ``<stem>.safetensors`` (each atomically)."""
    tensors: dict[str, torch.Tensor] = {}
    doc = json.dumps(_encode(obj, tensors), allow_nan=True)
    blob = safetensors.torch.save(tensors)
    for suffix, data in ((".safetensors", blob), (".json", doc.encode())):
        write_atomic(stem.with_name(stem.name + suffix), data)


def stored_alike(a: Any, b: Any) -> bool:
    """Whether :func:`save_state` stores ``a`` and ``b`` alike: the same JSON, the same tensor
    bytes (a per-rank value that must be the same on every rank)."""
    ta, tb = {}, {}
    return _encode(a, ta) == _encode(b, tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old or the new content, never a torn file.
    The temporary file a killed writer left beside it (``.NAME.PID.tmp``, PID gone) is removed."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = stale.name[len(path.name) + 2 : -4]
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def load_state(stem: Path) -> Any:
    """Read what :func:`save_state` wrote; never unpickles."""
    js, st = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".safetensors")
    if not js.is_file():
        legacy = stem.with_name(stem.name + ".pt")
        if legacy.is_file():
            raise UnsafeCheckpointError(
                f"{legacy} is a pickled per-rank state file from an older LightRFT; it is not "
                "loaded because unpickling can run arbitrary code. Resume from a checkpoint "
                "written by this version (or start the run again)"
            )
        raise DamagedStateError(f"per-rank state {js} is missing")  # e.g. copied in part
    try:
        doc = json.loads(js.read_text())
        tensors = safetensors.torch.load(st.read_bytes()) if st.is_file() else {}
        return _decode(doc, tensors)
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedStateError(f"per-rank state {js} is corrupt: {e}") from None


# ---------------------------------------------------------------------------------------------
# DCP: restricted .metadata unpickling, weights_only for non-tensor entries

_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata":
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(stream: io.BufferedIOBase, where: Any) -> Any:
    """Unpickle a DCP ``.metadata`` stream with only DCP's classes allowed."""
    try:
        return _MetadataUnpickler(stream).load()
    except (EOFError, pickle.UnpicklingError) as e:
        if isinstance(e, EOFError) or "truncated" in str(e):  # damage, not a refused object
            raise DamagedStateError(
                f"{where} is damaged (checkpoint metadata is truncated)"
            ) from None
        raise UnsafeCheckpointError(
            f"{where}: refused to load checkpoint metadata ({e}); the file was not written by "
            "torch.distributed.checkpoint or was tampered with"
        ) from None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_dcp_metadata(f, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads DCP's non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn!r} holds a non-data object and was "
                f"not loaded: {str(e).splitlines()[0]}"
            ) from None
        # Re-serialise the vetted object so the parent's (pickle-based) loader sees plain data.
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)
