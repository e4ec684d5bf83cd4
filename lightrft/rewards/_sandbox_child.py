"""Runs inside the sandbox process, before the untrusted program (standard library only).

    python -I _sandbox_child.py '<json settings>'     # run one program (the harness below)
    python -I _sandbox_child.py probe                 # exit 0 iff the isolation can be set up

The launcher joins the run's pids cgroup, then, with ``"isolate"``, ``unshare(2)``s new PID,
network, mount and IPC namespaces (and a user namespace when it is not root) and forks: the child
is PID 1 of the new PID namespace. The child makes every mount private and read-only, mounts a
fresh ``/proc`` (only the sandbox's own processes), puts empty private tmpfs over ``/tmp``,
``/var/tmp``, ``/root``, ``/home``, ``/run`` and ``/dev/shm``, binds back the working directory
(writable) and the Python installation (read-only) where they were hidden, drops to uid/gid 65534
when the launcher is root (else keeps the user's own uid, mapped to itself, so ``execve`` leaves
it no capabilities), sets ``PR_SET_NO_NEW_PRIVS``, a parent-death ``SIGKILL`` and the resource
limits (CPU seconds, address space, file size, processes, no core dumps), and ``exec``s the
harness. When the harness (PID 1) exits, the kernel kills every process left in its namespace.
A setup error is sent to the launcher through a close-on-exec pipe and ends the run (exit 125):
it never runs the program with less isolation than asked. Without ``"isolate"`` only the limits
(and, where allowed, a new network namespace) apply. What the launcher could not apply goes to
the JSON status file named in the settings, outside the working directory.

The harness gets the program (and the rewritten assert test) first on its stdin pipe, never
through a file; what follows is the program's input.
"""

import ctypes
import json
import os
import resource
import signal
import sys
from contextlib import suppress
from ctypes import c_char_p, c_int, c_ulong

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
NOBODY = 65534
MASKED = ("/tmp", "/var/tmp", "/root", "/home", "/run", "/dev/shm")
TMPFS_OPTIONS = {
    "/tmp": "size=64m,mode=1777",
    "/var/tmp": "size=16m,mode=1777",
    "/dev/shm": "size=16m,mode=1777",
}

