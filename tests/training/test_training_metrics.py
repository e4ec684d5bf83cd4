"""MetricLogger sinks, progress bar, timers, throughput, peak memory, cross-rank reduction."""

from __future__ import annotations

import json
import math
import sys
import time
import types

import pytest
import torch
from _dist import run_distributed

from lightrft.training.metrics import (
    MetricLogger,
    PhaseTimer,
    ProgressBar,
    Throughput,
    peak_memory,
    read_metrics,
    reduce_metrics,
    tokens_per_second,
)


def _tb_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_jsonl_and_tensorboard(tmp_path):
    with MetricLogger(tmp_path, config={"optim": {"lr": 1e-3}}) as log:
        out = log.log(1, {"train/loss": torch.tensor(2.5), "train/tokens_per_s": 100})
        assert out == {"train/loss": 2.5, "train/tokens_per_s": 100.0}
        # Flushed at once: readable before close.
        assert read_metrics(tmp_path) == [
            {"step": 1, "train/loss": 2.5, "train/tokens_per_s": 100.0}
        ]
        log.log(2, {"train/loss": 1.5, "eval/loss": float("nan")})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["train/loss"] == 1.5 and math.isnan(rows[1]["eval/loss"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines) and len(lines) == 2

    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = _tb_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(1, 2.5), (2, 1.5)]
    assert scalars["train/tokens_per_s"] == [(1, 100.0)]

    # Without resume_step a new logger appends to the same file.
    with MetricLogger(tmp_path, tensorboard=False) as log:
        log.log(3, {"train/loss": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_resume_step_drops_rows_logged_after_the_checkpoint(tmp_path):
    with MetricLogger(tmp_path) as log:
        for step in (1, 2, 3, 4):
            log.log(step, {"train/loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')  # a line torn by the crash
    # The run crashed after step 4; its last checkpoint is at step 2.
    with MetricLogger(tmp_path, resume_step=2) as log:
        log.log(3, {"train/loss": 30.0})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["train/loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert _tb_scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_disabled_logger_writes_nothing(tmp_path):
    with MetricLogger(tmp_path / "off", enabled=False) as log:
        assert log.log(1, {"a": 1}) == {"a": 1.0}
    assert not (tmp_path / "off").exists()


def test_bad_metric_values(tmp_path):
    with MetricLogger(tmp_path, tensorboard=False) as log:
        with pytest.raises(ValueError, match="metric 'x' must be a scalar"):
            log.log(1, {"x": torch.ones(3)})
        with pytest.raises(ValueError, match="metric 'y' must be a number"):
            log.log(1, {"y": "fast"})


def test_wandb_optional(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ValueError, match=r"wandb.*not installed.*lightrft\[wandb\]"):
        MetricLogger(tmp_path, wandb=True)
    MetricLogger(tmp_path, wandb=False).close()  # never needed when off
    # A project name given as a string would log nowhere: refused, naming the two forms.
    with pytest.raises(ValueError, match="wandb must be a bool or a dict of wandb.init"):
        MetricLogger(tmp_path, wandb="lightrft")

    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricLogger(
        tmp_path, tensorboard=False, wandb={"project": "p", "mode": "offline"}, config={"lr": 1}
    ) as log:
        log.log(4, {"train/loss": 0.5})
    assert calls == [
        ("init", {"project": "p", "mode": "offline", "dir": str(tmp_path), "config": {"lr": 1}}),
        ("log", {"train/loss": 0.5}, 4),
        ("finish",),
    ]


def test_progress_bar(capsys):
    with ProgressBar(total=3, desc="sft") as bar:
        bar.update(loss=1.25, tok_s=4000)
        bar.update(2, loss=0.5)
    err = capsys.readouterr().err
    assert "sft" in err and "3/3" in err and "loss=0.5" in err
    off = ProgressBar(total=3, enabled=False)
    off.update(loss=1.0)
    off.close()
    assert capsys.readouterr().err == ""


def test_timer_and_throughput():
    timer = PhaseTimer()
    for _ in range(2):
        with timer("rollout"):
            time.sleep(0.02)
    with pytest.raises(RuntimeError), timer("train"):
        raise RuntimeError("counted even when the phase fails")
    assert timer.counts == {"rollout": 2, "train": 1}
    s = timer.summary()
    assert set(s) == {"time/rollout", "time/train"} and s["time/rollout"] >= 0.04
    assert timer.summary() == {}  # reset after summary

    tp = Throughput()
    tp.add(300)
    tp.add(torch.tensor(200))
    time.sleep(0.01)
    tokens, seconds = tp.rate()
    assert tokens == 500 and seconds >= 0.01
    assert tp.rate()[0] == 0
    assert tokens_per_second(500, 2.0) == 250.0 and tokens_per_second(5, 0.0) == 0.0


def test_peak_memory_cpu():
    before = peak_memory("cpu")["memory/peak_rss_gib"]
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = peak_memory()["memory/peak_rss_gib"]
    del big
    assert 0.01 < before <= after < 64


def test_reduce_metrics_single_process():
    assert reduce_metrics({"b": 2, "a": torch.tensor(1.0)}) == {"a": 1.0, "b": 2.0}
    with pytest.raises(ValueError, match="op must be one of"):
        reduce_metrics({"a": 1}, op="median")


def _reduce_worker(rank: int, world_size: int) -> None:
    m = {"loss": float(rank + 1), "tokens": 10.0 * (rank + 1)}  # rank0: 1, 10; rank1: 2, 20
    assert reduce_metrics(m, "mean") == {"loss": 1.5, "tokens": 15.0}
    assert reduce_metrics(m, "sum") == {"loss": 3.0, "tokens": 30.0}
    assert reduce_metrics(m, "max") == {"loss": 2.0, "tokens": 20.0}
    assert reduce_metrics(dict(reversed(m.items())), "min") == {"loss": 1.0, "tokens": 10.0}


def test_reduce_metrics_two_processes():
    run_distributed(_reduce_worker)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_cuda_and_synced_timer():
    from lightrft.training.metrics import reset_peak_memory

    reset_peak_memory("cuda")
    x = torch.empty(256 * 2**20 // 4, device="cuda")  # 256 MiB
    m = peak_memory("cuda")
    assert set(m) == {"memory/peak_allocated_gib", "memory/peak_reserved_gib"}
    assert 0.25 <= m["memory/peak_allocated_gib"] <= m["memory/peak_reserved_gib"]
    del x
    timer = PhaseTimer(cuda_sync=True)
    with timer("matmul"):
        a = torch.randn(2048, 2048, device="cuda")
        a @ a
    assert timer.summary()["time/matmul"] > 0
