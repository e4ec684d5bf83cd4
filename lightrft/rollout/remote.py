"""One-step-off (asynchronous) rollout: a generating process beside the trainers.

With ``rollout.asynchronous: true`` a run launched on N processes splits them: ranks
``0 .. N-2`` train (their default process group has N-1 ranks, so sharding, gathers and
checkpoints are those of an (N-1)-process run) and rank ``N-1`` generates. Trainer rank 0 and the
generator talk over a two-rank gloo group of their own (:class:`RolloutLink`), made on the
launch's rendezvous store under its own prefix:

- trainer -> generator: joining the link says the trainers are past their ``prepare`` steps (the
  generator builds its engine and data meanwhile); :class:`Start` (the step to start from, the
  prompt loader's position, sent after the trainers' setup), then the policy's weights after the
  optimizer steps the generator needs, and after each step that is evaluated. The weights travel
  through the trainer strategy's own weight sync (``Strategy.sync_weights``: full tensors, in
  buckets, under HF names) into :class:`WeightSender`, which stands where an engine would and
  sends each bucket as one flat buffer; :meth:`RolloutLink.receive_weights` loads it into the
  generator's engine (``load_weights``).
- generator -> trainer: one :class:`Generated` per step: the step's samples with the engine's
  log-probs, which policy version made them, and the prompt loader's position after them; one
  :class:`Evaluated` per held-out evaluation, which the generator runs on the policy of the step
  it belongs to (the initial one while the trainers set up), while the trainers go on.

The generator runs exactly ``max_staleness`` steps ahead (as verl's one-step-off trainer): the
samples of step ``k`` come from the weights after step ``k - 1 - max_staleness`` (the initial
weights for the first steps), so ``rollout/policy_lag`` is ``min(k - 1, max_staleness)``.

Every wait is bounded (``rollout.generator_timeout_s``): a generator that dies (gloo sees the
closed connection at once) or hangs fails the trainer with :class:`GeneratorError`, naming the
process, and the checkpoints already written stay.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightrft.rollout.batch import RolloutBatch

_PREFIX = "lightrft/async_rollout/"
TRAINER, GENERATOR = 0, 1  # ranks in the link


class GeneratorError(RuntimeError):
    """The other side of the rollout link died, hung past the timeout, or broke the protocol."""


def generator_rank() -> int:
    """The launch rank that generates in an asynchronous run: the last one."""
    return int(os.environ["WORLD_SIZE"]) - 1


def leave_trainer_world() -> int:
    """In a trainer process: shrink the launch's world by the generator (before the default
    process group is made), so the trainers form a group of their own; returns the launch's
    world size."""
    world = int(os.environ["WORLD_SIZE"])
    os.environ["WORLD_SIZE"] = str(world - 1)
    return world


@dataclass
class Start:
    """Trainer -> generator, once: generate steps ``step + 1 ..``; ``loader_state``: the prompt
    loader's position after step ``step`` (None: a fresh run); weights follow when ``step > 0``."""

    step: int
    epoch: int
    loader_state: dict[str, Any] | None


@dataclass
class Generated:
    """Generator -> trainer, once per step: every sample drawn (``drawn``, ``kept`` set), the
    train batch (``batch``, after dynamic sampling), the generator's metrics, and the policy
    version whose weights sampled them (the number of optimizer steps they had seen)."""

    step: int
    version: int
    batch: RolloutBatch
    drawn: RolloutBatch
    metrics: dict[str, float]
    epoch: int
    loader_state: dict[str, Any]


@dataclass
class Evaluated:
    """Generator -> trainer: the held-out eval metrics of the policy after ``step`` steps."""

    step: int
    metrics: dict[str, float]


