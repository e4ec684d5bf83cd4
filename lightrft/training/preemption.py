"""Preemption: on SIGTERM / SIGINT finish the step, save a checkpoint, exit with 128 + signal.

Clusters send SIGTERM some time before they kill a job; Ctrl-C sends SIGINT. Inside
:class:`Preemption` the first such signal only sets a flag. The training loop asks
:meth:`Preemption.stop_requested` after each step (a collective under ``torch.distributed``, so
every rank stops after the same step and saves its shard of the same checkpoint), then calls
:meth:`Preemption.exit`. A second signal exits at once (no checkpoint), for a user who really
means it. Exit codes follow the shell convention: 143 for SIGTERM, 130 for SIGINT.

    with Preemption() as preempt:
        for step in ...:
            train_step()
            if preempt.stop_requested():
                preempt.exit(save())       # save() returns the checkpoint path
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

from lightrft.distributed import all_reduce_max, is_main
from lightrft.training.metrics import collective_device


class Preemption:
    """Turn SIGTERM / SIGINT into a graceful stop at the next step boundary (context manager)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be installed from the main thread
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"\n{name} again: exiting now, without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(
            2,
            f"\n{name} received: finishing this step, then saving a checkpoint and exiting "
            f"({name} again exits at once)\n".encode(),
        )

    def stop_requested(self) -> bool:
        """True when any rank got a signal (collective: call it on every rank at the same
        point of each step)."""
        flag = int(all_reduce_max(self.signum or 0, collective_device()).item())
        if self.signum is None and flag:
            self.signum = flag  # another rank was signalled: exit the same way
        return bool(flag)

    def exit(self, checkpoint: Any = None) -> NoReturn:
        """Print where the state was saved and raise ``SystemExit`` with 128 + the signal number
        (143 SIGTERM, 130 SIGINT; 0 without a signal), so ``finally`` blocks, e.g. closing
        loggers and the process group, still run."""
        name = signal.Signals(self.signum).name if self.signum else "stop"
        if is_main():
            where = f"checkpoint saved in {checkpoint}; " if checkpoint is not None else ""
            print(
                f"stopped by {name}: {where}continue with resume=true",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(128 + self.signum if self.signum else 0)
