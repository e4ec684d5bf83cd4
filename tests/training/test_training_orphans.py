"""Workers die with their launcher: kill -9 the parent, the child (in init_distributed) exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_WORKER = """
import os, time
os.environ["LOCAL_RANK"] = "0"  # what torchrun sets; no RANK/WORLD_SIZE: no process group
from lightrft.distributed import init_distributed
init_distributed("cpu")
print("ready", flush=True)
time.sleep(120)
"""

_LAUNCHER = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {_WORKER!r}], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie no one reaped yet


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_worker_exits_when_its_launcher_is_killed():
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True
    )
    worker = int(launcher.stdout.readline())
    assert not _gone(worker)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert _gone(worker), "the worker outlived its launcher"
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
