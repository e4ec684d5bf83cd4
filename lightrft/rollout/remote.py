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
  buckets, under HF names) into :class:`AsyncSource`, which stands where an engine would and
  sends each bucket's ``(name, tensor)`` pairs as one message; :meth:`RolloutLink.receive_weights`
  loads it into the generator's engine (``load_weights``).
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

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightrft.distributed import exit_with_parent
from lightrft.rollout.source import Rollout, prompt_loader
from lightrft.training import PhaseTimer

_PREFIX = "lightrft/async_rollout/"
TRAINER, GENERATOR = 0, 1  # ranks in the link


class GeneratorError(RuntimeError):
    """The other side of the rollout link died, hung past the timeout, or broke the protocol."""


@dataclass
class Start:
    """Trainer -> generator, once: generate steps ``step + 1 ..``; ``loader_state``: the prompt
    loader's position after step ``step`` (None: a fresh run); weights follow when ``step > 0``."""

    step: int
    epoch: int
    loader_state: dict[str, Any] | None


@dataclass
class Generated:
    """Generator -> trainer, once per step: the step's :class:`Rollout` (every sample drawn,
    ``kept`` set, the train batch after dynamic sampling, the generator's metrics), and the
    policy version whose weights sampled them (the number of optimizer steps they had seen)."""

    step: int
    version: int
    rollout: Rollout
    epoch: int
    loader_state: dict[str, Any]


@dataclass
class Evaluated:
    """Generator -> trainer: the held-out eval metrics of the policy after ``step`` steps."""

    step: int
    metrics: dict[str, float]


@dataclass
class _WeightsDone:
    version: int
    evaluate: bool  # the generator evaluates this policy on the held-out set


@dataclass
class _Bye:
    pass


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

    @contextlib.contextmanager
    def _waiting(self, what: str) -> Iterator[None]:
        """Fail with a :class:`GeneratorError` naming ``what`` this process waited for: a
        send or receive raises at once when the peer's connection is closed, a wait when it
        runs past the timeout."""
        try:
            yield
        except RuntimeError as e:
            raise GeneratorError(
                f"{self.peer} failed while this process waited for {what} (it died, or sent "
                f"nothing within rollout.generator_timeout_s={self.timeout.total_seconds():g}): "
                f"{str(e).splitlines()[0]}"
            ) from e

    def send(self, obj: Any) -> None:
        """Send ``obj`` (pickled by ``torch.save``: tensors travel as their bytes) without
        waiting for it to be taken (:meth:`flush` waits); its bytes stay alive until then."""
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        with self._waiting(f"{type(obj).__name__} to be sent"):
            self.pending += [(self.group.send([x], 1 - self.rank, 0), x) for x in (size, data)]

    def receive(
        self, kind: type | tuple[type, ...], what: str, timeout_s: float | None = None
    ) -> Any:
        """The next message, which must be a ``kind``; ``timeout_s``: this wait's bound (default
        ``rollout.generator_timeout_s``)."""
        size = torch.zeros(1, dtype=torch.int64)
        with self._waiting(what):
            timeout = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
            self.group.recv([size], 1 - self.rank, 0).wait(timeout)
            data = torch.empty(int(size), dtype=torch.uint8)
            self.group.recv([data], 1 - self.rank, 0).wait(self.timeout)
        obj = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
        if not isinstance(obj, kind):
            raise GeneratorError(f"{self.peer} sent {type(obj).__name__} instead of {what}")
        return obj

    def flush(self) -> None:
        """Wait until every message sent without waiting has been received."""
        works, self.pending = self.pending, []
        with self._waiting("its last message to be received"):
            for w, _ in works:
                w.wait(self.timeout)

    # -- weights ----------------------------------------------------------------------------

    def receive_weights(
        self, engine: Any, evaluate: Callable[[], dict[str, float]], *, or_bye: bool = False
    ) -> int | None:
        """Load one set of weights (all buckets, each a list of ``(name, tensor)`` pairs) into
        ``engine``; returns its policy version.
        When the trainer asks, ``evaluate()`` it (it stays loaded until the next set is taken)
        and send the metrics without waiting: it overlaps their training. ``or_bye``: the
        trainer may say goodbye instead (returns None; answer with :meth:`answer_bye`)."""
        kinds = (list, _WeightsDone, _Bye) if or_bye else (list, _WeightsDone)
        while True:
            msg = self.receive(kinds, "the trainer's weights")
            if isinstance(msg, _Bye):
                return None
            if isinstance(msg, _WeightsDone):
                engine.reset_prefix_cache()
                if msg.evaluate:
                    self.send(Evaluated(msg.version, evaluate()))
                return msg.version
            engine.load_weights(msg)

    def bye(self) -> None:
        """Trainer: the run is over (after every batch was received); waits for the answer."""
        self.answer_bye()
        self.receive(_Bye, "the generator's goodbye")

    def answer_bye(self) -> None:
        """Generator: answer the trainer's goodbye (:meth:`receive_weights` took it); waits
        until every message sent was received."""
        self.send(_Bye())
        self.flush()


