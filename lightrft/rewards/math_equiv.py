"""Symbolic answer equivalence with ``math-verify``, under a per-answer time limit.

``math-verify`` (Hugging Face) finds the answer in a response and parses LaTeX answers into sympy
objects and compares them (intervals, sets, tuples, equations, units, percentages, ...). The
pool answers three questions: are two answer strings equal (:meth:`EquivalencePool.equal`), does
a whole response's answer equal a gold answer (:meth:`EquivalencePool.judge`, math-verify's own
extraction: its LaTeX and expression configs, ``\\boxed{}`` first), and what answer does a
response commit to (a judge against no gold answer, ``""``). Sympy can hang or explode on
hostile input (``10^{10^{10}}``), and math-verify's own time limit is ``signal.alarm``, which
only works in the main thread and steals the process's SIGALRM. So comparisons run in a small
pool of worker processes (``python -m lightrft.rewards.math_equiv``) with math-verify's timeouts
off: the caller waits for each answer with a deadline, and a worker that misses it is killed and
replaced. Nothing here touches signals, so it is safe in threads, under torchrun and in a
reward server. Workers start lazily (about a second each: they import sympy) and live as long
as the pool.
"""

from __future__ import annotations

import json
import os
import queue
import selectors
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass

__all__ = [
    "EquivalencePool",
    "Verdict",
    "judge_response",
    "symbolic_equal",
]

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


@dataclass(frozen=True)
class Verdict:
    """A worker's answer: whether the pair is equal, and the answer math-verify extracted from
    the response (its LaTeX string; ``None`` where it found none or was not asked)."""

    equal: bool
    answer: str | None = None


