"""One-step-off (asynchronous) GRPO: the last process generates while the others train
(``rollout.asynchronous``, :mod:`lightrft.rollout.remote`).

The config rules run in-process (``lightrft validate``, before anything loads). The runs are two
real processes started as torchrun starts them (RANK, WORLD_SIZE, MASTER_* in the environment):
rank 0 trains, rank 1 generates, weights and batches travel over their gloo link.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _dist import free_port

from lightrft import cli

REPO = Path(__file__).resolve().parents[2]


class TextReward:
    """The sum of the response's character codes mod 10, / 10 (varies with any text, so even a
    random model's first step has advantages); on the generating process (launch rank 1),
    call number ``stop_at`` stops it: ``killed`` (SIGKILL) or ``hung`` (sleeps). ``built``: a
    file each process that builds it appends its launch rank to."""

    def __init__(self, how: str | None = None, stop_at: int = 0, built: str | None = None):
        self.how, self.stop_at, self.calls = how, stop_at, 0
        if built:
            with open(built, "a") as f:
                f.write(os.environ["RANK"] + "\n")

    def __call__(self, samples):
        responses = [s.response for s in samples]
        self.calls += 1
        if self.how and os.environ.get("RANK") == "1" and self.calls == self.stop_at:
            if self.how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        return [sum(map(ord, r)) % 10 / 10 for r in responses]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("grpo_async_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=40, n_test=8, digits=1)
    return root


def _config(tmp: Path, assets: Path, **overrides) -> Path:
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(assets / "model")},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(assets / "data" / "train.jsonl"),
        },
        "reward": {"_component_": "test_grpo_async.TextReward"},
        "rollout": {"prompts_per_step": 2, "n": 4, "max_tokens": 4, "asynchronous": True},
        "algorithm": {"advantage": {"estimator": "grpo"}, "old_logprobs": "engine"},
        "train": {"micro_batch_size": 8, "ppo_epochs": 1},
        "max_steps": 3,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
        "metrics": {"tensorboard": False},
    }
    for key, value in overrides.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    path = tmp / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------------ config rules

REFUSED = [
    ({}, "1", "this run has 1 process: launch it with `lightrft run --nproc_per_node 2"),
    ({"rollout.max_staleness": 0}, "2", "rollout.max_staleness must be >= 1"),
    ({"rollout.generator_timeout_s": 0}, "2", "rollout.generator_timeout_s must be > 0"),
    (
        {"rollout.asynchronous": False, "rollout.max_staleness": 2},
        "1",
        "rollout.max_staleness applies to rollout.asynchronous=true only",
    ),
    (
        {"rollout.asynchronous": False, "rollout.generator_timeout_s": 5},
        "1",
        "rollout.generator_timeout_s applies to rollout.asynchronous=true only",
    ),
    ({"algorithm.old_logprobs": None}, "2", "trains on samples of an older policy"),
    (
        {"engine": {"backend": "vllm", "tensor_parallel_size": 2}},
        "2",
        "rollout.asynchronous=true needs engine.backend=native or vllm with tensor_parallel_size"
        " 1 (it generates in one process of its own), got engine.backend=vllm, tensor_parallel_"
        "size=2",
    ),
    (
        {
            "environment": {
                "_component_": "lightrft.environments.ToolEnvironment",
                "tools": [{"_component_": "lightrft.environments.calculator_tool"}],
            }
        },
        "2",
        "does not play multi-turn episodes",
    ),
    (
        {"rollout.partial": {"token_budget": 64}, "algorithm.shaping": None},
        "2",
        "rollout.asynchronous=true and rollout.partial.token_budget",
    ),
    (
        {"sequence_parallel": 2},
        "2",
        "rollout.asynchronous=true and sequence_parallel=2: the sequence-parallel groups span",
    ),
]


@pytest.mark.parametrize("overrides,world,message", REFUSED)
def test_bad_settings_are_refused_before_loading_naming_the_key(
    tmp_path, assets, capsys, monkeypatch, overrides, world, message
):
    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = _config(tmp_path, assets, **overrides)
    capsys.readouterr()
    assert cli.main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_the_old_policy_correction_may_be_tis(tmp_path, assets, capsys, monkeypatch):
    # old_logprobs=trainer with TIS weights the stale samples towards the engine's log-probs.
    monkeypatch.setenv("WORLD_SIZE", "2")
    tis = {"algorithm.old_logprobs": None, "algorithm.tis": {"mode": "token"}}
    assert cli.main(["validate", str(_config(tmp_path, assets, **tis))]) == 0


# ------------------------------------------------------------------------ real processes


def _start(cfg: Path, tmp: Path, *args: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), str(REPO / "tests"), str(Path(__file__).parent)]
            ),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
        }
        log = open(tmp / f"rank{rank}.log", "a")
        cmd = [sys.executable, str(REPO / "recipes" / "grpo.py"), "--config", str(cfg), *args]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _finish(procs: list[subprocess.Popen], tmp: Path, limit: float = 300) -> list[int]:
    try:
        return [p.wait(timeout=limit) for p in procs]
    finally:
        _stop(procs)


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/lr" in r}


def _reward_norm(out: Path, step: int) -> dict:
    state = json.loads((out / "checkpoints" / f"step_{step:06d}" / "rank_00000.json").read_text())
    return state["extra"]["reward_norm"]


def _eval_steps(out: Path) -> list[int]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["eval/samples"] == 8 for r in rows if "eval/samples" in r), rows
    return sorted(r["step"] for r in rows if "eval/samples" in r)


@pytest.mark.slow  # 33 s on 2 cores (136 s at load 10+): 2 processes, then 2 more to resume
def test_async_run_trains_one_step_off_with_the_generating_policys_logprobs(tmp_path, assets):
    # A KL to the initial policy in the reward, k3 estimator, between the engine's log-probs
    # (old_logprobs=engine) and the reference model's (the initial weights, scored by the
    # trainer): zero exactly when the samples came from the initial policy.
    kl = {"coef": 1e-3, "placement": "reward"}
    # The generator evaluates: the initial policy while the trainer sets up, step 2's policy
    # while the trainer trains on, the last one while it exports.
    evals = {"eval_dataset": {"_component_": "lightrft.data.PromptDataset"}, "eval.every": 2}
    evals["eval_dataset"]["path"] = str(assets / "data" / "test.jsonl")
    # Running reward normalisation: the generator scores, the trainer normalises (and
    # checkpoints the normaliser).
    built = tmp_path / "reward_built.txt"
    reward = {"_component_": "test_grpo_async.TextReward", "built": str(built)}
    shaping = {"reward_norm": True}
    extra = {"algorithm.kl": kl, "algorithm.shaping": shaping, "reward": reward, **evals}
    cfg = _config(tmp_path, assets, save_every=2, max_steps=4, **extra)
    rc = _finish(_start(cfg, tmp_path), tmp_path)
    log = (tmp_path / "rank0.log").read_text()
    assert rc == [0, 0], log[-3000:]
    assert _eval_steps(tmp_path / "out") == [0, 2, 4]
    assert "(step 0) -> " in log and "(step 4); eval/reward" in log, log[-3000:]
    rows = _rows(tmp_path / "out")
    # One step off: step 1 from the initial policy (lag 0), then each from the one before last.
    assert [rows[s]["rollout/policy_lag"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert all(rows[s]["train/loss"] != 0 for s in rows)
    # Steps 1 and 2 were sampled by the initial policy, step 3 by the policy after step 1: the
    # engine's log-probs are the generating policy's.
    assert rows[1]["train/kl"] < 1e-6 and rows[2]["train/kl"] < 1e-6, rows
    assert rows[3]["train/kl"] > 1e-4, rows[3]
    # The ratio's denominator is that policy: 1 at step 1, not at step 2 (the trainer is a step on).
    assert rows[1]["train/ratio_max"] < 1 + 1e-5 < rows[2]["train/ratio_max"]
    # Only the generator built the reward; the trainer logs its parts by the generator's names.
    assert built.read_text() == "1\n"
    assert all(rows[s]["reward/text_reward/count"] == 8 for s in rows), rows[1]
    # The checkpoint holds the normaliser after step 4: 4 steps x 8 samples.
    assert _reward_norm(tmp_path / "out", 4)["count"] == 32
    # Resume from step 4's checkpoint, two steps more: the pipeline refills (lag 0, then 1).
    procs = _start(cfg, tmp_path, "resume=true", "max_steps=6", "resume_override_lr=true")
    assert _finish(procs, tmp_path) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    rows = _rows(tmp_path / "out")
    assert [rows[s]["rollout/policy_lag"] for s in (5, 6)] == [0.0, 1.0]
    assert built.read_text() == "1\n1\n"
    assert _reward_norm(tmp_path / "out", 6)["count"] == 48  # resumed, not restarted
    assert _eval_steps(tmp_path / "out") == [0, 2, 4, 6]  # no second start eval on resume


@pytest.mark.slow  # killed 16 s, hung 54 s (its 30 s timeout) on 2 cores
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_dead_generator_fails_the_trainer_naming_it_within_the_timeout(tmp_path, assets, how):
    timeout = 30  # also bounds the generator's setup before its first batch, on a busy machine
    cfg = _config(
        tmp_path,
        assets,
        reward={"_component_": "test_grpo_async.TextReward", "how": how, "stop_at": 4},
        **{"rollout.generator_timeout_s": timeout},
        save_every=1,
        max_steps=6,
    )
    procs = _start(cfg, tmp_path)
    start = time.monotonic()
    try:
        rc = procs[0].wait(timeout=240)
    finally:
        _stop(procs)
    log = (tmp_path / "rank0.log").read_text()
    assert rc != 0, log[-3000:]
    assert "GeneratorError: the generation process (rank 1, pid" in log, log[-3000:]
    # Steps 1-3 trained, or 1-2 when the kill also lost step 3's batch on its way; the
    # checkpoint of the last trained step stays, and the error names it.
    trained = sorted(_rows(tmp_path / "out"))
    assert trained in ([1, 2], [1, 2, 3]), trained
    last = tmp_path / "out" / "checkpoints" / f"step_{trained[-1]:06d}"
    assert f"the last checkpoint, {last}, is kept" in log, log[-3000:]
    assert last.is_dir()
    if how == "hung":
        assert "generator_timeout_s=30" in log, log[-3000:]
    assert time.monotonic() - start < 240
