"""The run contract (issue 23, item 2), checked on every training recipe with the real CLI.

Each test runs ``sft``, ``reward_model`` and ``grpo`` on a 1-layer, hidden-16 model and a few
dozen records through ``lightrft run``: in-process (``lightrft.cli.main``) where that is enough, in
a subprocess (``python -m lightrft run``) where a signal or a second live run is needed. Items:
one live run per output directory (its lock), a fresh run refused on a used directory unless
``overwrite=true``, SIGTERM / SIGINT preemption (finish the step, save, exit 143 / 130) and a
resume that equals the uninterrupted run, the config stored in every checkpoint and compared on
resume (allowed keys, ``resume_override_lr``), seeding, and ``resume=true`` without a checkpoint.

The learning rate is constant (no warmup, ``min_lr_ratio: 1``) so that a run's metrics do not
depend on ``max_steps``: a preempted run (long ``max_steps``), its resume and the uninterrupted
reference (``max_steps`` = the resume's) then follow the same curve, bitwise on one machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import lightrft
from lightrft import cli
from lightrft.training import read_metrics
from lightrft.training.outputs import LOCK_NAME, release_output_dir

RECIPES = ["sft", "reward_model", "grpo"]
# Entry rules of the shared run contract (training_run): GRPO's variant, the slowest, is opt-in;
# sft and reward_model keep checking that the recipes are wired to it.
ENTRY_RULE_RECIPES = ["sft", "reward_model", pytest.param("grpo", marks=pytest.mark.slow)]
# Subprocesses import lightrft from the checkout this process uses, and the test modules
# (test_grpo.DigitReward) as pytest does.
PYTHONPATH = [
    str(Path(lightrft.__file__).resolve().parent.parent),
    str(Path(__file__).resolve().parent.parent),
    str(Path(__file__).resolve().parent),
]


@pytest.fixture(scope="session")
def contract_assets(tmp_path_factory) -> Path:
    """A 1-layer, hidden-16 model, arithmetic problems (SFT, GRPO prompts) and preference
    pairs from them (reward model), each train split also under a second name."""
    from lightrft.tasks import ensure_arith_dataset, ensure_arith_preferences, make_tiny_model

    root = tmp_path_factory.mktemp("contract")
    make_tiny_model(root / "model", layers=1, hidden=16, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "arith", n_train=40, n_test=8, digits=1)
    ensure_arith_preferences(root / "pairs", root / "arith")
    for data in ("arith", "pairs"):  # same records, another path: a changed data key
        shutil.copyfile(root / data / "train.jsonl", root / data / "train_copy.jsonl")
    return root


def _base(recipe: str, tmp: Path, assets: Path) -> dict:
    common = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(assets / "model")},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 0, "min_lr_ratio": 1.0},  # constant: see the docstring
        "clip_grad_norm": 1.0,
        "max_steps": 3,
        "log_every": 1,
        "save_every": 1,
        "keep_last": 10,
        "metrics": {"tensorboard": False},
    }
    if recipe == "sft":
        return {
            **common,
            "dataset": {
                "_component_": "lightrft.data.SFTDataset",
                "path": str(assets / "arith" / "train.jsonl"),
                "max_length": 32,
            },
            "batch_size": 4,
            "gradient_accumulation_steps": 1,
            "epochs": 1000,  # max_steps decides
        }
    if recipe == "reward_model":
        return {
            **common,
            "dataset": {
                "_component_": "lightrft.data.PreferenceDataset",
                "path": str(assets / "pairs" / "train.jsonl"),
                "apply_chat_template": False,
                "max_length": 32,
            },
            "batch_size": 4,
            "gradient_accumulation_steps": 1,
            "epochs": 1000,
        }
    if recipe == "grpo":
        return {
            **common,
            "dataset": {
                "_component_": "lightrft.data.PromptDataset",
                "path": str(assets / "arith" / "train.jsonl"),
            },
            # A random model never answers right: a dense reward keeps the updates non-zero.
            "reward": {
                "_component_": "lightrft.rewards.CombinedReward",
                "functions": {
                    "accuracy": {"_component_": "lightrft.rewards.MathVerifier"},
                    "digits": {"_component_": "test_grpo.DigitReward"},
                },
            },
            "rollout": {"prompts_per_step": 2, "n": 2, "max_tokens": 4},
            "algorithm": {"advantage": {"estimator": "grpo"}},
            "train": {"micro_batch_size": 4, "ppo_epochs": 1},
        }
    raise ValueError(f"unknown recipe {recipe!r}")


@pytest.fixture
def recipe_config(contract_assets):
    """``recipe_config(recipe, tmp, **overrides) -> Path``: a tiny valid YAML for ``recipe``
    writing to ``tmp/out``; dotted override keys (``**{"optimizer.lr": 0.1}``), None removes."""

    def make(recipe: str, tmp: Path, **overrides) -> Path:
        cfg = _base(recipe, tmp, contract_assets)
        for key, value in overrides.items():
            node = cfg
            *parents, last = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            if value is None:
                node.pop(last, None)
            else:
                node[last] = value
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / f"{recipe}.yaml"
        path.write_text(f"# lightrft run {recipe} --config {path.name}\n" + yaml.safe_dump(cfg))
        return path

    return make


# ------------------------------------------------------------------------------------ helpers


def _run(capsys, recipe: str, cfg: Path, *overrides: str) -> tuple[int, str, str]:
    """``lightrft run`` in this process: (exit code, stdout, stderr). The run's directory lock
    is dropped afterwards (in-process it would last until this process exits)."""
    capsys.readouterr()
    try:
        rc = cli.main(["run", recipe, "--config", str(cfg), *overrides])
    finally:
        release_output_dir(cfg.parent / "out")
    out, err = capsys.readouterr()
    return rc, out, err


def _validate(capsys, cfg: Path, *overrides: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["validate", str(cfg), *overrides])
    return rc, capsys.readouterr().err


def _start(recipe: str, cfg: Path, *overrides: str) -> subprocess.Popen:
    """``python -m lightrft run`` in a subprocess (same checkout, same thread count as this
    process, so its metrics compare bitwise with in-process runs); output to files beside
    the config (``<name>.stdout`` / ``.stderr``), which never fill up as a pipe can."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [*PYTHONPATH, os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "lightrft", "run", recipe, "--config", str(cfg), *overrides]
    with open(cfg.with_suffix(".stdout"), "w") as out, open(cfg.with_suffix(".stderr"), "w") as err:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=cfg.parent)