# Runs the program, then the rewritten assert test, in one namespace. The audit hook refuses
# writes, deletions and new programs outside the working directory: a guard against careless
# code only (ctypes and _posixsubprocess get around it); the namespaces are the boundary.
HARNESS = r"""# lightrft-sandbox-harness
def _guard(root):
    import os
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    paths = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
             "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree"}
    execs = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
             "pty.spawn"}
    def inside(path):
        if isinstance(path, int):
            return True
        return (os.path.realpath(os.fsdecode(path)) + os.sep).startswith(root)
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (mode and any(c in str(mode) for c in "wax+")) or (flags or 0) & write
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in paths:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} outside the working directory")
        elif event in execs:
            raise PermissionError(f"sandbox: {event} is not allowed")
    return hook

def _encoder():
    import operator
    def enc(v, depth=0):
        if depth > 64:
            raise ValueError("nested too deeply")
        if v is None:
            return ["n", None]
        if v is True or v is False:
            return ["b", v]
        if isinstance(v, float):
            return ["f", float.__repr__(v)]
        if isinstance(v, int):
            return ["i", int.__repr__(v)]
        if isinstance(v, complex):
            c = complex(v)
            return ["c", [float.__repr__(c.real), float.__repr__(c.imag)]]
        if isinstance(v, str):
            return ["s", str.__str__(v)]
        if isinstance(v, (bytes, bytearray)):
            return ["y", bytes(v).hex()]
        for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
            if isinstance(v, kind):
                return [tag, [enc(x, depth + 1) for x in kind.__iter__(v)]]
        if isinstance(v, dict):
            return ["d", [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in dict.items(v)]]
        if hasattr(type(v), "__index__"):
            return ["i", int.__repr__(operator.index(v))]
        raise TypeError(f"a {type(v).__name__} is not plain data")
    return enc

def _reporter(fd):
    import json, os
    enc, dumps, write = _encoder(), json.dumps, os.write
    def report(site, *probes):
        values = []
        for p in probes:
            try:
                values.append(enc(p()))
            except BaseException as e:  # the assert fails if its condition needs this value
                values.append(["x", type(e).__name__])
        write(fd, (dumps([site, values]) + "\n").encode())
    return report

def _main():
    import json, os, sys
    job_bytes, report_fd = int(sys.argv[1]), int(sys.argv[2])
    data = bytearray()  # the job, read from stdin; the rest of stdin is the program's
    while len(data) < job_bytes and (chunk := os.read(0, job_bytes - len(data))):
        data += chunk
    job = json.loads(data)
    del data
    import builtins
    clean = dict(builtins.__dict__)  # taken before the program can replace a builtin
    run, build = exec, compile
    program, test = job.pop("program"), job.pop("test")
    report = _reporter(report_fd) if test is not None else os.close(report_fd)
    ns = {"__name__": "__main__"}
    sys.addaudithook(_guard(os.getcwd() + os.sep))
    run(build(program, "program.py", "exec"), ns)
    if test is not None:
        # The test's own namespace: the program's names, except any that shadow a builtin,
        # and the builtins as they were before the program ran.
        tns = {k: v for k, v in ns.items() if k not in clean}
        tns.update(__name__="__main__", __builtins__=clean, __lightrft_report__=report)
        sys.stdin = open(os.devnull)
        run(build(test, "test.py", "exec"), tns)
    sys.stdout.flush()

_main()
"""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [c_char_p, c_char_p, c_char_p, c_ulong, c_char_p]
_libc.unshare.argtypes = [c_int]
_libc.prctl.argtypes = [c_int, c_ulong, c_ulong, c_ulong, c_ulong]


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _ok(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mount_points() -> list[str]:
    """Mount points of this mount namespace, parents first."""
    with open("/proc/self/mountinfo") as f:  # field 5, with \040 for a space
        points = {line.split()[4].encode().decode("unicode_escape") for line in f}
    return sorted(points, key=lambda p: p.count("/"))


def _mount_flags(path: str) -> int:
    """The per-mount flags of the mount at ``path`` as ``MS_*`` bits (kept on a remount: a user
    namespace may not clear the ones it inherited)."""
    f = os.statvfs(path).f_flag
    same = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME
    return (f & same) | (MS_RELATIME if f & os.ST_RELATIME else 0)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _python_dirs() -> list[str]:
    """Directories the interpreter needs: its installation, and the virtual environment its
    executable lives in (which ``sys.prefix`` does not name under ``-S``: a venv in ``/home``
    or ``/tmp`` would otherwise be masked and the exec fail)."""
    exe = os.path.abspath(sys.executable)
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(exe)]
    paths.append(os.path.dirname(os.path.realpath(exe)))
    venv = os.path.dirname(os.path.dirname(exe))
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        paths.append(venv)
    dirs = {os.path.realpath(p) for p in paths}
    return sorted(d for d in dirs if not any(d != o and _under(d, o) for o in dirs))


