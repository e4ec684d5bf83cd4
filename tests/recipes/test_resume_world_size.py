"""A run saved on N processes resumes on M (1 <-> 2, 2 -> 4): every sample read once, as in an
uninterrupted run, and the resumed steps are the uninterrupted M-process run's steps.

Why the resumed model is not bitwise equal to an uninterrupted run on M processes: its first
steps ran on N processes, whose sums (each rank's micro-batch, then the reduce-scatter over
ranks) add the same numbers in another order than M processes do, so the checkpoint it starts
from already differs from the M-process run's state at that step in the last bits (as the
2-process and 1-process runs of one config differ, docs/strategies.md). What holds, and is
asserted: the samples of every resumed step, rank by rank, are exactly the uninterrupted
M-process run's; the multiset of samples over the whole run equals the uninterrupted run's; the
resumed losses equal the M-process run's to float tolerance; DCP's reshard of the model and
AdamW state is exact (tests/training/test_training_checkpoint.py).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from _dist import build_recipe, run_distributed
from _recording import read_record

from lightrft import cli
from lightrft.training import read_metrics
from lightrft.training.outputs import release_output_dir

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------------------ SFT


def _sft_config(tmp: Path, assets: Path, out: Path, **over) -> Path:
    """One epoch of 96 arithmetic problems, 16 samples per step over all ranks: 6 steps."""
    cfg = {
        "output_dir": str(out),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(assets / "model")},
        "dataset": {
            "_component_": "_recording.RecordingSFTDataset",
            "path": str(assets / "data" / "train.jsonl"),
            "max_length": 48,
        },
        "packing": True,
        "batch_size": 8,
        "gradient_accumulation_steps": 2,
        "epochs": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
        "lr_scheduler": {"warmup_steps": 2},
        "clip_grad_norm": 1.0,
        "save_every": 3,
        "keep_last": 5,
        "metrics": {"tensorboard": False},
    }
    cfg.update(over)
    path = tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def sft_assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("world_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=96, n_test=8, digits=2)
    return root


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(out) if "train/loss" in r}


def _from_checkpoint(src: Path, dst: Path, step: int) -> None:
    """``dst`` holds only ``src``'s step-``step`` checkpoint: a run that stopped after it."""
    name = f"step_{step:06d}"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name)


def _on_ranks(rank: int, world: int, runs: list[tuple[str, str]], recipe: str = "sft") -> None:
    """Each ``(config, record prefix)`` in turn, as the recipe's main runs it (with the world
    size of this process group)."""
    from lightrft import config as lconfig

    for cfg_path, record in runs:
        os.environ["LIGHTRFT_TEST_RECORD"] = record
        cfg, _ = lconfig.load(cfg_path)
        recipe_ = build_recipe(recipe, cfg)
        recipe_.setup(cfg)
        recipe_.train()
        recipe_.logger.close()
        release_output_dir(Path(cfg.output_dir))


def _one_process(cfg: Path, record: str, monkeypatch, recipe: str = "sft") -> None:
    monkeypatch.setenv("LIGHTRFT_TEST_RECORD", record)
    assert cli.main(["run", recipe, "--config", str(cfg)]) == 0


def _steps(items: list[int], per_step: int) -> list[list[int]]:
    return [items[i : i + per_step] for i in range(0, len(items), per_step)]


def test_sft_resumes_two_processes_on_one_and_one_on_two(tmp_path, sft_assets, monkeypatch, capsys):
    """2 -> 1 (batch_size 4 -> 8: 16 samples per step either way) and 1 -> 2 from step 3."""
    a, t = sft_assets, tmp_path
    rec = {k: str(t / f"rec_{k}") for k in ("one", "two", "two_on_one", "one_on_two")}
    # Uninterrupted runs: 1 process (batch_size 8) and 2 processes (batch_size 4).
    _one_process(_sft_config(t, a, t / "one"), rec["one"], monkeypatch)
    _from_checkpoint(t / "one", t / "one_on_two", 3)
    two = _sft_config(t, a, t / "two", batch_size=4)
    one_on_two = _sft_config(t, a, t / "one_on_two", batch_size=4, resume=True)
    run_distributed(_on_ranks, [(str(two), rec["two"]), (str(one_on_two), rec["one_on_two"])])
    _from_checkpoint(t / "two", t / "two_on_one", 3)
    # Without scaling batch_size a step would read 8 samples instead of 16: refused before
    # anything loads, naming the sizes and the keys.
    capsys.readouterr()
    keep = _sft_config(t, a, t / "two_on_one", batch_size=4, resume=True)
    assert cli.main(["run", "sft", "--config", str(keep)]) == 2
    err = capsys.readouterr().err
    assert "saved by 2 rank(s) reading 16 items per step over all ranks" in err, err
    assert "this run on 1 reads 8" in err and "batch_size or gradient_accumulation_steps" in err
    _one_process(_sft_config(t, a, t / "two_on_one", resume=True), rec["two_on_one"], monkeypatch)

    one, two_ = _losses(t / "one"), _losses(t / "two")
    assert sorted(one) == sorted(two_) == [1, 2, 3, 4, 5, 6]
    every = Counter(range(96))  # one epoch: each of the 96 samples once
    ranks = {k: [read_record(v, r) for r in range(2)] for k, v in rec.items()}

    # 2 -> 1: steps 1-3 read on 2 ranks (8 samples each per step), 4-6 on one (16 per step).
    saved = [x for r in ranks["two"] for x in r[:24]]
    resumed = ranks["two_on_one"][0]
    assert Counter(saved + resumed) == every == Counter(ranks["one"][0])
    # Each resumed step reads the uninterrupted 1-process run's samples of that step, in order.
    assert _steps(resumed, 16) == _steps(ranks["one"][0], 16)[3:]
    got = _losses(t / "two_on_one")
    assert sorted(got) == [4, 5, 6]
    torch.testing.assert_close(
        [got[s] for s in (4, 5, 6)], [one[s] for s in (4, 5, 6)], rtol=1e-4, atol=0
    )

    # 1 -> 2: steps 1-3 on one process, 4-6 on 2 ranks; rank by rank the 2-process run's.
    saved = ranks["one"][0][:48]
    resumed = ranks["one_on_two"]
    assert Counter(saved + resumed[0] + resumed[1]) == every
    for r in range(2):
        assert resumed[r] == ranks["two"][r][24:], r
    got = _losses(t / "one_on_two")
    assert sorted(got) == [4, 5, 6]
    torch.testing.assert_close(
        [got[s] for s in (4, 5, 6)], [two_[s] for s in (4, 5, 6)], rtol=1e-4, atol=0
    )