@dataclass
class _Bucket:
    """Header of one weight bucket; its tensors follow as one flat byte buffer."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]


@dataclass
class _WeightsDone:
    version: int
    evaluate: bool  # the generator evaluates this policy on the held-out set


@dataclass
class _Bye:
    pass


def _pack(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unpack(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


@dataclass
class RolloutLink:
    """A two-rank gloo group between trainer rank 0 (link rank 0) and the generator (1)."""

    group: Any
    rank: int
    timeout: timedelta
    peer: str  # how errors name the other side
    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def connect(cls, rank: int, timeout_s: float, join_timeout_s: float) -> RolloutLink:
        """Join the link (both sides call it) on the launch's rendezvous store
        (``MASTER_ADDR`` / ``MASTER_PORT``: torchrun's, or trainer rank 0's). Joining waits up to
        ``join_timeout_s`` (the generator joins first and waits for the trainers' setup); every
        later wait up to ``timeout_s``."""
        timeout = timedelta(seconds=timeout_s)
        join = timedelta(seconds=join_timeout_s)
        what = "the generation process" if rank == TRAINER else "trainer rank 0"
        try:
            store = dist.TCPStore(
                os.environ.get("MASTER_ADDR", "127.0.0.1"),
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=join,
            )
            store = dist.PrefixStore(_PREFIX, store)
            # Each side names itself (launch rank, pid): errors then name the process.
            store.set(f"who/{rank}", f"rank {os.environ.get('RANK', '?')}, pid {os.getpid()}")
            peer = f"{what} ({store.get(f'who/{1 - rank}').decode()})"
            group = dist.ProcessGroupGloo(store, rank, 2, join)
        except RuntimeError as e:  # the store's or the group's wait ran out
            raise GeneratorError(
                f"{what} did not join the rollout link within {join_timeout_s:g} s: "
                f"{str(e).splitlines()[0]}"
            ) from e
        return cls(group, rank, timeout, peer)

    # -- messages ---------------------------------------------------------------------------

    def _failed(self, e: RuntimeError, what: str) -> GeneratorError:
        return GeneratorError(
            f"{self.peer} failed while this process waited for {what} (it died, or sent "
            f"nothing within rollout.generator_timeout_s={self.timeout.total_seconds():g}): "
            f"{str(e).splitlines()[0]}"
        )

    def _wait(self, work: Any, what: str, timeout: timedelta | None = None) -> None:
        try:
            work.wait(timeout or self.timeout)
        except RuntimeError as e:
            raise self._failed(e, what) from e

    def send_tensor(self, t: torch.Tensor, what: str, *, wait: bool) -> None:
        size = torch.tensor([t.numel()], dtype=torch.int64)
        try:  # a send raises at once when the peer's connection is closed
            works = [(self.group.send([x], 1 - self.rank, 0), x) for x in (size, t)]
        except RuntimeError as e:
            raise self._failed(e, f"{what} to be sent") from e
        if wait:
            for w, _ in works:
                self._wait(w, f"{what} to be received")
        else:  # the tensors stay alive until flush()
            self.pending += works

    def _recv_tensor(self, what: str, timeout: timedelta | None = None) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        try:  # a receive raises at once when the peer's connection is closed
            self._wait(self.group.recv([size], 1 - self.rank, 0), what, timeout)
            data = torch.empty(int(size), dtype=torch.uint8)
            self._wait(self.group.recv([data], 1 - self.rank, 0), what)
        except RuntimeError as e:
            if isinstance(e, GeneratorError):
                raise
            raise self._failed(e, what) from e
        return data

    def send(self, obj: Any, *, wait: bool = True) -> None:
        self.send_tensor(_pack(obj), type(obj).__name__, wait=wait)

    def receive(
        self, kind: type | tuple[type, ...], what: str, timeout_s: float | None = None
    ) -> Any:
        """The next message, which must be a ``kind``; ``timeout_s``: this wait's bound (default
        ``rollout.generator_timeout_s``)."""
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        obj = _unpack(self._recv_tensor(what, timeout))
        if not isinstance(obj, kind):
            raise GeneratorError(f"{self.peer} sent {type(obj).__name__} instead of {what}")
        return obj

    def flush(self) -> None:
        """Wait until every message sent without waiting has been received."""
        works, self.pending = self.pending, []
        for w, _ in works:
            self._wait(w, "its last message to be received")

    # -- weights ----------------------------------------------------------------------------

    def receive_weights(self, engine: Any, *, or_bye: bool = False) -> tuple[int, bool] | None:
        """Load one set of weights (all buckets) into ``engine``; returns its policy version and
        whether the trainer asks for its evaluation. ``or_bye``: the trainer may say goodbye
        instead (returns None; answer with :meth:`answer_bye`)."""
        kinds = (_Bucket, _WeightsDone, _Bye) if or_bye else (_Bucket, _WeightsDone)
        while True:
            head = self.receive(kinds, "the trainer's weights")
            if isinstance(head, _Bye):
                return None
            if isinstance(head, _WeightsDone):
                engine.reset_prefix_cache()
                return head.version, head.evaluate
            flat = self._recv_tensor("a weight bucket")
            pairs, start = [], 0
            for name, shape, dtype in zip(head.names, head.shapes, head.dtypes, strict=True):
                n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                # A copy: a slice at an odd offset cannot be viewed as a wider dtype.
                pairs.append((name, flat[start : start + n].clone().view(dtype).view(shape)))
                start += n
            engine.load_weights(pairs)

    def bye(self) -> None:
        """Trainer: the run is over (after every batch was received); waits for the answer."""
        self.flush()
        self.send(_Bye())
        self.receive(_Bye, "the generator's goodbye")

    def answer_bye(self) -> None:
        """Generator: answer the trainer's goodbye (:meth:`receive_weights` took it)."""
        self.send(_Bye())


class WeightSender:
    """Where an engine would stand in ``Strategy.sync_weights`` on trainer rank 0: each bucket of
    full tensors goes to the generator as one flat buffer, without waiting for it to be taken
    (the generator takes a set of weights when its staleness bound needs it)."""

    def __init__(self, link: RolloutLink, dtype: torch.dtype | None):
        self.link, self.dtype, self.version, self.evaluate = link, dtype, 0, False

    def load_weights(self, pairs: Any) -> None:
        pairs = list(pairs)
        tensors = [t.detach().contiguous() for _, t in pairs]
        head = _Bucket(
            [n for n, _ in pairs], [tuple(t.shape) for t in tensors], [t.dtype for t in tensors]
        )
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])  # a copy: owned
        self.link.send(head, wait=False)
        self.link.send_tensor(flat, "a weight bucket", wait=False)

    def reset_prefix_cache(self) -> None:
        self.link.send(_WeightsDone(self.version, self.evaluate), wait=False)
