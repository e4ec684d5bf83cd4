"""A code reward: run the response's Python program against test cases in a sandboxed process.

Each (program, test) pair runs in its own process (``python -I``, launched by
``_sandbox_child.py``). Where the machine allows it (checked once per process by running the
launcher's setup; see :func:`_isolation_problem`) the run is **isolated**:

- new PID, network, mount and IPC namespaces, plus a user namespace when the trainer is not root
  (unprivileged user namespaces); as root the program runs as uid/gid 65534 (nobody) with no
  supplementary groups, as another user it keeps that user's uid (mapped to itself) and no
  capabilities; ``PR_SET_NO_NEW_PRIVS`` either way;
- the program is PID 1 of its PID namespace: when it exits or is killed, the kernel kills every
  process it started, double-forked ``setsid`` daemons included; a parent-death ``SIGKILL`` ends
  it if its launcher is killed;
- a fresh ``/proc`` shows only the sandbox's processes (no parent's ``environ``, no other
  process of the user); ``/tmp``, ``/var/tmp``, ``/root``, ``/home``, ``/run``, ``/dev/shm`` are
  empty private tmpfs; every other mount is read-only (``/`` must be, others where the kernel
  allows); the working directory is bound back writable, the Python installation (and its virtual environment) read-only;
- no network: the new network namespace has only a loopback device, which is down (with
  ``no_network=False`` the host's network namespace is kept).

Always applied, isolated or not: wall-clock (the process group, session and cgroup are
SIGKILLed at ``timeout`` + 0.5 s) and CPU-time limits, an address-space limit (a 10 GB
allocation fails), output capped (stdout goes to a file with ``RLIMIT_FSIZE``), a process limit
(a pids cgroup as root, else ``RLIMIT_NPROC``), and a Python audit hook that refuses writes,
deletions and starting programs outside the working directory (a guard against careless code
only: ``ctypes`` and ``_posixsubprocess`` bypass it; the namespaces are the boundary).

**Not contained, isolated:** the program can read every file that the run's uid may read outside
the masked directories (world-readable files as root, since the program runs as nobody; the
user's own files outside ``/home``, ``/root`` and ``/tmp`` otherwise, e.g. a checkout in
``/work``); it can use CPU, memory and disk up to the limits (files in its working directory on
the host's disk, each up to ``max_output_bytes``; tmpfs ``/tmp`` up to 64 MiB); it can make the
kernel syscalls that the user may (no seccomp filter); it possesses the keys of the trainer's
session keyring, if any. **Where isolation is impossible** (user namespaces disabled by sysctl,
AppArmor's ``kernel.apparmor_restrict_unprivileged_userns``, Docker's default seccomp profile,
root without ``CAP_SYS_ADMIN``) the runs fall back to the limits above with one
``RuntimeWarning`` that says what is then not contained (any file the user may read or write,
other processes' environments, programs, and as non-root daemons and the network);
``require_isolation=True`` refuses to run instead.

**The verdict never depends on anything the program can forge.** stdin/stdout tests: the input
goes in through a pipe, the output is compared here; the expected output never enters the
sandbox. Assert tests (see :mod:`lightrft.rewards.code_asserts`): the test code is parsed here
and each ``assert`` rewritten so that the sandbox only computes the sub-expressions that depend
on the program (``assert f(3) == 9`` sends ``f(3)``; the 9 stays here) and reports their values
through a pipe as tagged JSON data; this process evaluates each condition itself. A test passes
when the run exits 0, every assert site reported at least once, and every report satisfied its
condition. The program and the rewritten test reach the harness through its stdin pipe, ahead
of a stdin test's input, never through a file.
So a program that patches ``exec`` or ``compile``, exits early, prints, inspects the stack,
reads its directory or ``/proc/self/fd/0``, or writes forged reports into the pipe controls at
most the values it was asked for: the same as hard-coding a function's answers, which only
passes where it knows them. Values that are not plain data (as :mod:`code_asserts` defines it)
fail the assert: a custom object that claims to equal anything is never compared by sandbox
code. Comprehensions are iterated here: ``all(f(x) == x * x for x in range(5))`` sends
``[f(x) for x in range(5)]`` and pairs it with this process's own ``range(5)``. The test block
runs in its own namespace: the program's top-level names (except any that shadow a builtin) and
the builtins as they were before the program ran, so redefining ``all``, ``range`` or
``builtins.range`` changes nothing; within an assert, the test's own variables are read before
the program is called.

Residual, by construction: the test block's statements other than the asserts' conditions run
in the program's process, so what they compute (``expected = [1, 2]`` then
``assert f() == expected``, an expected value built with a name not evaluated here such as
``Counter(...)``) is visible to the program, and a program that reaches into the interpreter
(frames, ``gc``, ``ctypes``) can change the test block's variables or its loops' items while it
runs. Asserts whose condition holds its expected values (``assert f(3) == 9``, the HumanEval and
MBPP form) give it nothing but its own return values.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightrft.rewards import code_asserts
from lightrft.rewards.base import RewardInputError, Sample

__all__ = ["CodeVerifier", "RunResult", "TestCase", "extract_code", "parse_tests"]

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_NOBODY = 65534  # the uid and gid of programs when the trainer is root (see _sandbox_child)
# where a cgroup can be made and the file that bounds it: cgroup v1, then v2 (pids.max and
# memory.max exist in a new v2 group only when its parent enables the controller)
_PIDS_CGROUPS = (("/sys/fs/cgroup/pids", "pids.max"), ("/sys/fs/cgroup", "pids.max"))
_MEMORY_CGROUPS = (
    ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
    ("/sys/fs/cgroup", "memory.max"),
)
_warned: set[str] = set()
_NOT_ISOLATED = (
    "CodeVerifier: sandboxed programs are NOT isolated here ({problem}). Still applied: the time, "
    "CPU, memory, output and process limits, a network namespace where allowed, the verdict "
    "computed by this process. Not contained: the program can read every file this user can "
    "(keys, tokens, other processes' /proc/<pid>/environ of this user), write wherever this "
    "user can (the write guard is a Python audit hook that ctypes or _posixsubprocess bypass), "
    "start programs, and (as a non-root user) leave setsid daemons running and connect to the "
    "network (no network namespace without privileges). Pass require_isolation=True to refuse "
    "instead"
)


def extract_code(response: str) -> str:
    """The last fenced code block (```python ... ```) of a response, else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@dataclass(frozen=True)