def test_sft_resumes_two_processes_on_four(tmp_path, sft_assets):
    """2 -> 4 (batch_size 4 -> 2) from step 3: rank by rank the 4-process run's samples."""
    a, t = sft_assets, tmp_path
    rec = {k: str(t / f"rec_{k}") for k in ("two", "four", "two_on_four")}
    run_distributed(_on_ranks, [(str(_sft_config(t, a, t / "two", batch_size=4)), rec["two"])])
    _from_checkpoint(t / "two", t / "two_on_four", 3)
    runs = [
        (str(_sft_config(t, a, t / "four", batch_size=2)), rec["four"]),
        (str(_sft_config(t, a, t / "two_on_four", batch_size=2, resume=True)), rec["two_on_four"]),
    ]
    run_distributed(_on_ranks, runs, world_size=4)
    two = [read_record(rec["two"], r) for r in range(2)]
    four = [read_record(rec["four"], r) for r in range(4)]
    resumed = [read_record(rec["two_on_four"], r) for r in range(4)]
    assert Counter(two[0][:24] + two[1][:24] + sum(resumed, [])) == Counter(range(96))
    for r in range(4):
        assert resumed[r] == four[r][12:], r  # steps 4-6: 4 samples per rank per step
    got, want = _losses(t / "two_on_four"), _losses(t / "four")
    assert sorted(got) == [4, 5, 6]
    torch.testing.assert_close(
        [got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)], rtol=1e-4, atol=0
    )


# ----------------------------------------------------------------------------------------- GRPO


def _grpo_config(tmp: Path, assets: Path, out: Path, **over) -> Path:
    """4 steps of 4 prompts (over all ranks) x 4 samples of 4 tokens; a checkpoint at step 2;
    an adaptive KL controller and the reward normaliser, whose states the ranks share."""
    cfg = {
        "output_dir": str(out),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(assets / "model")},
        "dataset": {
            "_component_": "_recording.RecordingPromptDataset",
            "path": str(assets / "data" / "train.jsonl"),
        },
        "reward": {"_component_": "_recording.DigitReward"},
        "rollout": {"prompts_per_step": 4, "n": 4, "max_tokens": 4},
        "algorithm": {
            "advantage": {"estimator": "grpo"},
            "kl": {"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 50},
            "shaping": {"reward_norm": True},
        },
        "train": {"micro_batch_size": 4, "ppo_epochs": 1},
        "max_steps": 4,
        "save_every": 2,
        "keep_last": 5,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
        "clip_grad_norm": 1.0,
        "metrics": {"tensorboard": False},
    }
    cfg.update(over)
    path = tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _grpo_rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "train/lr" in r}


