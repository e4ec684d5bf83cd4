"""Symbolic answer equivalence with ``math-verify``, under a per-answer time limit.

``math-verify`` (Hugging Face) parses LaTeX answers into sympy objects and compares them
(intervals, sets, tuples, equations, units, percentages, ...). Sympy can hang or explode on
hostile input (``10^{10^{10}}``), and math-verify's own time limit is ``signal.alarm``, which
only works in the main thread and steals the process's SIGALRM. So comparisons run in a small
pool of worker processes (``python -m lightrft.rewards.math_equiv``) with math-verify's timeouts
off: the caller waits for each answer with a deadline, and a worker that misses it is killed and
replaced. Nothing here touches signals, so it is safe in threads, under torchrun and in a
reward server. Workers start lazily (about a second each: they import sympy) and live as long
as the pool.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from contextlib import suppress

__all__ = ["EquivalencePool", "symbolic_equal"]

# An answer longer than this is not handed to sympy: no benchmark answer is, and parsing a
# long string is where the time goes. Such pairs compare as unequal.
MAX_SYMBOLIC_CHARS = 1000
_STARTUP_SECONDS = 120.0
_WORKER_MEMORY = 2 << 30  # address-space limit of a worker, bytes: a blow-up fails fast


def symbolic_equal(pred: str, ref: str) -> bool:
    """Whether math-verify finds the two answer strings equivalent (no time limit: use it only
    inside a worker or on trusted input). ``ref`` is the gold answer; the check is not
    symmetric (``x = 3`` as the prediction matches a gold ``3``)."""
    from math_verify import parse, verify

    # Boxing tells math-verify's extractor where the whole answer is.
    gold = parse("\\boxed{" + ref + "}", parsing_timeout=None)
    guess = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, timeout_seconds=None))


class _Worker:
    """One ``python -m lightrft.rewards.math_equiv`` process speaking JSON lines."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightrft.rewards.math_equiv"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal is the parent's to handle
        )
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""
        # Wait for the imports (seconds on a busy machine) outside any answer's time limit.
        line = self._readline(time.monotonic() + _STARTUP_SECONDS)
        if line != b"ready":
            self.close()
            raise RuntimeError(
                "the math-verify worker did not start"
                + (f": {line.decode(errors='replace')}" if line else f" in {_STARTUP_SECONDS} s")
                + " (is math-verify installed? pip install math-verify)"
            )

    def _readline(self, deadline: float) -> bytes | None:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.strip()

    def ask(self, pred: str, ref: str, deadline: float) -> bool | None:
        """The worker's verdict, or ``None`` if it missed ``deadline`` or died."""
        try:
            self.proc.stdin.write(json.dumps([pred, ref]).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        line = self._readline(deadline)
        return None if line is None else line == b"1"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.sel.close()
        for f in (self.proc.stdin, self.proc.stdout):
            with suppress(OSError):
                f.close()


class EquivalencePool:
    """Compare answer pairs with math-verify in ``workers`` processes, each pair given at most
    ``timeout`` seconds (a pair that runs out compares as unequal and its worker is replaced).

    Thread-safe; :meth:`equal_many` spreads a batch over the workers. ``stats`` counts calls,
    timeouts and worker restarts.
    """

    def __init__(self, workers: int = 1, timeout: float = 5.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.workers = workers
        self.timeout = float(timeout)
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # a slot; the process starts on first use
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self.stats = {"calls": 0, "timeouts": 0, "restarts": 0}
        atexit.register(_close_at_exit, weakref.ref(self))

    def equal(self, pred: str, ref: str) -> bool:
        """Whether ``pred`` is equivalent to the gold answer ``ref`` (``False`` on timeout)."""
        if len(pred) > MAX_SYMBOLIC_CHARS or len(ref) > MAX_SYMBOLIC_CHARS:
            return False
        worker = self._idle.get()
        try:
            if worker is None:
                worker = _Worker()
                with self._lock:
                    self._live.add(worker)
            # The clock starts after the worker is up: its sympy import is not the answer's.
            verdict = worker.ask(pred, ref, time.monotonic() + self.timeout)
            with self._lock:
                self.stats["calls"] += 1
                if verdict is None:
                    self.stats["timeouts"] += 1
                    self.stats["restarts"] += 1
                    self._live.discard(worker)
            if verdict is None:
                worker.close()
                worker = None
            return bool(verdict)
        finally:
            self._idle.put(worker)

    def equal_many(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """:meth:`equal` of each ``(pred, ref)`` pair, up to ``workers`` at a time."""
        if self.workers == 1 or len(pairs) <= 1:
            return [self.equal(p, r) for p, r in pairs]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(lambda pr: self.equal(*pr), pairs))

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        with self._lock:
            live, self._live = self._live, set()
        for w in live:
            w.close()
        while True:
            try:
                self._idle.get_nowait()
            except queue.Empty:
                break
        for _ in range(self.workers):
            self._idle.put(None)

    def __del__(self) -> None:
        with suppress(Exception):  # interpreter shutdown
            self.close()


def _close_at_exit(ref: weakref.ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


def _serve() -> None:
    """Worker loop: a JSON ``[pred, ref]`` per line in, ``1`` or ``0`` per line out."""
    import logging
    import resource

    with suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY, _WORKER_MEMORY))
    logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off: ours run
    sys.setrecursionlimit(10_000)
    out = sys.stdout.buffer
    try:
        symbolic_equal("1", "1")  # import sympy and warm the parsers before answering
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.write(f"{type(e).__name__}: {e}".replace("\n", " ").encode() + b"\n")
        out.flush()
        return
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            pred, ref = json.loads(line)
            ok = symbolic_equal(pred, ref)
        except (Exception, RecursionError, MemoryError):  # noqa: BLE001 - unparseable: unequal
            ok = False
        out.write(b"1\n" if ok else b"0\n")
        out.flush()


if __name__ == "__main__":
    _serve()
