"""A code reward: run the response's Python program against test cases in a sandboxed process.

Each (program, test) pair runs in its own process (``python -I``) with:

- wall-clock and CPU-time limits (the process group is SIGKILLed at the wall limit);
- an address-space limit (a 10 GB allocation fails with ``MemoryError``);
- output capped: stdout goes to a file with an ``RLIMIT_FSIZE`` cap, and only that much is read;
- a process limit: a fresh pids cgroup (``pids.max``) where one can be created (root on Linux),
  else ``RLIMIT_NPROC`` (enforced for non-root users only); all processes of the run are killed
  when it ends (its cgroup, else its process group and session);
- no network: a new network namespace (needs ``CAP_SYS_ADMIN``; otherwise a warning, once);
- a temporary working directory, removed afterwards.

Writes, deletions and starting programs outside the temporary directory are refused by a Python
audit hook installed before the program runs: this stops ordinary and careless code, not a
determined attacker (``ctypes`` can call the C library directly). Not prevented: reading files
the user can read; writes through ``ctypes`` wherever the trainer's user may write (the process
is not given a read-only filesystem view or another user: run untrusted code as an unprivileged
user, in a container, or on another machine through the reward server). A program that inspects its caller's stack can find the
assert-test nonce; it cannot pass by exiting early (``os._exit(0)``) or by printing.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightrft.rewards.base import Prompt, check_lengths

__all__ = ["CodeVerifier", "RunResult", "TestCase", "extract_code", "parse_tests"]

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1 pids, then v2
_warned: set[str] = set()


def extract_code(response: str) -> str:
    """The last fenced code block (```python ... ```) of a response, else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@dataclass(frozen=True)
class TestCase:
    """One test: ``stdin`` -> expected ``stdout`` (whitespace-insensitive), or an assert-style
    ``code`` snippet run after the program in the same namespace."""

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
    seconds: float
    stdout: str = ""