def test_grpo_resumes_one_process_on_two_and_two_on_one(tmp_path, sft_assets, monkeypatch):
    """The prompt stream and the rollout seeds continue as the uninterrupted run's on the new
    world size: each resumed step's prompts, rank by rank, are the uninterrupted M-process
    run's; its rollouts (each request seeded by (seed, step, draw, its place in the step over
    all ranks), so the same on any number of processes) score the same rewards; the losses and
    KL agree to float tolerance (the weights differ in the last bits, module docstring)."""
    a, t = sft_assets, tmp_path
    rec = {k: str(t / f"rec_{k}") for k in ("one", "two", "two_on_one", "one_on_two")}
    monkeypatch.setenv("LIGHTRFT_TEST_RECORD", rec["one"])
    assert cli.main(["run", "grpo", "--config", str(_grpo_config(t, a, t / "one"))]) == 0
    _from_checkpoint(t / "one", t / "one_on_two", 2)
    runs = [
        (str(_grpo_config(t, a, t / "two")), rec["two"]),
        (str(_grpo_config(t, a, t / "one_on_two", resume=True)), rec["one_on_two"]),
    ]
    run_distributed(_on_ranks, runs, "grpo")
    _from_checkpoint(t / "two", t / "two_on_one", 2)
    monkeypatch.setenv("LIGHTRFT_TEST_RECORD", rec["two_on_one"])
    cfg = _grpo_config(t, a, t / "two_on_one", resume=True)
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 0

    ranks = {k: [read_record(v, r) for r in range(2)] for k, v in rec.items()}
    uninterrupted = Counter(ranks["one"][0])
    assert (
        len(ranks["one"][0]) == 16 and Counter(ranks["two"][0] + ranks["two"][1]) == uninterrupted
    )
    # 2 -> 1: steps 1-2 on 2 ranks (2 prompts each per step), 3-4 on one (4 per step).
    saved = ranks["two"][0][:4] + ranks["two"][1][:4]
    assert Counter(saved + ranks["two_on_one"][0]) == uninterrupted
    assert ranks["two_on_one"][0] == ranks["one"][0][8:]
    # 1 -> 2: rank by rank the 2-process run's prompts of steps 3-4.
    assert (
        Counter(ranks["one"][0][:8] + ranks["one_on_two"][0] + ranks["one_on_two"][1])
        == uninterrupted
    )
    for r in range(2):
        assert ranks["one_on_two"][r] == ranks["two"][r][4:], r

    # The sampling does not depend on the number of processes: the uninterrupted runs on 1 and
    # 2 processes score the same rewards step by step.
    one, two = _grpo_rows(t / "one"), _grpo_rows(t / "two")
    assert [one[s]["reward/total/mean"] for s in (1, 2, 3, 4)] == pytest.approx(
        [two[s]["reward/total/mean"] for s in (1, 2, 3, 4)], rel=1e-6
    )
    assert one[4]["reward/total/mean"] != one[1]["reward/total/mean"]  # it learns: a signal
    for resumed, reference in (("two_on_one", "one"), ("one_on_two", "two")):
        got, want = _grpo_rows(t / resumed), _grpo_rows(t / reference)
        assert sorted(got) == [3, 4]
        for step in (3, 4):
            assert got[step]["reward/total/mean"] == pytest.approx(
                want[step]["reward/total/mean"], rel=1e-6
            )
            for key in ("train/loss", "train/kl", "train/grad_norm"):
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-7), (
                    resumed,
                    step,
                    key,
                )


# --------------------------------------------------------------------------------- reward model


def test_reward_model_resumes_two_processes_on_one(tmp_path, monkeypatch):
    """The reward-model recipe shares the library code (loader, checkpoint, config check):
    2 -> 1 (batch_size 4 -> 8) from step 3 reads the 1-process run's pairs and losses."""
    import json

    from test_reward_model import _pairs

    t = tmp_path
    (t / "data").mkdir()
    (t / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _pairs(64, 0)))
    from lightrft.tasks import make_tiny_model

    make_tiny_model(t / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=128)

    def config(out: Path, **over) -> Path:
        cfg = {
            "output_dir": str(out),
            "seed": 0,
            "device": "cpu",
            "model": {"path": str(t / "model")},
            "dataset": {
                "_component_": "_recording.RecordingPreferenceDataset",
                "path": str(t / "data" / "train.jsonl"),
                "max_length": 64,
            },
            "batch_size": 8,
            "gradient_accumulation_steps": 2,
            "epochs": 1,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3},
            "clip_grad_norm": 1.0,
            "save_every": 2,
            "keep_last": 5,
            "metrics": {"tensorboard": False},
            **over,
        }
        path = t / f"{out.name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    rec = {k: str(t / f"rec_{k}") for k in ("one", "two", "two_on_one")}
    _one_process(config(t / "one"), rec["one"], monkeypatch, "reward_model")
    run_distributed(_on_ranks, [(str(config(t / "two", batch_size=4)), rec["two"])], "reward_model")
    _from_checkpoint(t / "two", t / "two_on_one", 2)
    cfg = config(t / "two_on_one", resume=True)
    _one_process(cfg, rec["two_on_one"], monkeypatch, "reward_model")

    one = read_record(rec["one"])
    two = [read_record(rec["two"], r) for r in range(2)]
    resumed = read_record(rec["two_on_one"])
    assert len(one) == 64 and Counter(two[0][:16] + two[1][:16] + resumed) == Counter(one)
    assert resumed == one[32:]  # steps 3-4: 16 pairs each, the 1-process run's
    got, want = _losses(t / "two_on_one"), _losses(t / "one")
    assert sorted(got) == [3, 4]
    torch.testing.assert_close([got[3], got[4]], [want[3], want[4]], rtol=1e-4, atol=0)
