"""Preemption: a real signal to a real training process: finish the step, save, exit 143/130."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

_LOOP = r"""
import sys, time, torch
from lightrft.training.checkpoint import Checkpointer
from lightrft.training.preemption import Preemption

out, step_s = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = Checkpointer(out)
with Preemption() as preempt:
    for step in range(1, 1000):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        time.sleep(step_s)  # a step takes a while: the signal lands inside it
        opt.step()
        opt.zero_grad()
        print(f"step {step}", flush=True)
        if preempt.stop_requested():
            preempt.exit(ckpt.save(step, models=model, optimizers=opt))
"""


def _start(tmp_path, step_s):
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOOP, str(tmp_path), str(step_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "step 1"
    return proc


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_finishes_the_step_saves_and_exits(tmp_path, sig, code):
    proc = _start(tmp_path, 0.3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    lines = out.split()  # "step 1" was read already
    last = int(lines[-1]) if lines else 1
    assert last in (1, 2)  # the step in flight when the signal came was finished
    meta = json.loads((tmp_path / "checkpoints" / f"step_{last:06d}" / "meta.json").read_text())
    assert meta["step"] == last
    assert "received: finishing this step" in err
    assert f"checkpoint saved in {tmp_path / 'checkpoints' / f'step_{last:06d}'}" in err
    assert "Traceback" not in err


def test_second_signal_exits_at_once_without_a_checkpoint(tmp_path):
    proc = _start(tmp_path, 5.0)  # the step in flight lasts 5 s
    proc.send_signal(signal.SIGTERM)
    while "received" not in proc.stderr.readline():  # the first one was handled
        pass
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.perf_counter() - start < 3.0  # not the 4+ s left of the step
    assert proc.returncode == 143
    assert "SIGTERM again: exiting now" in err
    assert not (tmp_path / "checkpoints").exists() or not list(
        (tmp_path / "checkpoints").glob("step_*[0-9]")
    )


def _two_rank_preempted(rank: int, world_size: int, out: str) -> None:
    import os

    import torch

    from lightrft.training.checkpoint import Checkpointer
    from lightrft.training.preemption import Preemption

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(out)
    with Preemption() as preempt:
        for step in range(1, 10):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is signalled, mid-step
            if preempt.stop_requested():
                try:
                    preempt.exit(ckpt.save(step, models=model, optimizers=opt))
                except SystemExit as e:
                    assert e.code == 143 and step == 2, (rank, step, e.code)
                    return
    raise AssertionError(f"rank {rank} never stopped")


def test_two_ranks_stop_after_the_same_step_and_save_one_checkpoint(tmp_path):
    from _dist import run_distributed

    run_distributed(_two_rank_preempted, str(tmp_path))
    step = tmp_path / "checkpoints" / "step_000002"
    assert json.loads((step / "meta.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in step.glob("rank_*.json")) == [
        "rank_00000.json",
        "rank_00001.json",
    ]
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*")] == ["step_000002"]