def _setup_mounts(work: str) -> None:
    """Private, read-only mounts, a fresh /proc, tmpfs over ``MASKED``, then the working
    directory (writable) and the Python installation (read-only) bound back where hidden."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Opened in this mount namespace (a bind from another namespace's mount is refused).
    keep = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in [work, *_python_dirs()]]
    for point in _mount_points():
        try:
            flags = _mount_flags(point)
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            if point == "/":
                raise
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for d in MASKED:
        if os.path.isdir(d) and not os.path.islink(d):
            opts = TMPFS_OPTIONS.get(d, "size=1m,mode=755")
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for path, fd in keep:
        writable = path == work
        if not writable and not any(_under(path, m) for m in MASKED):
            continue  # still visible, read-only
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND)
        flags = _mount_flags(path) & ~MS_RDONLY
        _mount(None, path, None, MS_REMOUNT | MS_BIND | flags | (0 if writable else MS_RDONLY))
    for _, fd in keep:
        os.close(fd)
    os.chdir(work)  # the old working directory still points into the read-only mount


def _limits(cfg: dict, owner_uid: int) -> list[tuple[int, int, int]]:
    limits = [
        (resource.RLIMIT_CPU, cfg["cpu_seconds"], cfg["cpu_seconds"] + 1),
        (resource.RLIMIT_AS, cfg["memory_bytes"], cfg["memory_bytes"]),
        (resource.RLIMIT_FSIZE, cfg["output_bytes"], cfg["output_bytes"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if cfg.get("nproc"):
        # RLIMIT_NPROC counts every process of the user, so allow the ones already running.
        mine = 0
        for pid in os.listdir("/proc"):
            with suppress(OSError):
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == owner_uid:
                    mine += 1
        limits.append((resource.RLIMIT_NPROC, mine + cfg["nproc"], mine + cfg["nproc"]))
    return limits


def run_isolated(argv: list[str], cfg: dict) -> int:
    """Run ``argv`` as PID 1 of new namespaces; its exit status (125: the setup failed)."""
    uid, gid = os.getuid(), os.getgid()
    as_root = uid == 0
    work = os.getcwd()
    limits = _limits(cfg, NOBODY if as_root else uid) if cfg else []
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC
    if cfg.get("no_network", True):
        flags |= CLONE_NEWNET
    _ok(_libc.unshare(flags | (0 if as_root else CLONE_NEWUSER)), "unshare")
    if not as_root:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means the exec happened
    pid = os.fork()
    if pid == 0:
        try:  # in PID 1 of the new namespaces: mounts, then drop privileges and apply the limits
            os.close(err_r)
            _setup_mounts(work)
            if as_root:
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
            _ok(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
            _ok(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
            for what, soft, hard in limits:  # a limit that cannot be set ends the run
                resource.setrlimit(what, (soft, hard))
            os.execv(argv[0], argv)
        except BaseException as e:  # noqa: BLE001 - reported to the launcher, never run on
            with suppress(OSError):
                os.write(err_w, f"{type(e).__name__}: {e}".encode()[:4000])
        os._exit(125)
    os.close(err_w)
    err = os.read(err_r, 4096)  # one write under PIPE_BUF is atomic: one read has all of it
    _, status = os.waitpid(pid, 0)
    if err:
        raise OSError(f"sandbox setup failed: {err.decode(errors='replace')}")
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main() -> None:
    if sys.argv[1] == "probe":
        try:
            sys.exit(run_isolated([sys.executable, "-I", "-S", "-c", "pass"], {}))
        except OSError as e:
            sys.exit(str(e))  # printed (to stderr), exit status 1
    cfg = json.loads(sys.argv[1])
    status: dict = {"missing": [], "error": None}
    for key in ("cgroup", "memory_cgroup"):  # the run's processes, and its memory, together
        if cfg.get(key):
            try:
                _write(os.path.join(cfg[key], "cgroup.procs"), str(os.getpid()))
            except OSError:
                status["missing"].append(key)
    argv = [sys.executable, "-I", "-c", HARNESS, str(cfg["job_bytes"]), str(cfg["report_fd"])]
    if cfg["isolate"]:
        _write(cfg["status"], json.dumps(status))
        try:
            os._exit(run_isolated(argv, cfg))  # 0-255, or 128 + the signal that ended it
        except OSError as e:
            status["error"] = str(e)
            _write(cfg["status"], json.dumps(status))
            os._exit(125)
    if cfg.get("no_network"):  # where allowed: the fallback warning says the network may be open
        _libc.unshare(CLONE_NEWNET)
    for what, soft, hard in _limits(cfg, os.getuid()):
        try:
            resource.setrlimit(what, (soft, hard))
        except (ValueError, OSError):
            status["missing"].append(f"rlimit {what}")
    _write(cfg["status"], json.dumps(status))
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
