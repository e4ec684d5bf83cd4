"""Damaged checkpoint files, odd ``latest`` pointers, another model's checkpoint, bad metrics rows
and a longer cosine schedule on resume: each fault injected into real files."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightrft.training.checkpoint import Checkpointer, CheckpointError, check_resume
from lightrft.training.metrics import MetricLogger, read_metrics
from lightrft.training.optim import warmup_cosine_scheduler
from lightrft.training.resume import check_resume_config


def _small(in_features: int = 4, lr: float = 1e-2, total: int = 10):
    torch.manual_seed(0)
    model = torch.nn.Linear(in_features, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = warmup_cosine_scheduler(opt, warmup_steps=0, total_steps=total, min_lr_ratio=0.0)
    return model, opt, sched


def _step(model, opt, sched) -> None:
    model(torch.randn(2, model.in_features)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _two_checkpoints(tmp_path):
    """Checkpoints of steps 1 and 2 (keep all) and the objects to load them into."""
    model, opt, sched = _small()
    ckpt = Checkpointer(tmp_path, keep_last=None)
    for step in (1, 2):
        _step(model, opt, sched)
        ckpt.save(step, models=model, optimizers=opt, schedulers=sched, config={"a": 1})
    return ckpt, (model, opt, sched)


def _load(ckpt, objs):
    model, opt, sched = objs
    return ckpt.load_latest(models=model, optimizers=opt, schedulers=sched, config={"a": 1})


# ------------------------------------------------------------------------------ latest pointer


@pytest.mark.parametrize(
    "pointer",
    ["../../../elsewhere/step_000009", "ABSOLUTE", "step_000001/../step_000002", b"\xff\xfe"],
)
def test_latest_pointer_outside_the_directory_is_ignored(tmp_path, capsys, pointer):
    ckpt, objs = _two_checkpoints(tmp_path / "run")
    # A complete checkpoint outside the run's directory the pointer leads to.
    elsewhere = tmp_path / "elsewhere"
    Checkpointer(elsewhere).save(9, models=torch.nn.Linear(4, 3))
    if pointer == "ABSOLUTE":
        pointer = str(elsewhere / "checkpoints" / "step_000009")
    data = pointer if isinstance(pointer, bytes) else pointer.encode()
    (ckpt.root / "latest").write_bytes(data)
    assert ckpt.latest() == ckpt.root / "step_000002"
    state = _load(ckpt, objs)
    assert state.step == 2 and state.path == ckpt.root / "step_000002"
    out = capsys.readouterr().out
    assert f"{ckpt.root / 'latest'} does not hold a plain step_N name" in out, out


# ------------------------------------------------------------------------------ damaged files


def _truncate(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _damage(step_dir, what):
    if what == "distcp":
        _truncate(sorted(step_dir.glob("*.distcp"))[0])
        return sorted(step_dir.glob("*.distcp"))[0]
    if what == "safetensors":
        _truncate(step_dir / "rank_00000.safetensors")
        return step_dir / "rank_00000.safetensors"
    if what == "rank_json":
        _truncate(step_dir / "rank_00000.json")
        return step_dir / "rank_00000.json"
    if what == "rank_missing":  # e.g. a checkpoint copied in part
        (step_dir / "rank_00000.json").unlink()
        return step_dir / "rank_00000.json"
    if what == "config":
        (step_dir / "config.json").write_bytes(b'{"a": "\xff\xfe\x00"}\n')
        return step_dir / "config.json"
    if what == "meta":
        (step_dir / "meta.json").write_bytes(os.urandom(64))
        return step_dir / "meta.json"
    if what == "metadata":
        _truncate(step_dir / ".metadata")
        return step_dir / ".metadata"
    if what == "deepspeed":  # the layout engine.save_checkpoint writes: torch.save zip archives
        bad = step_dir / "deepspeed.model" / "mp_rank_00_model_states.pt"
        bad.parent.mkdir()
        torch.save({"module": torch.nn.Linear(4, 3).state_dict()}, bad)
        torch.save({"optimizer": {}}, bad.parent / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        _truncate(bad)
        return bad
    raise AssertionError(what)


WHATS = [
    "distcp",
    "safetensors",
    "rank_json",
    "rank_missing",
    "config",
    "meta",
    "metadata",
    "deepspeed",
]


@pytest.mark.parametrize("what", WHATS)
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, capsys, what):
    ckpt, objs = _two_checkpoints(tmp_path)
    bad = _damage(ckpt.root / "step_000002", what)
    state = _load(ckpt, objs)
    assert state.step == 1
    out = capsys.readouterr().out
    assert f"checkpoint {ckpt.root / 'step_000002'} is damaged" in out, out
    assert str(bad) in out or f"{bad.parent / bad.stem.split('.')[0]}" in out, out
    assert f"resuming from {ckpt.root / 'step_000001'}, the newest complete and readable" in out


@pytest.mark.parametrize("what", WHATS)
def test_only_checkpoint_damaged_is_refused_naming_the_file(tmp_path, capsys, what):
    model, opt, sched = _small()
    ckpt = Checkpointer(tmp_path)
    _step(model, opt, sched)
    path = ckpt.save(1, models=model, optimizers=opt, schedulers=sched, config={"a": 1})
    _damage(path, what)
    with pytest.raises(CheckpointError) as info:
        _load(ckpt, (model, opt, sched))
    msg = str(info.value)
    assert "\n" not in msg and "damaged" in msg and str(path) in msg, msg
    assert "config" not in msg.split("damaged")[0] or what == "config", msg  # not the YAML's


def test_resume_check_at_config_time_does_not_blame_the_yaml(tmp_path, capsys):
    """The LoRA check that runs while the config resolves reads the newest *readable*
    checkpoint's meta.json; a garbage one is a CheckpointError (not a ValueError that
    ``validate`` would pin on the YAML file)."""
    ckpt, _ = _two_checkpoints(tmp_path)
    _damage(ckpt.root / "step_000002", "meta")
    check_resume(tmp_path, False, ("model",))  # step 1 is used, step 2 reported
    assert "is damaged" in capsys.readouterr().out
    _damage(ckpt.root / "step_000001", "meta")
    with pytest.raises(CheckpointError) as info:
        check_resume(tmp_path, False, ("model",))
    assert not isinstance(info.value, ValueError)


def test_validate_does_not_pin_a_checkpoint_error_on_the_config_file():
    from omegaconf import OmegaConf

    from lightrft.config import Source, validate

    def options(cfg):
        raise CheckpointError("/x/checkpoints/step_000002/meta.json is damaged (...)")

    with pytest.raises(CheckpointError) as info:
        validate(OmegaConf.create({"a": 1}), options=options, source=Source(path="run.yaml"))
    assert "run.yaml" not in str(info.value)


# ------------------------------------------------------------------------------ another model


def test_checkpoint_of_another_model_says_so(tmp_path):
    model, opt, sched = _small(in_features=4)
    ckpt = Checkpointer(tmp_path)
    _step(model, opt, sched)
    path = ckpt.save(1, models=model, optimizers=opt, schedulers=sched)  # no config saved
    other, o_opt, o_sched = _small(in_features=5)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_latest(models=other, optimizers=o_opt, schedulers=o_sched)
    msg = str(info.value)
    assert f"checkpoint {path} is from a different model" in msg, msg
    assert "Size mismatch" in msg and "\n" not in msg, msg


# ------------------------------------------------------------------------------ metrics rows


def test_metrics_row_with_a_non_integer_step_is_kept_and_reported(tmp_path, capsys):
    rows = [{"step": 1, "x": 1.0}, {"step": "two", "x": 2.0}, {"step": 3, "x": 3.0}]
    rows.append({"step": None, "x": 4.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    MetricLogger(tmp_path, tensorboard=False, resume_step=2).close()
    out = capsys.readouterr().out
    assert f"{tmp_path / 'metrics.jsonl'}:2: step 'two' is not an integer" in out, out
    assert f"{tmp_path / 'metrics.jsonl'}:4: step None is not an integer" in out, out
    kept = read_metrics(tmp_path)
    assert [r["x"] for r in kept] == [1.0, 2.0, 4.0]


# ------------------------------------------------------------------------------ LR schedule


SAVED = {"optimizer": {"lr": 3e-4}, "lr_scheduler": {"warmup_steps": 0}, "max_steps": 10}


def test_longer_max_steps_with_a_decaying_schedule_needs_the_opt_in(tmp_path):
    longer = {**SAVED, "max_steps": 40}
    with pytest.raises(ValueError) as info:
        check_resume_config(SAVED, longer, path=tmp_path)
    assert "max_steps: 10 -> 40" in str(info.value) and "resume_override_lr=true" in str(info.value)
    changes = check_resume_config(SAVED, longer, path=tmp_path, override_lr=True)
    assert [(c.key, c.kind) for c in changes] == [("max_steps", "schedule")]
    # A constant LR does not depend on the length: allowed as before.
    const = {**SAVED, "lr_scheduler": {"min_lr_ratio": 1.0}}
    assert check_resume_config(const, {**const, "max_steps": 40}, path=tmp_path)[0].kind == (
        "allowed"
    )
    # epochs sets the length only when max_steps is unset.
    by_epochs = {"optimizer": {"lr": 3e-4}, "epochs": 1}
    assert (
        check_resume_config(by_epochs, {**by_epochs, "epochs": 2}, path=tmp_path, override_lr=True)[
            0
        ].kind
        == "schedule"
    )
    assert check_resume_config(SAVED, {**SAVED, "epochs": 2}, path=tmp_path)[0].kind == "allowed"


def test_longer_max_steps_refused_through_load_then_applied_with_opt_in(tmp_path, capsys):
    model, opt, sched = _small(lr=3e-4, total=10)
    ckpt = Checkpointer(tmp_path)
    for _ in range(5):
        _step(model, opt, sched)
    ckpt.save(5, models=model, optimizers=opt, schedulers=sched, config=SAVED)
    lr_at_5 = opt.param_groups[0]["lr"]
    model, opt, sched = _small(lr=3e-4, total=40)
    longer = {**SAVED, "max_steps": 40}
    with pytest.raises(ValueError, match="max_steps: 10 -> 40"):
        ckpt.load_latest(models=model, optimizers=opt, schedulers=sched, config=longer)
    ckpt.load_latest(
        models=model, optimizers=opt, schedulers=sched, config=longer, override_lr=True
    )
    assert "resume: max_steps: 10 -> 40 (applied)" in capsys.readouterr().out
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at_5)
    _step(model, opt, sched)  # the new, longer schedule from here: the LR goes up
    assert opt.param_groups[0]["lr"] > lr_at_5