# Runs the program (and, for assert tests, the test) in the sandbox process. The audit hook
# refuses writes, deletions and new programs outside the working directory: a guard against
# careless or naive code, not a security boundary (ctypes can get around it).
_HARNESS = """\
import os, sys
_root = os.getcwd() + os.sep
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree"}
_EXEC_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                "pty.spawn"}

def _inside(path):
    if isinstance(path, int):
        return True
    p = os.path.realpath(os.fsdecode(path))
    return (p + os.sep).startswith(_root)

def _guard(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (mode and any(c in str(mode) for c in "wax+")) or (flags or 0) & _WRITE
        if writes and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
    elif event in _PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} outside the working directory")
    elif event in _EXEC_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")

_nonce = sys.stdin.readline().strip() if sys.argv[1] == "assert" else None
_out = os.dup(1)
sys.addaudithook(_guard)
_ns = {"__name__": "__main__"}
exec(compile(open("program.py").read(), "program.py", "exec"), _ns)
if _nonce is not None:
    sys.stdin = open(os.devnull)
    exec(compile(open("test.py").read(), "test.py", "exec"), _ns)
    sys.stdout.flush()
    os.write(_out, ("\\n" + _nonce + "\\n").encode())
"""


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
        no_network: run each test in a new network namespace (warns once where impossible).
        workers: tests run in parallel.
        max_tests: use at most this many tests per sample (``None``: all).
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

    # ------------------------------------------------------------------ one run

    def run(self, program: str, test: TestCase) -> RunResult:
        """Run ``program`` on one test in the sandbox."""
        start = time.monotonic()
        tmp = tempfile.mkdtemp(prefix="lightrft-code-")
        cgroup = self._make_cgroup()
        try:
            Path(tmp, "program.py").write_text(program)
            Path(tmp, "harness.py").write_text(_HARNESS)
            nonce = None
            if test.code is not None:
                Path(tmp, "test.py").write_text(test.code)
                nonce = secrets.token_hex(16)
                stdin_text, script = nonce + "\n", ["harness.py", "assert"]
            else:
                stdin_text, script = test.stdin or "", ["harness.py", "stdio"]
            Path(tmp, "stdin.txt").write_text(stdin_text)
            settings = {
                "cpu_seconds": max(1, int(self.timeout + 0.999)),
                "memory_bytes": self.memory_bytes,
                "output_bytes": self.max_output_bytes,
                "nproc": self.max_processes if cgroup is None else None,
                "cgroup": cgroup,
                "no_network": self.no_network,
            }
            with open(Path(tmp, "stdin.txt"), "rb") as fin, open(Path(tmp, "out"), "wb") as fout:
                proc = subprocess.Popen(
                    [sys.executable, "-I", _CHILD, json.dumps(settings), *script],
                    cwd=tmp,
                    stdin=fin,
                    stdout=fout,
                    stderr=subprocess.DEVNULL,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
                    start_new_session=True,  # its own process group and session, to kill
                )
                timed_out = False
                try:
                    code = proc.wait(timeout=self.timeout + 0.5)  # + the launcher's start
                except subprocess.TimeoutExpired:
                    timed_out = True
                    code = None
                self._kill_all(proc.pid, cgroup)
                proc.wait()
            self._warn_missing(Path(tmp, ".sandbox"))
            with open(Path(tmp, "out"), "rb") as f:
                raw = f.read(self.max_output_bytes)
            out = raw.decode(errors="replace")
            secs = time.monotonic() - start
            if timed_out:
                return RunResult(False, "timeout", secs)
            if code != 0:
                return RunResult(False, "error", secs, out)
            if nonce is not None:
                ok = out.rstrip().endswith(nonce)
            else:
                ok = _same_output(out, test.stdout or "")
            return RunResult(ok, "ok" if ok else "wrong", secs, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if cgroup is not None:
                self._remove_cgroup(cgroup)

    def _make_cgroup(self) -> str | None:
        for root in _CGROUP_ROOTS:
            if not os.path.exists(os.path.join(root, "pids.max")) and not os.path.exists(
                os.path.join(root, "cgroup.procs")
            ):
                continue
            path = os.path.join(root, f"lightrft-sandbox-{uuid.uuid4().hex[:12]}")
            try:
                os.mkdir(path)
            except OSError:
                continue
            try:
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write(str(self.max_processes))
                return path
            except OSError:
                os.rmdir(path)
        if os.getuid() == 0:
            _warn_once(
                "nproc",
                "CodeVerifier: no pids cgroup could be created and RLIMIT_NPROC does not bind "
                "root, so sandboxed code may start any number of processes (they are still "
                "killed at the time limit); run the trainer or the reward server as a non-root "
                "user",
            )
        return None

    @staticmethod
    def _kill_all(pid: int, cgroup: str | None) -> None:
        """SIGKILL every process of the run: its cgroup, its process group, its session."""
        for _ in range(50):
            victims = set()
            if cgroup is not None:
                with suppress(OSError):
                    victims |= {int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()}
            victims |= _session_members(pid)
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

    def _warn_missing(self, path: Path) -> None:
        try:
            missing = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if "network" in missing:
            _warn_once(
                "network",
                "CodeVerifier: cannot create a network namespace here (needs CAP_SYS_ADMIN); "
                "sandboxed code can use the network. Set no_network=False to silence this",
            )
        for m in missing:
            if m.startswith("rlimit") or m == "cgroup":
                _warn_once(m, f"CodeVerifier: could not apply the sandbox limit {m!r}")

    # ------------------------------------------------------------------ rewards

    def score(self, program: str, tests: Sequence[TestCase]) -> float:
        """The reward of one program on its tests."""
        results = self._run_many([(program, t) for t in tests])
        return self._reward(results)

    def _reward(self, results: Sequence[RunResult]) -> float:
        if not results:
            return 0.0
        passed = sum(r.passed for r in results)
        if self.mode == "all":
            return float(passed == len(results))
        return passed / len(results)

    def _run_many(self, jobs: Sequence[tuple[str, TestCase]]) -> list[RunResult]:
        if self.workers == 1 or len(jobs) <= 1:
            return [self.run(p, t) for p, t in jobs]
        with ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(lambda pt: self.run(*pt), jobs))

    def __call__(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        references: Sequence[Any],
        labels: Sequence[str | None] | None = None,
    ) -> list[float]:
        check_lengths(len(responses), references=references)
        jobs, owner = [], []
        for i, (resp, ref) in enumerate(zip(responses, references, strict=True)):
            try:
                tests = parse_tests(ref)
            except ValueError as e:
                raise ValueError(f"CodeVerifier: sample {i}: bad test cases: {e}") from None
            if self.max_tests is not None:
                tests = tests[: self.max_tests]
            program = extract_code(resp)
            for t in tests:
                jobs.append((program, t))
                owner.append(i)
        results = self._run_many(jobs)
        per_sample: list[list[RunResult]] = [[] for _ in responses]
        for i, r in zip(owner, results, strict=True):
            per_sample[i].append(r)
        return [self._reward(rs) for rs in per_sample]


def _session_members(sid: int) -> set[int]:
    """Processes whose session is ``sid`` (children that left the process group)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) > 3 and int(fields[3]) == sid:  # state, ppid, pgrp, session
            out.add(int(entry))
    return out


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
