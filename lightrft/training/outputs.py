"""The run's output directory: checked before any heavy work, owned by one run at a time.

A run writes ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/``, ``trajectories/``,
``final/`` (and ``wandb/``) under its ``output_dir``. :func:`check_output_dir` makes sure that

* the directory exists and is writable,
* no other live run uses it: an exclusive lock file ``.lightrft.lock`` holding the owner's PID,
  host and process start time, created atomically (``O_EXCL``) and removed at exit. A lock whose
  process is gone (same host, PID dead or reused) is stale and taken over; a lock from another
  host cannot be checked and is reported with the command to remove it;
* a fresh run (``resume=false``) does not land on an earlier run's outputs: it is refused unless
  ``overwrite=true`` (those outputs are deleted first) or ``resume=true``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from lightrft.config import ConfigError
from lightrft.sections import require_output_dir
from lightrft.training.safe_state import pid_alive

LOCK_NAME = ".lightrft.lock"
# view.html: `lightrft view`'s page of the run, stale once the run is replaced.
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "tensorboard",
    "trajectories",
    "final",
    "wandb",
    "view.html",
)


def check_output_dir(
    path: str | os.PathLike | None,
    *,
    resume: bool | None = None,
    overwrite: bool = False,
    lock: bool | None = None,
) -> Path:
    """Create ``path`` if needed, prove it writable, claim it for this run; return it.

    Raises a ``ValueError`` naming the path when it is unset, is a file, cannot be created or
    cannot be written, so a run fails in its first second instead of at its first checkpoint.

    ``lock`` (default: true on global rank 0, read from ``$RANK`` so it works before the process
    group exists) takes the directory's run lock for this process's lifetime and applies the
    fresh-run rule: with ``resume=False`` a directory holding an earlier run's outputs
    (:data:`RUN_OUTPUTS`) is refused unless ``overwrite=True``, which deletes them first
    (``resume=None``: no fresh-run rule, for callers whose outputs are not a training run).
    Other ranks only check writability (the probe file name is unique per process).
    A recipe passes its ``resume`` and ``overwrite`` config keys.
    """
    check_resume_overwrite(resume, overwrite, ConfigError)  # a UserError: one line, exit 2
    require_output_dir(path)
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"output_dir {str(p)!r} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir {str(p)!r} cannot be created: {e.strerror or e}") from None
    try:  # a file this process may create there (and removes at once)
        tempfile.NamedTemporaryFile(dir=p, prefix=".write_probe.").close()
    except OSError as e:
        raise ConfigError(f"output_dir {str(p)!r} is not writable: {e.strerror or e}") from None
    if lock is None:
        lock = int(os.environ.get("RANK", "0")) == 0
    if lock:
        _lock(p)
        if resume is not None:
            _check_fresh_run(p, resume=resume, overwrite=overwrite)
    return p


def check_resume_overwrite(
    resume: bool | None, overwrite: bool, error: type[ValueError] = ValueError
) -> None:
    """Refuse ``resume=true`` with ``overwrite=true`` (an ``error``: the config reading adds the
    key's place to a plain ``ValueError``): the one place of this rule, which
    :func:`check_output_dir` and the training config (when it is read) apply."""
    if resume and overwrite:
        raise error(
            "resume=true and overwrite=true contradict each other: resume continues the run in "
            "output_dir, overwrite deletes it; choose one"
        )


def release_output_dir(path: str | os.PathLike) -> None:
    """Drop this process's lock on ``path`` (also done at exit; a no-op when not held)."""
    lock = Path(path).expanduser() / LOCK_NAME
    owner = _read_lock(lock)
    if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def _check_fresh_run(p: Path, *, resume: bool, overwrite: bool) -> None:
    found = [name for name in RUN_OUTPUTS if (p / name).exists()]
    if not found or resume:
        return
    if overwrite:
        for name in found:
            target = p / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        print(f"overwrite=true: deleted the previous run's {', '.join(found)} in {p}", flush=True)
        return
    how = (
        "resume=true to continue it from its last checkpoint, "
        if any((p / "checkpoints").glob("step_*[0-9]"))  # none when it is no directory
        else "(it stopped before its first checkpoint, so there is nothing to resume) "
    )
    raise ConfigError(
        f"output_dir {str(p)!r} already holds a run ({', '.join(found)}); a fresh run would mix "
        f"its metrics and checkpoints with it. Pass {how}overwrite=true to delete those outputs "
        "and start over, or choose another output_dir"
    )


# ---------------------------------------------------------------------------------------------
# the lock file


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after "pid (comm)"


def _alive(pid: int, start: str | None) -> bool:
    if not pid_alive(pid):
        return False
    now = _start_time(pid)
    return start is None or now is None or now == start


def _read_lock(lock: Path) -> dict:
    try:
        data = json.loads(lock.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _lock(p: Path) -> None:
    lock = p / LOCK_NAME
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start": _start_time(os.getpid()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for _ in range(3):
        try:
            with open(lock, "x") as f:  # O_CREAT | O_EXCL: one creator wins
                json.dump(me, f)
            atexit.register(release_output_dir, p)  # the lock goes when this process ends
            break
        except FileExistsError:
            owner = _read_lock(lock)
            if owner.get("pid") == me["pid"] and owner.get("host") == me["host"]:
                break  # this process already holds it (runs started one after another)
            if not owner:  # torn or empty: its writer died between create and write
                try:
                    age = time.time() - lock.stat().st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                if age > 10:
                    lock.unlink(missing_ok=True)
                    continue
            elif owner.get("host") == me["host"] and not _alive(
                int(owner.get("pid", -1)), owner.get("start")
            ):
                print(
                    f"output_dir {str(p)!r}: removing a stale lock of process {owner['pid']}, "
                    "which is gone",
                    flush=True,
                )
                lock.unlink(missing_ok=True)
                continue
            raise ConfigError(
                f"output_dir {str(p)!r} is in use by another run (process {owner.get('pid')} on "
                f"host {owner.get('host')}, since {owner.get('time')}; lock file {lock}). Two "
                "runs in one directory would mix their metrics and delete each other's "
                "checkpoints: wait for it, stop it, or choose another output_dir. If that run "
                f"is gone (e.g. it ran on another host), delete {lock}"
            ) from None
    else:
        raise ConfigError(f"output_dir {str(p)!r}: could not take the run lock {lock}")