def generates_here(rollout: Any) -> bool:
    """Whether this process only generates: the last launch rank of a ``rollout.asynchronous``
    run. In its trainers the launch's world shrinks by it (before the default process group is
    made), so the trainers form a group of their own."""
    if not rollout.asynchronous:
        return False
    world = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) == world - 1:
        return True
    os.environ["WORLD_SIZE"] = str(world - 1)
    return False


class AsyncSource:
    """The trainers' side of one-step-off rollout: each step's samples come from the generating
    process (trainer rank 0 receives them and broadcasts them to the other trainers), and the
    published weights go to it. ``loader``: only the generator's position, checkpointed (the
    trainers draw nothing); ``rollout/policy_lag``: optimizer steps between the policy that
    sampled a batch and the trained one.

    On trainer rank 0 it stands where an engine would in ``Strategy.sync_weights``
    (``load_weights``, ``reset_prefix_cache``, ``dtype``): each bucket of full tensors goes to
    the generator as one message of ``(name, tensor)`` pairs (their bytes copied as it is
    written: the bucket's tensors may be views of a buffer the sync reuses), without waiting for
    it to be taken (the generator takes a set of weights when its staleness bound needs it)."""

    def __init__(self, opts: Any, dist: Any, record_eval: Callable, checkpointer: Any) -> None:
        """``opts``: the run's config (``rollout``, ``run``, ``engine``, ``max_steps``)."""
        self.opts, self.ro, self.dist, self.record_eval = opts, opts.rollout, dist, record_eval
        self.checkpointer, self.epoch, self.pending, self.link = checkpointer, 0, 0, None
        self.dtype = opts.engine.dtype  # of the weights the strategy's sync sends
        if dist.rank == 0:  # first in setup: the generator builds while the trainers load
            timeout = self.ro.generator_timeout_s
            self.link = RolloutLink.connect(TRAINER, timeout, timeout)

    def build(self, strategy: Any, parts: Callable, dataset: Callable[[], Any]) -> None:
        """No engine and no rewards here (``parts`` is the generator's); the prompts' loader
        only keeps the generator's position (one process draws every prompt of a step)."""
        self.strategy = strategy
        self.loader = prompt_loader(dataset(), self.ro.prompts_per_step, self.opts.run.seed, 0, 1)

    def start(self, step: int, epoch: int, *, evaluate: bool) -> None:
        """Tell the generator where to start; after a resume it gets the checkpoint's weights
        first (a resumed run refills the pipeline: its first steps lag 0). ``evaluate``: the
        generator evaluates the initial policy (it did while the trainers set up)."""
        self.epoch = epoch
        if self.link is not None:
            self.pending = int(evaluate)
            state = self.loader.state_dict() if step else None
            self.link.send(Start(step, epoch, state))
        if step:
            self._send(step, evaluate=False)

    def next(self, step: int, timer: Any) -> Rollout:
        msg: Generated | None = None
        with timer("rollout"):  # what the trainers wait for generation: its exposed part
            if self.link is not None:
                while msg is None:  # the evaluations sent before it are recorded
                    msg = self._receive((Generated, Evaluated), f"the samples of step {step}")
                if msg.step != step:
                    raise RuntimeError(f"the generator sent step {msg.step}, expected {step}")
            if self.dist.world_size > 1:
                box = [msg]
                dist.broadcast_object_list(box, src=0)
                msg = box[0]
        lag = step - 1 - msg.version
        assert 0 <= lag <= self.ro.max_staleness, (step, msg.version)
        self.epoch = msg.epoch
        self.loader.load_state_dict(msg.loader_state)  # checkpointed: where a resume starts
        metrics = {**msg.rollout.metrics, "rollout/policy_lag": float(lag)}
        return replace(msg.rollout, metrics=metrics)

    def publish(self, version: int, *, updated: bool, evaluate: bool) -> None:
        """The policy after ``version`` steps, when the generator samples from it (it stops at
        ``max_steps``) or evaluates it, whether or not the step updated it."""
        if evaluate or version <= self.opts.max_steps - 1 - self.ro.max_staleness:
            self._send(version, evaluate)

    def _send(self, version: int, evaluate: bool) -> None:
        """Through the strategy's weight sync (a collective of the trainers; rank 0 sends,
        without waiting for it to be taken); ``evaluate``: the generator evaluates it and
        sends the metrics later."""
        if self.link is None:  # the gathers of rank 0's send
            self.strategy.sync_weights(None)
            return
        self.pending += evaluate
        self.link.flush()  # the previous set was taken: at most one set in flight
        self.done = _WeightsDone(version, evaluate)  # sent after the set's last bucket
        self.strategy.sync_weights(self)

    def load_weights(self, pairs: Any) -> None:
        self.link.send([(n, t.detach().cpu()) for n, t in pairs])

    def reset_prefix_cache(self) -> None:
        self.link.send(self.done)

    def _receive(self, kinds: tuple[type, ...], what: str) -> Generated | None:
        """The generator's next message of ``kinds``; an evaluation is recorded (None
        returned). A failed generator's error names the checkpoint that is kept."""
        try:
            msg = self.link.receive(kinds, what)
        except GeneratorError as e:
            last = self.checkpointer.latest()
            kept = f"the last checkpoint, {last}, is kept" if last else "no checkpoint yet"
            raise GeneratorError(f"{e} ({kept})") from e
        if isinstance(msg, Evaluated):
            self.pending -= 1
            self.record_eval(msg.step, msg.metrics)
            return None
        return msg

    def drain(self) -> None:
        pass  # evaluations arrive with the batches, and at close

    def close(self) -> None:
        """Wait for the generator's last evaluations, then say goodbye."""
        if self.link is not None:
            while self.pending:
                self._receive((Evaluated,), "its evaluations")
            self.link.bye()


