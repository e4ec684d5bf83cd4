"""Resume after the config changed: refuse what cannot be honoured, log what can, LR on request."""

from __future__ import annotations

import pytest
import torch

from lightrft.training.checkpoint import Checkpointer
from lightrft.training.optim import warmup_cosine_scheduler
from lightrft.training.resume import check_resume_config, config_changes

CFG = {
    "model": {"path": "/models/a", "dtype": "float32"},
    "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
    # constant LR: a longer run is then an allowed change (a decaying one needs the opt-in,
    # tests/training/test_training_checkpoint_damage.py)
    "lr_scheduler": {"min_lr_ratio": 1.0},
    "algorithm": {"kl": {"coef": None}},
    "max_steps": 10,
    "log_every": 1,
    "eval": {"every": 5},
    "resume": False,
}


def _cfg(**over):
    import copy

    c = copy.deepcopy(CFG)
    for dotted, v in over.items():
        node = c
        *parts, last = dotted.split("__")
        for p in parts:
            node = node.setdefault(p, {})
        node[last] = v
    return c


def _setup(lr=1e-2):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = warmup_cosine_scheduler(opt, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def test_classification_and_null_equals_unset():
    changes = config_changes(
        CFG,
        _cfg(
            max_steps=20,
            log_every=5,
            eval__every=2,
            resume=True,
            model__path="/models/b",
            optimizer__lr=1e-3,
            algorithm__kl__coef=0.1,
        ),
    )
    kinds = {c.key: c.kind for c in changes}
    assert kinds == {
        "algorithm.kl.coef": "refused",
        "eval.every": "allowed",
        "log_every": "allowed",
        "max_steps": "allowed",
        "model.path": "refused",
        "optimizer.lr": "lr",
        "resume": "allowed",
    }
    assert config_changes(CFG, _cfg(algorithm__kl__coef=None)) == []  # null == unset


def test_refusal_lists_every_reason():
    with pytest.raises(ValueError) as info:
        check_resume_config(
            CFG,
            _cfg(
                model__path="/models/b",
                optimizer___component_="torch.optim.SGD",
                optimizer__lr=1e-3,
            ),
            path="ckpt/step_000010",
            resharded=True,  # saved by 2 ranks, resumed on 1
        )
    msg = str(info.value)
    assert "cannot resume from ckpt/step_000010" in msg
    assert "model.path: '/models/a' -> '/models/b'" in msg
    assert "optimizer._component_: 'torch.optim.AdamW' -> 'torch.optim.SGD'" in msg
    assert "world size" not in msg  # another world size resumes (tests/recipes/*_world*)
    assert "optimizer.lr: 0.01 -> 0.001 (set resume_override_lr=true" in msg


def test_per_rank_batch_keys_may_change_with_the_world_size_only():
    """2 ranks x batch_size 4 -> 1 rank x batch_size 8 keeps the global batch (checked against
    the checkpoint's record, lightrft.training.checkpoint.check_reshardable)."""
    saved, current = _cfg(batch_size=4), _cfg(batch_size=8, gradient_accumulation_steps=2)
    changes = check_resume_config(saved, current, path="ckpt", resharded=True)  # 2 -> 1
    assert {c.key: c.kind for c in changes} == {
        "batch_size": "allowed",
        "gradient_accumulation_steps": "allowed",
    }
    with pytest.raises(ValueError, match="batch_size: 4 -> 8"):
        check_resume_config(saved, current, path="ckpt", resharded=False)  # 2 -> 2


def test_checkpoint_saves_config_and_resume_checks_it_before_loading(tmp_path, capsys):
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(3, models=model, optimizers=opt, schedulers=sched, config=CFG)
    assert (path / "config.json").is_file()
    fresh, fopt, fsched = _setup()
    with torch.no_grad():
        fresh.weight.zero_()
    with pytest.raises(ValueError, match=r"model.path: '/models/a' -> '/models/b'"):
        ckpt.load_latest(
            models=fresh, optimizers=fopt, schedulers=fsched, config=_cfg(model__path="/models/b")
        )
    assert torch.count_nonzero(fresh.weight) == 0  # refused before anything was loaded
    state = ckpt.load_latest(
        models=fresh, optimizers=fopt, schedulers=fsched, config=_cfg(max_steps=20, resume=True)
    )
    out = capsys.readouterr().out
    assert "resume: max_steps: 10 -> 20 (allowed)" in out
    assert f"resumed from step 3 ({path})" in out
    assert [str(c) for c in state.config_changes] == [
        "max_steps: 10 -> 20",
        "resume: False -> True",
    ]
    assert torch.equal(fresh.weight, model.weight)


def test_changed_lr_needs_override_and_then_keeps_the_schedule_position(tmp_path):
    model, opt, sched = _setup(lr=1e-2)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, models=model, optimizers=opt, schedulers=sched, config=CFG)
    saved_lr = opt.param_groups[0]["lr"]  # 1e-2 * schedule factor at step 3
    new = _cfg(optimizer__lr=1e-3)
    m2, o2, s2 = _setup(lr=1e-3)
    with pytest.raises(ValueError, match="resume_override_lr=true"):
        ckpt.load_latest(models=m2, optimizers=o2, schedulers=s2, config=new)
    # Without a config check the saved LR silently wins: this is what the override changes.
    ckpt.load_latest(models=m2, optimizers=o2, schedulers=s2)
    assert o2.param_groups[0]["lr"] == saved_lr
    m3, o3, s3 = _setup(lr=1e-3)
    ckpt.load_latest(models=m3, optimizers=o3, schedulers=s3, config=new, override_lr=True)
    assert o3.param_groups[0]["lr"] == pytest.approx(saved_lr / 10)
    assert s3.base_lrs == [1e-3]
    s3.step()
    sched.step()
    assert o3.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"] / 10)


def test_checkpoints_that_cannot_continue_on_another_world_size_are_refused(tmp_path):
    """Before anything loads, naming the reason: DeepSpeed's per-rank optimizer partitions, a
    plain loader, a changed global batch, a checkpoint without the record."""
    from lightrft.training.checkpoint import check_reshardable

    meta = {"world_size": 2, "dataloaders": ["model"], "global_batches": {"model": 16}}
    check_reshardable(tmp_path, meta, 1, global_batch=16)  # kept: fine
    with pytest.raises(ValueError, match="strategy=deepspeed, and this run has 4: DeepSpeed ZeRO"):
        check_reshardable(tmp_path, {**meta, "deepspeed": ["model"]}, 4, global_batch=16)
    with pytest.raises(ValueError, match="reading 16 items per step over all ranks .model.; this"):
        check_reshardable(tmp_path, meta, 1, global_batch=8)
    with pytest.raises(ValueError, match="did not record its global batch"):
        check_reshardable(tmp_path, {**meta, "global_batches": {}}, 1, global_batch=16)
    with pytest.raises(ValueError, match="dataloader 'model' .list. cannot re-derive"):
        check_reshardable(tmp_path, meta, 1, loaders={"model": []})
