"""Checks on the run's output directory, done before any heavy work."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output_dir(path: str | os.PathLike | None) -> Path:
    """Create ``path`` if needed and prove it writable by writing a probe file; return it.

    Raises a ``ValueError`` naming the path when it is unset, is a file, cannot be created or
    cannot be written, so a run fails in its first second instead of at its first checkpoint.
    Every rank may call it (the probe file name is unique per process).
    """
    if path is None or str(path).strip() == "":
        raise ValueError(
            "output_dir is not set: give the run a directory for its checkpoints, "
            "metrics and export (output_dir=...)"
        )
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"output_dir {str(p)!r} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"output_dir {str(p)!r} cannot be created: {e.strerror or e}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write_probe.", delete=True) as f:
            f.write(b"ok")
            f.flush()
    except OSError as e:
        raise ValueError(f"output_dir {str(p)!r} is not writable: {e.strerror or e}") from None
    return p
