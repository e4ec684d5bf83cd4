"""Checkpoint loading never runs code: planted pickles in every file a resume reads are refused."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lightrft.training.checkpoint import Checkpointer, CheckpointError, rng_state, set_rng_state
from lightrft.training.safe_state import UnsafeCheckpointError, load_state, save_state


class _Evil:
    """Unpickling this creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _small():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return model, opt, sched


def test_state_round_trips_types_and_rng_bitwise(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    obj = {
        "rng": rng_state(),
        "extra": {"epoch": 2, "hist": [(1, 0.5, float("nan"))], 7: "int key", "t": torch.ones(2)},
        "np": np.arange(5, dtype=np.uint32),
        "scalar": np.float64(1.25),
    }
    save_state(obj, tmp_path / "rank_00000")
    back = load_state(tmp_path / "rank_00000")
    assert back["extra"]["epoch"] == 2 and back["extra"][7] == "int key"
    assert back["extra"]["hist"][0][:2] == (1, 0.5) and np.isnan(back["extra"]["hist"][0][2])
    assert torch.equal(back["extra"]["t"], torch.ones(2))
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3, 4]
    assert back["scalar"] == np.float64(1.25) and isinstance(back["scalar"], np.float64)
    expect = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(back["rng"])
    assert (random.random(), np.random.rand()) == expect[:2] and torch.equal(
        torch.rand(1), expect[2]
    )
    with pytest.raises(TypeError, match="cannot store a _Evil"):
        save_state({"x": _Evil(tmp_path / "m")}, tmp_path / "bad")


def test_planted_pickle_in_rank_state_is_never_loaded(tmp_path):
    model, opt, sched = _small()
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(1, models=model, optimizers=opt, schedulers=sched)
    marker = tmp_path / "pwned"
    # An attacker swaps the JSON state for a pickle (the old format) that runs code.
    (path / "rank_00000.json").unlink()
    torch.save({"x": _Evil(marker)}, path / "rank_00000.pt")
    with pytest.raises(UnsafeCheckpointError, match="pickled per-rank state"):
        ckpt.load_latest(models=model, optimizers=opt, schedulers=sched)
    # ... or hides a pickle inside the JSON file itself.
    (path / "rank_00000.json").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises((UnsafeCheckpointError, CheckpointError), match="corrupt"):
        ckpt.load_latest(models=model, optimizers=opt, schedulers=sched)
    assert not marker.exists()


def test_planted_pickle_in_dcp_metadata_is_refused(tmp_path):
    model, opt, sched = _small()
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(1, models=model, optimizers=opt, schedulers=sched)
    # The genuine metadata loads through the guard (the normal resume path).
    assert ckpt.load_latest(models=model, optimizers=opt, schedulers=sched).step == 1
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.exec is not allowed"):
        ckpt.load_latest(models=model, optimizers=opt, schedulers=sched)
    assert not marker.exists()
    # Control: torch's own reader would have run it.
    with open(path / ".metadata", "rb") as f:
        pickle.load(f)
    assert marker.exists()


class _EvilScheduler:
    """A "scheduler" whose state holds an object that runs code when unpickled."""

    def __init__(self, marker: Path):
        self.state = {"last_epoch": 1, "payload": _Evil(marker)}

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = sd


def test_planted_object_in_dcp_bytes_entry_is_refused(tmp_path):
    model, opt, _ = _small()
    marker = tmp_path / "pwned"
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, models=model, optimizers=opt, schedulers=_EvilScheduler(marker))
    assert not marker.exists()  # saving pickles, it does not unpickle
    with pytest.raises(UnsafeCheckpointError, match="payload"):
        ckpt.load_latest(models=model, optimizers=opt, schedulers=_EvilScheduler(marker))
    assert not marker.exists()


def test_write_atomic_removes_a_killed_writers_temporary_file(tmp_path):
    """A writer killed between its write and its rename leaves ``.NAME.PID.tmp``; the next write
    of NAME removes it when PID is gone, and leaves a live writer's and other names' alone."""
    import os

    from lightrft.training.safe_state import write_atomic

    dead = tmp_path / ".latest.4194399.tmp"  # above Linux's largest pid (2^22): no such process
    live = tmp_path / f".latest.{os.getppid()}.tmp"
    other = tmp_path / ".meta.json.4194399.tmp"
    for f in (dead, live, other):
        f.write_text("step_000002\n")
    write_atomic(tmp_path / "latest", b"step_000004\n")
    assert (tmp_path / "latest").read_text() == "step_000004\n"
    assert not dead.exists() and live.exists() and other.exists()