class TestCase:
    """One test: ``stdin`` -> expected ``stdout`` (whitespace-insensitive), or an assert-style
    ``code`` snippet run after the program, its asserts judged here (module docstring)."""

    stdin: str | None = None
    stdout: str | None = None
    code: str | None = None


def parse_tests(spec: Any) -> list[TestCase]:
    """Test cases from a reference in any of the common formats (a JSON string or an object):

    - APPS: ``{"inputs": [...], "outputs": [...]}``;
    - LiveCodeBench: ``[{"input": ..., "output": ...}, ...]`` (``testtype`` ``"stdin"``);
    - assert-style (HumanEval / MBPP): ``{"asserts": [...]}``, ``[ "assert f(1) == 2", ...]``
      or one string of asserts.
    """
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            return [TestCase(code=spec)]  # a block of assert statements
    if isinstance(spec, Mapping):
        if "inputs" in spec and "outputs" in spec:
            if spec.get("fn_name"):
                raise ValueError("APPS call-based tests (fn_name) are not supported")
            ins, outs = list(spec["inputs"]), list(spec["outputs"])
            if len(ins) != len(outs):
                raise ValueError(f"{len(ins)} inputs but {len(outs)} outputs")
            return [
                TestCase(stdin=_text(i), stdout=_text(o)) for i, o in zip(ins, outs, strict=True)
            ]
        if "asserts" in spec:
            return [TestCase(code=str(a)) for a in spec["asserts"]]
        raise ValueError(f"unknown test format with keys {sorted(spec)}")
    if isinstance(spec, Sequence) and spec:
        if all(isinstance(t, str) for t in spec):
            return [TestCase(code=t) for t in spec]
        if all(isinstance(t, Mapping) and "input" in t and "output" in t for t in spec):
            bad = [t["testtype"] for t in spec if t.get("testtype", "stdin") != "stdin"]
            if bad:
                raise ValueError(f"only stdin tests are supported, got testtype {bad[0]!r}")
            return [TestCase(stdin=_text(t["input"]), stdout=_text(t["output"])) for t in spec]
    raise ValueError(f"cannot read test cases from a {type(spec).__name__}")