def _parse_text(text: str) -> tuple[list, str | None]:
    """math-verify's parse of a whole text (``\\boxed{}`` first, then its other LaTeX patterns:
    "the final answer is $...$", display and inline math; then plain expressions) and the
    extracted LaTeX string of the result (math-verify puts it last), if any."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    parsed = parse(text, configs, parsing_timeout=None)
    strings = [p.strip() for p in parsed if isinstance(p, str)]
    return parsed, (strings[-1] if strings and strings[-1] else None)


def judge_response(text: str, gold: str) -> Verdict:
    """Whether the answer math-verify extracts from ``text`` equals the one it extracts from
    ``gold`` (see :func:`~lightrft.rewards.math_answer.math_verify_reference`), with our
    equation rule on top: an equation never equals a value
    (:func:`~lightrft.rewards.math_answer.equation_mismatch`: math-verify alone reads
    ``100 = 7`` as 7; ``AB = 4`` is 4). No time limit: use it only inside a worker."""
    from math_verify import verify

    from lightrft.rewards.math_answer import equation_mismatch

    guess, answer = _parse_text(text)
    gold_parsed, gold_answer = _parse_text(gold)
    if answer is None or gold_answer is None:
        return Verdict(False, answer)
    if equation_mismatch(answer, gold_answer):
        return Verdict(False, answer)
    # A set-valued gold matches the inequality that describes it (`[-2, 7]` and
    # `-2 \\le x \\le 7`); the other way round math-verify does without the flag.
    equal = verify(gold_parsed, guess, allow_set_relation_comp=True, timeout_seconds=None)
    return Verdict(bool(equal), answer)


# One worker request by its name (no time limit: run only inside a worker): two answer strings
# equal, or a response's answer equal to a gold text's (with the answer a response commits to).
_REQUESTS = {
    "equal": lambda pred, ref: Verdict(symbolic_equal(pred, ref)),
    "judge": judge_response,
}


class _Worker:
    """One ``python -m lightrft.rewards.math_equiv`` process speaking JSON lines."""

    def __init__(self) -> None:
        # stderr to a file, not a pipe: a chatty worker can never block on it, and a worker that
        # dies at start-up leaves its reason there.
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightrft.rewards.math_equiv"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            start_new_session=True,  # a Ctrl-C in the terminal is the parent's to handle
        )
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""
        # Wait for the imports (seconds on a busy machine) outside any answer's time limit.
        line = self._readline(time.monotonic() + _STARTUP_SECONDS)
        if line != b"ready":
            if line:
                why = f": {line.decode(errors='replace')}"
            else:
                # Its stdout can close before its exit status is in (seen on one busy core):
                # give a dying worker a moment, so the error says why instead of "timeout".
                try:
                    why = f": it exited with code {self.proc.wait(timeout=5)}"
                    self.stderr.seek(0)
                    if text := self.stderr.read().decode(errors="replace").strip():
                        why += f"; its stderr ends: {text[-600:]}"
                except subprocess.TimeoutExpired:
                    why = f" in {_STARTUP_SECONDS} s"
            self.close()
            raise RuntimeError(
                f"the math-verify worker ({sys.executable} -m lightrft.rewards.math_equiv) did "
                f"not start{why} (is math-verify installed? pip install math-verify)"
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

    def ask(self, op: str, args: Sequence[str], deadline: float) -> Verdict | None:
        """The worker's verdict on one request, or ``None`` if it missed ``deadline`` or died."""
        try:
            self.proc.stdin.write(json.dumps([op, list(args)]).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        line = self._readline(deadline)
        if line is None:
            return None
        try:
            equal, answer = json.loads(line)
        except ValueError:  # a stray line on the worker's stdout: it is out of step, replace it
            return None
        return Verdict(bool(equal), answer if isinstance(answer, str) else None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.sel.close()
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            with suppress(OSError):
                f.close()


class EquivalencePool:
    """Compare answer pairs with math-verify in ``workers`` processes, each pair given at most
    ``timeout`` seconds (a pair that runs out compares as unequal and its worker is replaced).

    Thread-safe; :meth:`equal_many` spreads a batch over the workers. ``stats`` counts calls and
    timeouts (each replaces its worker: one that missed its deadline or died).
    """

    def __init__(self, workers: int = 1, timeout: float = 5.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.workers = workers
        self.timeout = float(timeout)
        # Slots: a worker, or None until first use; a worker close() stopped is no longer live,
        # and its slot starts a fresh one on next use.
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self.stats = {"calls": 0, "timeouts": 0}
        # Stops the workers when the pool is collected or the interpreter exits.
        weakref.finalize(self, _close_workers, self._live, self._lock)

    def equal(self, pred: str, ref: str) -> bool:
        """Whether ``pred`` is equivalent to the gold answer ``ref`` (``False`` on timeout)."""
        if len(pred) > MAX_SYMBOLIC_CHARS or len(ref) > MAX_SYMBOLIC_CHARS:
            return False
        return self._ask("equal", (pred, ref)).equal

    def judge(self, text: str, gold: str) -> Verdict:
        """Whether the answer math-verify extracts from the response ``text`` equals the gold
        answer in ``gold`` (see :func:`judge_response`); unequal, with no answer, on timeout.
        The caller bounds ``text`` (the worker reads all of it within ``timeout``). Against no
        gold answer (``gold=""``) it only extracts: the verdict's ``answer`` is the answer."""
        return self._ask("judge", (text, gold))

    def _ask(self, op: str, args: Sequence[str]) -> Verdict:
        """One request on an idle worker (started if need be), within ``timeout``; unequal, with
        no answer, if it ran out (the worker is then killed and its slot refilled on next use)."""
        worker = self._idle.get()
        try:
            with self._lock:  # a worker close() stopped meanwhile: its slot starts a fresh one
                if worker not in self._live:
                    worker = None
            if worker is None:
                worker = _Worker()
                with self._lock:
                    self._live.add(worker)
            # The clock starts after the worker is up: its sympy import is not the answer's.
            verdict = worker.ask(op, args, time.monotonic() + self.timeout)
            with self._lock:
                self.stats["calls"] += 1
                if verdict is None:
                    self.stats["timeouts"] += 1
                    self._live.discard(worker)
            if verdict is None:
                worker.close()
                worker = None
            return verdict or Verdict(False)
        finally:
            self._idle.put(worker)

    def _map(self, fn, items: Sequence) -> list:
        """``fn(*item)`` of each item, up to ``workers`` at a time, in order."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(lambda item: fn(*item), items))

    def equal_many(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """:meth:`equal` of each ``(pred, ref)`` pair, up to ``workers`` at a time."""
        return self._map(self.equal, pairs)

    def judge_many(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        """:meth:`judge` of each ``(text, gold)`` pair, up to ``workers`` at a time."""
        return self._map(self.judge, pairs)

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones); a call running meanwhile
        ends without an answer and hands its slot back."""
        _close_workers(self._live, self._lock)


def _close_workers(live: set[_Worker], lock: threading.Lock) -> None:
    with lock:
        workers = list(live)
        live.clear()
    for w in workers:
        w.close()


def _serve() -> None:
    """Worker loop: a JSON ``[op, args]`` per line in (see :data:`_REQUESTS`), a JSON
    ``[equal, answer]`` per line out."""
    import logging
    import resource

    with suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY, _WORKER_MEMORY))
    logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off: ours run
    sys.setrecursionlimit(10_000)
    out = sys.stdout.buffer
    try:
        # Import sympy and warm the parsers before answering.
        symbolic_equal("1", "1")
        judge_response("so $x = \\frac{1}{2}$", "\\boxed{0.5}")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.write(f"{type(e).__name__}: {e}".replace("\n", " ").encode() + b"\n")
        out.flush()
        return
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            op, args = json.loads(line)
            verdict = _REQUESTS[op](*args)
        except (Exception, RecursionError, MemoryError):  # noqa: BLE001 - unparseable: unequal
            verdict = Verdict(False)
        out.write(json.dumps([verdict.equal, verdict.answer]).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