def _output(cfg: Path) -> str:
    return cfg.with_suffix(".stdout").read_text() + cfg.with_suffix(".stderr").read_text()


def _wait_for(proc: subprocess.Popen, cfg: Path, ready, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{_output(cfg)}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {timeout} s:\n{_output(cfg)}")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _train_rows(out: Path) -> dict[int, dict]:
    """step -> the train/* metrics of that step, wall-clock rates (``*_per_s``) left out."""
    rows: dict[int, dict] = {}
    for r in read_metrics(out):
        train = {k: v for k, v in r.items() if k.startswith("train/") and not k.endswith("_per_s")}
        if train:
            assert r["step"] not in rows, f"step {r['step']} logged twice in {out}"
            rows[r["step"]] = train
    return rows


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def _resolved(cfg: Path, *overrides: str) -> dict:
    """The run's resolved config as a checkpoint stores it (JSON-normalised)."""
    from omegaconf import OmegaConf

    from lightrft.config import load

    conf, _ = load(str(cfg), list(overrides))
    return json.loads(json.dumps(OmegaConf.to_container(conf, resolve=True), default=str))


# -------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("recipe", ENTRY_RULE_RECIPES)
def test_fresh_run_into_a_used_directory_is_refused_unless_overwrite(
    recipe, tmp_path, recipe_config, capsys
):
    out_dir = tmp_path / "out"
    cfg = recipe_config(recipe, tmp_path, max_steps=3)
    assert _run(capsys, recipe, cfg)[0] == 0
    assert _checkpoints(out_dir) == ["step_000001", "step_000002", "step_000003"]
    before = (out_dir / "metrics.jsonl").read_text()

    rc, out, err = _run(capsys, recipe, cfg)
    assert rc == 2, out + err
    assert "already holds a run" in err, err
    assert "resume=true" in err and "overwrite=true" in err, err
    assert "Traceback" not in err, err
    assert (out_dir / "metrics.jsonl").read_text() == before  # nothing touched

    rc, out, err = _run(capsys, recipe, cfg, "overwrite=true", "max_steps=2")
    assert rc == 0, out + err
    assert sorted(_train_rows(out_dir)) == [1, 2]  # the old rows are gone, not appended to
    assert _checkpoints(out_dir) == ["step_000001", "step_000002"]
    assert (out_dir / "final").is_dir()


# SIGTERM on every recipe; SIGINT (Ctrl-C, 130) with `-m slow` (each case starts a process:
# about 10 s of imports on 2 cores; tests/training/test_training_preemption.py sends SIGINT too).
SIGNAL_CASES = [
    *(pytest.param(r, signal.SIGTERM, 143, id=f"{r}-SIGTERM") for r in RECIPES),
    *(
        pytest.param(r, signal.SIGINT, 130, id=f"{r}-SIGINT", marks=pytest.mark.slow)
        for r in RECIPES
    ),
]


@pytest.mark.parametrize("recipe,sig,code", SIGNAL_CASES)
def test_sigterm_saves_and_resume_continues(recipe, sig, code, tmp_path, recipe_config, capsys):
    """A real signal to a real run: it finishes the step, saves it, exits 128 + signal and says
    how to go on; ``resume=true`` goes on from that step, and its metric rows equal those of an
    uninterrupted run with the same seed.

    While that run is live, a second run into its directory is refused (its lock, naming the
    owner's PID), the live run is untouched (its rows equal the reference's below) and the lock is
    gone once it exits (released at exit). One started process serves both items."""
    run = tmp_path / "run"
    cfg = recipe_config(recipe, run, max_steps=1000, save_every=None)  # saves only when stopped
    cli.load_recipe_checks(cli.resolve_recipe(recipe))  # imports warm: the refusal is quick
    proc = _start(recipe, cfg)
    lock = run / "out" / LOCK_NAME
    try:
        metrics = run / "out" / "metrics.jsonl"
        _wait_for(
            proc,
            cfg,
            lambda: metrics.is_file() and '"train/' in metrics.read_text(),
            "first metric row",
        )
        # A second run on the live directory. The lock is non-empty: the owner writes its PID
        # just after creating the file, before its first step.
        assert lock.is_file() and lock.stat().st_size > 0
        rc, out, err = _run(capsys, recipe, cfg)
        assert proc.poll() is None, "the first run ended before the second was refused"
        assert rc == 2, out + err
        assert "is in use by another run" in err and f"process {proc.pid} on host" in err, err
        assert str(lock) in err, err
        assert "Traceback" not in err, err
        proc.send_signal(sig)
        assert _finish(proc) == code, _output(cfg)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not lock.exists()  # released at exit
    err = cfg.with_suffix(".stderr").read_text()
    assert "Traceback" not in err, err
    assert "continue with resume=true" in err, err
    stopped = _train_rows(run / "out")
    n = max(stopped)
    assert sorted(stopped) == list(range(1, n + 1)) and n < 1000, sorted(stopped)
    ckpts = run / "out" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{n:06d}"  # the step in flight
    assert (ckpts / f"step_{n:06d}" / "meta.json").is_file()  # complete: written last
    assert not list(ckpts.glob("*.tmp"))
    assert f"checkpoint saved in {ckpts / f'step_{n:06d}'}" in err, err

    rc, out, err = _run(capsys, recipe, cfg, "resume=true", f"max_steps={n + 2}")
    assert rc == 0, out + err
    assert f"resumed from step {n}" in out + err, out + err
    resumed = _train_rows(run / "out")
    assert sorted(resumed) == list(range(1, n + 3))

    ref = tmp_path / "ref"
    rc, out, err = _run(
        capsys, recipe, recipe_config(recipe, ref, max_steps=n + 2, save_every=None)
    )
    assert rc == 0, out + err
    reference = _train_rows(ref / "out")
    for step in (n + 1, n + 2):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
    for step in range(1, n + 1):  # the preempted process ran the same curve
        assert stopped[step] == reference[step], (step, stopped[step], reference[step])


@pytest.mark.parametrize("recipe", ENTRY_RULE_RECIPES)
def test_changed_config_on_resume_is_refused_then_allowed(recipe, tmp_path, recipe_config, capsys):
    out_dir = tmp_path / "out"
    cfg = recipe_config(recipe, tmp_path, max_steps=2)
    assert _run(capsys, recipe, cfg)[0] == 0
    rows = _train_rows(out_dir)

    # Keys the checkpoint cannot honour: refused before loading, every one named.
    data_copy = Path(yaml.safe_load(cfg.read_text())["dataset"]["path"]).with_name(
        "train_copy.jsonl"
    )
    rc, out, err = _run(
        capsys, recipe, cfg, "resume=true", "max_steps=3", "seed=1", f"dataset.path={data_copy}"
    )
    assert rc == 2, out + err
    assert "cannot resume from" in err, err
    assert "seed: 0 -> 1" in err and "dataset.path: " in err, err
    assert "Traceback" not in err, err
    assert _train_rows(out_dir) == rows and _checkpoints(out_dir)[-1] == "step_000002"

    # Allowed: logging cadence and length; the new checkpoint records the new values.
    rc, out, err = _run(capsys, recipe, cfg, "resume=true", "max_steps=3", "log_every=3")
    assert rc == 0, out + err
    assert "resumed from step 2" in out + err, out + err
    assert "resume: log_every: 1 -> 3 (allowed)" in out + err, out + err
    assert sorted(_train_rows(out_dir)) == [1, 2, 3]
    saved = json.loads((out_dir / "checkpoints" / "step_000003" / "config.json").read_text())
    assert saved["log_every"] == 3 and saved["max_steps"] == 3

    # A new learning rate only with resume_override_lr=true.
    rc, out, err = _run(capsys, recipe, cfg, "resume=true", "max_steps=4", "optimizer.lr=0.0005")
    assert rc == 2, out + err
    assert "optimizer.lr: 0.001 -> 0.0005" in err and "resume_override_lr=true" in err, err
    assert _checkpoints(out_dir)[-1] == "step_000003"
    rc, out, err = _run(
        capsys,
        recipe,
        cfg,
        "resume=true",
        "max_steps=4",
        "optimizer.lr=0.0005",
        "resume_override_lr=true",
    )
    assert rc == 0, out + err
    assert "resumed from step 3" in out + err, out + err
    after = _train_rows(out_dir)
    assert sorted(after) == [1, 2, 3, 4]
    assert after[3]["train/lr"] == 1e-3 and after[4]["train/lr"] == 5e-4  # constant schedule


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_holds_the_config(recipe, tmp_path, recipe_config, capsys):
    from lightrft.training.checkpoint import CONFIG

    cfg = recipe_config(recipe, tmp_path, max_steps=2)
    assert _run(capsys, recipe, cfg, "log_every=2")[0] == 0  # an override is part of it
    want = _resolved(cfg, "log_every=2")
    assert want["log_every"] == 2
    ckpts = _checkpoints(tmp_path / "out")
    assert ckpts == ["step_000001", "step_000002"]
    for name in ckpts:
        record = tmp_path / "out" / "checkpoints" / name / CONFIG
        assert record.is_file(), f"{name} has no {CONFIG}"
        assert json.loads(record.read_text()) == want, name


@pytest.mark.parametrize("recipe", ENTRY_RULE_RECIPES)
def test_same_seed_same_metrics(recipe, tmp_path, recipe_config, capsys):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cfg = recipe_config(recipe, tmp_path / name, max_steps=3, save_every=None, seed=seed)
        rc, out, err = _run(capsys, recipe, cfg)
        assert rc == 0, out + err
        runs[name] = _train_rows(tmp_path / name / "out")
    assert sorted(runs["a"]) == [1, 2, 3]
    assert runs["a"] == runs["b"]  # bitwise
    assert [r["train/loss"] for r in runs["c"].values()] != [
        r["train/loss"] for r in runs["a"].values()
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_without_checkpoint_is_a_config_error(recipe, tmp_path, recipe_config, capsys):
    cfg = recipe_config(recipe, tmp_path)
    (tmp_path / "out").mkdir()
    rc, out, err = _run(capsys, recipe, cfg, "resume=true")
    assert rc == 2, out + err
    assert "no checkpoint found" in err, err
    assert "Traceback" not in err, err
    assert list((tmp_path / "out").iterdir()) == []  # refused before anything ran
    rc, validate_err = _validate(capsys, cfg, "resume=true")
    assert rc == 2
    assert validate_err == err


def test_damaged_checkpoints_through_the_cli(tmp_path, recipe_config, capsys):
    """A damaged newest checkpoint: the run resumes from the older one and says so; every
    checkpoint damaged: one line naming the file, exit 2, the YAML file not blamed, the same
    from ``validate``."""
    recipe = "sft"
    out_dir = tmp_path / "out"
    cfg = recipe_config(recipe, tmp_path, max_steps=2)
    assert _run(capsys, recipe, cfg)[0] == 0
    ckpts = out_dir / "checkpoints"
    (ckpts / "step_000002" / "meta.json").write_bytes(b"\x00garbage\xff")
    rc, out, err = _run(capsys, recipe, cfg, "resume=true", "max_steps=3")
    assert rc == 0, out + err
    assert f"checkpoint {ckpts / 'step_000002'} is damaged" in out + err, out + err
    assert f"resuming from {ckpts / 'step_000001'}" in out + err, out + err
    assert "resumed from step 1" in out + err, out + err

    for step_dir in ckpts.glob("step_*"):
        (step_dir / "meta.json").write_bytes(b"\x00garbage\xff")
    rc, out, err = _run(capsys, recipe, cfg, "resume=true", "max_steps=4")
    assert rc == 2, out + err
    assert "Traceback" not in err and "meta.json is damaged" in err, err
    assert cfg.name not in err, err  # not the YAML file's fault
    rc, validate_err = _validate(capsys, cfg, "resume=true", "max_steps=4")
    assert rc == 2 and validate_err == err