def _text(v: Any) -> str:
    return "\n".join(map(str, v)) if isinstance(v, list) else str(v)


def _same_output(got: str, want: str) -> bool:
    """Equal up to whitespace: line by line, each line's whitespace-separated tokens."""
    a = [ln.split() for ln in got.strip().splitlines()]
    b = [ln.split() for ln in want.strip().splitlines()]
    return [x for x in a if x] == [x for x in b if x]


@dataclass
class RunResult:
    """How one sandboxed run ended."""

    passed: bool
    status: str  # "ok", "wrong", "error", "timeout"
    stdout: str = ""


class CodeVerifier:
    """Reward = fraction of test cases passed (or 1/0 for all-or-nothing) by the response's code.

    The reference of each sample holds its tests (:func:`parse_tests` formats). The program is the
    last fenced code block of the response (:func:`extract_code`). Every test runs in a fresh
    sandboxed process (see the module docstring for what is and is not prevented); up to
    ``workers`` run at once.

    Args:
        mode: ``"fraction"`` (tests passed / tests) or ``"all"`` (1 only if every test passes).
        timeout: wall-clock seconds per test (also the CPU-time limit, rounded up).
        memory_mb: address-space limit per test.
        max_output_bytes: stdout beyond this fails the test.
        max_processes: processes a test may start (itself included).
        no_network: run each test in a new network namespace (isolated runs always can; in
            the fallback only root can, and the fallback warning says so).
        workers: tests run in parallel.
        max_tests: use at most this many tests per sample (``None``: all).
        require_isolation: refuse (``RuntimeError`` before any run) where the namespaces cannot
            be created, instead of falling back with a warning.
    """

    name = "code"
    requires_reference = True

    def __init__(
        self,
        mode: Literal["fraction", "all"] = "fraction",
        timeout: float = 5.0,
        memory_mb: int = 1024,
        max_output_bytes: int = 1 << 20,
        max_processes: int = 16,
        no_network: bool = True,
        workers: int | None = None,
        max_tests: int | None = None,
        require_isolation: bool = False,
    ) -> None:
        if mode not in ("fraction", "all"):
            raise ValueError(f"mode must be 'fraction' or 'all', got {mode!r}")
        if not timeout > 0 or memory_mb < 64 or max_output_bytes < 1 or max_processes < 1:
            raise ValueError(
                "timeout must be > 0, memory_mb >= 64, max_output_bytes >= 1, max_processes >= 1"
            )
        self.mode = mode
        self.timeout = float(timeout)
        self.memory_bytes = int(memory_mb) << 20
        self.max_output_bytes = int(max_output_bytes)
        self.max_processes = int(max_processes)
        self.no_network = no_network
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.max_tests = max_tests
        self.require_isolation = require_isolation

    # ------------------------------------------------------------------ one run

    def run(self, program: str, test: TestCase) -> RunResult:
        """Run ``program`` on one test in the sandbox."""
        isolate = self._isolate()
        plan = code_asserts.plan_asserts(test.code) if test.code is not None else None
        tmp = tempfile.mkdtemp(prefix="lightrft-code-")
        work = os.path.join(tmp, "work")  # the program's directory: holds nothing of ours
        os.mkdir(work, 0o700)
        if isolate and os.getuid() == 0:
            os.chown(work, _NOBODY, _NOBODY)  # isolated root runs the program as nobody
        cgroup = _new_cgroup(_PIDS_CGROUPS, "lightrft-sandbox", self.max_processes)
        if cgroup is None and os.getuid() == 0:
            _warn_once(
                "nproc",
                "CodeVerifier: no pids cgroup could be created and RLIMIT_NPROC does not bind "
                "root, so sandboxed code may start any number of processes (they are still "
                "killed at the time limit); run the trainer or the reward server as a non-root "
                "user",
            )
        # A memory cgroup bounds the whole run (every process it starts together) to memory_mb,
        # where one can be made (root, cgroup v1's memory controller or v2's with `memory`
        # enabled); else the bound is memory_mb per process, so memory_mb * max_processes per run.
        memory_cgroup = _new_cgroup(_MEMORY_CGROUPS, "lightrft-sandbox-mem", self.memory_bytes)
        if memory_cgroup is None:
            _warn_once(
                "memory-cgroup",
                "CodeVerifier: no memory cgroup could be made (it needs root and the memory "
                "controller), so memory_mb bounds each process of a run, not the run: a run may "
                "use memory_mb * max_processes",
            )
        job = {"program": program, "test": plan.sandbox_source if plan else None}
        job_json = json.dumps(job).encode()  # on stdin, ahead of a stdin test's input
        stdin = job_json if plan else job_json + (test.stdin or "").encode()
        try:
            # the program's output and its reports, read back capped through the same files
            with open(Path(tmp, "out"), "w+b") as fout, open(Path(tmp, "report"), "w+b") as frep:
                settings = {
                    "cpu_seconds": max(1, int(self.timeout + 0.999)),
                    "memory_bytes": self.memory_bytes,
                    "output_bytes": self.max_output_bytes,
                    "nproc": self.max_processes if cgroup is None else None,
                    "cgroup": cgroup,
                    "memory_cgroup": memory_cgroup,
                    "no_network": self.no_network,
                    "isolate": isolate,
                    "status": os.path.join(tmp, "status.json"),
                    "job_bytes": len(job_json),
                    "report_fd": frep.fileno(),
                }
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", _CHILD, json.dumps(settings)],
                    cwd=work,
                    stdin=subprocess.PIPE,
                    stdout=fout,
                    stderr=subprocess.DEVNULL,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
                    start_new_session=True,  # its own process group and session, to kill
                    pass_fds=(frep.fileno(),),
                )
                # communicate writes stdin from its selector loop, never blocked by a sandbox that
                # does not read it (one that exits or is killed unread closes the pipe: it stops)
                try:
                    proc.communicate(stdin, timeout=self.timeout + 0.5)  # + the launcher's start
                    code = proc.returncode
                except subprocess.TimeoutExpired:
                    code = None
                self._kill_all(proc.pid, cgroup)
                proc.wait()
                proc.stdin.close()
                self._read_status(Path(tmp, "status.json"))
                out = os.pread(fout.fileno(), self.max_output_bytes, 0)
                report = os.pread(frep.fileno(), self.max_output_bytes + 1, 0)
            if code is None:  # timed out
                return RunResult(False, "timeout")
            # Passed: exit status 0, and the output matches (stdin/stdout) or every assert was
            # reported and held (a report over max_output_bytes fails).
            if code != 0:
                ok = False
            elif plan is None:
                ok = _same_output(out.decode(errors="replace"), test.stdout or "")
            else:
                ok = len(report) <= self.max_output_bytes and code_asserts.judge(plan, report)[0]
            status = "ok" if ok else "wrong" if code == 0 else "error"
            return RunResult(ok, status, out.decode(errors="replace"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for group in (cgroup, memory_cgroup):
                if group is not None:
                    self._remove_cgroup(group)

    def _isolate(self) -> bool:
        """Whether runs get the namespaces; warns once (or refuses) where they cannot."""
        problem = _isolation_problem()
        if problem is None:
            return True
        if self.require_isolation:
            raise RuntimeError(
                f"CodeVerifier(require_isolation=True): the sandbox cannot isolate programs "
                f"here ({problem}); run where unprivileged user namespaces are allowed, or as root"
            )
        _warn_once("isolation", _NOT_ISOLATED.format(problem=problem))
        return False

    @staticmethod
    def _read_status(path: Path) -> None:
        """Raise the launcher's setup error; warn once per limit it could not apply."""
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if status.get("error"):
            raise RuntimeError(f"CodeVerifier: {status['error']}")
        for m in status.get("missing", []):
            _warn_once(m, f"CodeVerifier: could not apply the sandbox limit {m!r}")

    @staticmethod
    def _kill_all(pid: int, cgroup: str | None) -> None:
        """SIGKILL every process of the run: its cgroup, its process group, its session."""
        for _ in range(50):
            victims = set()
            if cgroup is not None:
                with suppress(OSError):
                    victims |= {int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()}
            # the processes of its session (children that left the process group)
            for entry in filter(str.isdigit, os.listdir("/proc")):
                with suppress(OSError):
                    if os.getsid(int(entry)) == pid:
                        victims.add(int(entry))
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            for v in victims:
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(v, signal.SIGKILL)
            if not victims - {pid}:
                return
            time.sleep(0.01)

    @staticmethod
    def _remove_cgroup(path: str) -> None:
        for _ in range(200):  # killed processes leave the cgroup when the kernel reaps them
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        _warn_once("cgroup", f"CodeVerifier: could not remove {path}")

    # ------------------------------------------------------------------ rewards

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        self._isolate()  # refuses before any run where isolation is required but impossible
        jobs = []  # each sample's program and tests
        for i, s in enumerate(samples):
            try:
                tests = parse_tests(s.reference)[: self.max_tests]  # None: all
                for t in tests:
                    if t.code is not None:
                        code_asserts.plan_asserts(t.code)
            except (ValueError, TypeError) as e:
                raise RewardInputError(f"CodeVerifier: sample {i}: bad test cases: {e}") from None
            jobs.append((extract_code(s.response), tests))
        with ThreadPoolExecutor(self.workers) as ex:
            runs = [[ex.submit(self.run, program, t) for t in tests] for program, tests in jobs]
        passed = [[r.result().passed for r in sample_runs] for sample_runs in runs]
        if self.mode == "all":
            return [float(bool(p) and all(p)) for p in passed]
        return [sum(p) / len(p) if p else 0.0 for p in passed]


@functools.cache  # once per process
def _isolation_problem() -> str | None:
    """``None`` if this machine can run programs in the namespaces (tried by the launcher
    itself), else why not."""
    with tempfile.TemporaryDirectory(prefix="lightrft-probe-", ignore_cleanup_errors=True) as work:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-S", _CHILD, "probe"],
                capture_output=True,
                timeout=30,
                cwd=work,
                env={"PATH": os.environ.get("PATH", "/bin")},
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
    if done.returncode == 0:
        return None
    why = (done.stdout + done.stderr).decode(errors="replace").strip()
    return why or f"exit status {done.returncode}"


def _new_cgroup(candidates: Sequence[tuple[str, str]], name: str, value: int) -> str | None:
    """A new cgroup ``name-<random>`` under the first ``(root, limit file)`` of ``candidates``
    where one can be made and bounded (``value`` written to its limit file); else None."""
    for root, limit in candidates:
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue  # not a cgroup hierarchy (cgroup v1's /sys/fs/cgroup is a tmpfs)
        try:
            path = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
        except OSError:
            continue  # no such root, or not allowed
        try:
            Path(path, limit).write_text(str(value))
            return path
        except OSError:
            with suppress(OSError):
                os.rmdir(path)
    return None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
