"""Runs inside the sandbox process, before the untrusted program (standard library only).

    python -I _sandbox_child.py '<json settings>' program.py

Applies the limits to itself, then ``exec``s Python on the program so they hold for it and
every child it starts: a pids cgroup (joined first), no network (a new network namespace),
resource limits (CPU seconds, address space, file size, processes, no core dumps). What could
not be applied is written to ``.sandbox`` in the working directory for the parent to warn about.
"""

import ctypes
import json
import os
import resource
import sys
from contextlib import suppress

CLONE_NEWNET = 0x40000000


def main() -> None:
    cfg = json.loads(sys.argv[1])
    missing = []
    if cfg.get("cgroup"):
        try:
            with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            missing.append("cgroup")
    if cfg.get("no_network"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:  # needs CAP_SYS_ADMIN (or a user namespace)
            missing.append("network")
    limits = [
        (resource.RLIMIT_CPU, cfg["cpu_seconds"], cfg["cpu_seconds"] + 1),
        (resource.RLIMIT_AS, cfg["memory_bytes"], cfg["memory_bytes"]),
        (resource.RLIMIT_FSIZE, cfg["output_bytes"], cfg["output_bytes"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if cfg.get("nproc"):
        # RLIMIT_NPROC counts every process of the user, so allow the ones already running.
        uid, mine = os.getuid(), 0
        for pid in os.listdir("/proc"):
            with suppress(OSError):
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                    mine += 1
        limits.append((resource.RLIMIT_NPROC, mine + cfg["nproc"], mine + cfg["nproc"]))
    for what, soft, hard in limits:
        try:
            resource.setrlimit(what, (soft, hard))
        except (ValueError, OSError):
            missing.append(f"rlimit {what}")
    with open(".sandbox", "w") as f:
        f.write(json.dumps(missing))
    os.execv(sys.executable, [sys.executable, "-I", *sys.argv[2:]])


if __name__ == "__main__":
    main()