def serve(
    build: Callable[[], tuple[Any, Callable[[], dict[str, float]] | None]],
    opts: Any,
    *,
    evaluate_initial: bool,
) -> None:
    """The generating process of the run's config ``opts`` (``rollout``, ``run``,
    ``max_steps``): ``build()`` gives a colocated source over its own engine (which never
    sleeps), with its rewards and prompt loader, and the held-out evaluation; no trainer, no
    process group but the link. It generates step after step, ``rollout.max_staleness`` steps
    ahead of the trainers: step ``k``'s samples come from the policy after step
    ``k - 1 - max_staleness``.

    It joins at once and waits for the trainers' prepare steps (which may write the model and
    data it reads), then sets up while they set up; the waits for the trainers (join, then
    their setup and resume) are bounded by ``run.collective_timeout_s`` (default 1800 s),
    every later wait by ``rollout.generator_timeout_s``."""
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()  # a torchrun worker: do not outlive the launcher
    torch.manual_seed(opts.run.seed)
    ro, join_timeout_s = opts.rollout, opts.run.collective_timeout_s or 1800.0
    link = RolloutLink.connect(GENERATOR, ro.generator_timeout_s, join_timeout_s)
    source, evaluate = build()
    engine = source.parts.engine.engine

    if evaluate_initial:  # the initial weights: the checkpoint the engine loaded
        link.send(Evaluated(0, evaluate()))
    start = link.receive(Start, "the trainer's start", timeout_s=join_timeout_s)
    if start.loader_state is not None:
        source.loader.load_state_dict(start.loader_state)
    source.start(start.step, start.epoch, evaluate=False)
    version = link.receive_weights(engine, evaluate) if start.step else start.step
    for step in range(start.step + 1, opts.max_steps + 1):
        while version < step - 1 - ro.max_staleness:
            version = link.receive_weights(engine, evaluate)
        timer = PhaseTimer()
        rollout = source.next(step, timer)
        metrics = {**rollout.metrics, "time/generate": timer.summary().get("time/rollout", 0.0)}
        rollout = replace(rollout, metrics=metrics)
        msg = Generated(step, version, rollout, source.epoch, source.loader.state_dict())
        link.flush()  # the previous step's batch was taken: at most one in flight
        link.send(msg)  # the next step generates while this one is taken
    while link.receive_weights(engine, evaluate, or_bye=True) is not None:  # final evaluations
        pass
    link.answer_bye()
