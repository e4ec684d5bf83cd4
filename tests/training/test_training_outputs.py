"""check_output_dir: fail fast, naming the path, when the run cannot write its outputs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from lightrft.config import ConfigError
from lightrft.training.outputs import check_output_dir, release_output_dir


def test_creates_missing_directory(tmp_path):
    out = check_output_dir(tmp_path / "a" / "b")
    assert out.is_dir() and [p.name for p in out.iterdir()] == [".lightrft.lock"]  # no probe


def test_rejects_a_file_and_paths_below_it(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"output_dir '.*file.txt' exists and is not a directory"):
        check_output_dir(f)
    with pytest.raises(ValueError, match=r"output_dir '.*file.txt/run' cannot be created"):
        check_output_dir(f / "run")


def test_rejects_unset():
    for bad in (None, "", "  "):
        with pytest.raises(ValueError, match="output_dir is not set"):
            check_output_dir(bad)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_rejects_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=r"output_dir '.*ro' is not writable"):
            check_output_dir(ro)
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_rejects_unwritable_existing_directory():
    # /proc/self exists and is a directory that nobody, root included, can create files in.
    with pytest.raises(ValueError, match=r"output_dir '/proc/self' is not writable"):
        check_output_dir("/proc/self")


# --- one run per output directory (issue 16, items 5 and 6) -------------------------------------

_HOLD = """
import sys, time
from lightrft.training.outputs import check_output_dir
check_output_dir(sys.argv[1], resume=False)
print("locked", flush=True)
time.sleep(60)
"""

_TRY = """
import sys
from lightrft.training.outputs import check_output_dir
try:
    check_output_dir(sys.argv[1], resume=False)
except ValueError as e:
    print("refused:", e)
    sys.exit(3)
print("claimed")
"""


def _py(code, *args, **kw):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], text=True, **kw)


def test_two_processes_cannot_share_an_output_dir_and_a_dead_owner_is_stale(tmp_path):
    out = tmp_path / "run"
    holder = _py(_HOLD, out, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "locked"
        lock = json.loads((out / ".lightrft.lock").read_text())
        assert lock["pid"] == holder.pid and lock["host"] == socket.gethostname()
        second = subprocess.run(
            [sys.executable, "-c", _TRY, str(out)], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 3, second.stderr
        assert f"in use by another run (process {holder.pid} on host" in second.stdout
        assert "choose another output_dir" in second.stdout
    finally:
        holder.kill()  # SIGKILL: no atexit, the lock file stays behind
        holder.wait()
    assert (out / ".lightrft.lock").exists()
    third = subprocess.run(
        [sys.executable, "-c", _TRY, str(out)], capture_output=True, text=True, timeout=60
    )
    assert third.returncode == 0, third.stdout + third.stderr
    assert f"removing a stale lock of process {holder.pid}" in third.stdout
    assert not (out / ".lightrft.lock").exists()  # released at exit


def test_lock_from_another_host_is_reported_with_how_to_remove_it(tmp_path):
    (tmp_path / ".lightrft.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(ValueError, match=r"process 1 on host elsewhere.*delete .*\.lightrft\.lock"):
        check_output_dir(tmp_path, lock=True)


def test_fresh_run_into_a_used_directory_is_refused_unless_overwrite_or_resume(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000010").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "final").mkdir()
    (out / "view.html").write_text("<html>the old run's page</html>")
    (out / "my_notes.txt").write_text("keep me")
    with pytest.raises(
        ValueError,
        match=r"already holds a run \(checkpoints, metrics.jsonl, final, view.html\)"
        r".*resume=true to continue.*overwrite=true",
    ):
        check_output_dir(out, resume=False)
    assert check_output_dir(out, resume=True) == out  # resuming is what the directory is for
    assert (out / "metrics.jsonl").exists()
    check_output_dir(out, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [".lightrft.lock", "my_notes.txt"]
    check_output_dir(out, resume=False)  # now empty of run outputs: a fresh run may start
    with pytest.raises(ConfigError, match="contradict"):  # a UserError: one line, exit 2
        check_output_dir(out, resume=True, overwrite=True)
    release_output_dir(out)
    assert not (out / ".lightrft.lock").exists()


def test_run_killed_before_its_first_checkpoint_says_how_to_restart(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints" / "step_000010.tmp").mkdir(parents=True)  # a save that never finished
    with pytest.raises(ValueError, match=r"stopped before its first checkpoint.*overwrite=true"):
        check_output_dir(tmp_path, resume=False)


def test_only_rank_zero_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert check_output_dir(tmp_path, resume=False) == tmp_path  # rank 0 decides, not rank 1
    assert not (tmp_path / ".lightrft.lock").exists()
