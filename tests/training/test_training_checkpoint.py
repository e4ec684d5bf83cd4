"""Checkpointer: real DCP files, bitwise restore, atomicity, pruning, 1 and 2 (FSDP2) processes."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from _dist import run_distributed
from torchdata.stateful_dataloader import StatefulDataLoader

from lightrft.models import load_causal_lm
from lightrft.models.parallel import parallelize
from lightrft.training.checkpoint import Checkpointer, CheckpointError
from lightrft.training.optim import warmup_cosine_scheduler


def _batch(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 99, (2, 12), generator=g)  # [B, T]


def _train_step(model, opt, sched, seed: int) -> None:
    x = _batch(seed)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (DTensor or plain) tensor, cloned."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(model, opt, sched) -> dict:
    params = {k: _local(v) for k, v in model.state_dict().items()}
    optim = {
        k: {s: _local(v) if torch.is_tensor(v) else v for s, v in st.items()}
        for k, st in opt.state.items()
    }
    return {"params": params, "optim": optim, "sched": sched.state_dict()}


def _assert_same(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert len(a["optim"]) == len(b["optim"]) > 0
    for sa, sb in zip(a["optim"].values(), b["optim"].values(), strict=True):
        for s in sa:
            assert torch.equal(torch.as_tensor(sa[s]), torch.as_tensor(sb[s])), s
    assert a["sched"] == b["sched"]


def _setup(model_dir, lr=1e-2):
    model = load_causal_lm(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = warmup_cosine_scheduler(opt, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    return model, opt, sched


def test_save_modify_load_restores_everything_bitwise(tiny_model_dir, tmp_path):
    model, opt, sched = _setup(tiny_model_dir)
    loader = StatefulDataLoader(
        list(range(40)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    it = iter(loader)
    for s in range(2):
        next(it)
        _train_step(model, opt, sched, s)
    ckpt = Checkpointer(tmp_path, keep_last=2)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    path = ckpt.save(
        2,
        models=model,
        optimizers=opt,
        schedulers=sched,
        dataloaders=loader,
        extra={"epoch": 0, "kl": {"coef": torch.tensor(0.05)}},
    )
    assert path == tmp_path / "checkpoints" / "step_000002"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert (path / ".metadata").is_file() and (path / "rank_00000.json").is_file()
    saved = _snapshot(model, opt, sched)
    want_batch = next(it)
    want_rng = (random.random(), np.random.rand(), torch.rand(2))

    _train_step(model, opt, sched, 7)  # move every piece of state away from the checkpoint
    next(it)
    random.random(), torch.rand(3)

    state = ckpt.load_latest(models=model, optimizers=opt, schedulers=sched, dataloaders=loader)
    assert state is not None and state.step == 2 and state.path == path
    assert state.extra["epoch"] == 0 and torch.equal(state.extra["kl"]["coef"], torch.tensor(0.05))
    _assert_same(saved, _snapshot(model, opt, sched))
    got_rng = (random.random(), np.random.rand(), torch.rand(2))
    assert got_rng[:2] == want_rng[:2] and torch.equal(got_rng[2], want_rng[2])
    assert torch.equal(next(iter(loader)), want_batch)


def test_resumed_training_matches_uninterrupted(tiny_model_dir, tmp_path):
    model, opt, sched = _setup(tiny_model_dir)
    for s in range(4):
        _train_step(model, opt, sched, s)
    want = _snapshot(model, opt, sched)

    model, opt, sched = _setup(tiny_model_dir)
    ckpt = Checkpointer(tmp_path)
    for s in range(2):
        _train_step(model, opt, sched, s)
    ckpt.save(2, models=model, optimizers=opt, schedulers=sched)
    del model, opt, sched
    model, opt, sched = _setup(tiny_model_dir)  # a fresh process would start like this
    state = ckpt.load_latest(models=model, optimizers=opt, schedulers=sched, required=True)
    for s in range(state.step, 4):
        _train_step(model, opt, sched, s)
    _assert_same(want, _snapshot(model, opt, sched))


def test_several_named_models_and_optimizers(tiny_model_dir, tmp_path):
    policy, popt, psched = _setup(tiny_model_dir)
    critic, copt, _ = _setup(tiny_model_dir, lr=5e-3)
    _train_step(policy, popt, psched, 0)
    x = _batch(3)
    critic(input_ids=x, labels=x, use_cache=False).loss.backward()
    copt.step()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(
        1,
        models={"policy": policy, "critic": critic},
        optimizers={"policy": popt, "critic": copt},
        schedulers={"policy": psched},
    )
    want_c = {k: v.clone() for k, v in critic.state_dict().items()}
    want_v = copt.state[next(iter(critic.parameters()))]["exp_avg_sq"].clone()
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(1.0)
    copt.state[next(iter(critic.parameters()))]["exp_avg_sq"].zero_()
    ckpt.load_latest(
        models={"policy": policy, "critic": critic},
        optimizers={"policy": popt, "critic": copt},
        schedulers={"policy": psched},
    )
    for k, v in critic.state_dict().items():
        assert torch.equal(v, want_c[k]), k
    assert torch.equal(copt.state[next(iter(critic.parameters()))]["exp_avg_sq"], want_v)
    meta = json.loads((tmp_path / "checkpoints/step_000001/meta.json").read_text())
    assert meta["models"] == ["critic", "policy"] and meta["schedulers"] == ["policy"]

    with pytest.raises(ValueError, match=r"optimizers \['value'\] have no model"):
        ckpt.save(2, models={"policy": policy}, optimizers={"value": copt})
    with pytest.raises(ValueError, match=r"models \['reward'\] are not in checkpoint"):
        ckpt.load_latest(models={"reward": critic})


class _Boom(BaseException):
    """A kill mid-save (nothing in the process gets to clean up, like SIGKILL)."""


def test_crash_mid_save_keeps_last_good_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    model, opt, sched = _setup(tiny_model_dir)
    _train_step(model, opt, sched, 0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, models=model, optimizers=opt, schedulers=sched, extra={"tag": "good"})
    good = _snapshot(model, opt, sched)
    _train_step(model, opt, sched, 1)

    import lightrft.training.checkpoint as mod

    def crash(obj, path):  # the DCP shards are already written when the per-rank file fails
        raise _Boom("disk full")

    monkeypatch.setattr(mod, "save_state", crash)
    with pytest.raises(_Boom):
        ckpt.save(2, models=model, optimizers=opt, schedulers=sched, extra={"tag": "bad"})
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert (root / "step_000002.tmp" / ".metadata").is_file()  # partial write is really there
    assert not (root / "step_000002").exists()
    assert (root / "latest").read_text().strip() == "step_000001"
    assert ckpt.latest() == root / "step_000001"

    state = ckpt.load_latest(models=model, optimizers=opt, schedulers=sched)
    assert state.step == 1 and state.extra == {"tag": "good"}
    _assert_same(good, _snapshot(model, opt, sched))
    # A partial directory is never loadable by name either.
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.load(root / "step_000002.tmp", models=model)
    # The next successful save clears the debris.
    ckpt.save(3, models=model)
    assert not (root / "step_000002.tmp").exists()


def test_keep_last_prunes_oldest(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir)
    ckpt = Checkpointer(tmp_path, keep_last=2, every_n_steps=5)
    saved = [s for s in range(1, 21) if ckpt.should_save(s)]
    assert saved == [5, 10, 15, 20]
    for s in saved:
        ckpt.save(s, models=model)
    assert [p.name for p in ckpt.list_checkpoints()] == ["step_000015", "step_000020"]
    assert ckpt.latest().name == "step_000020"
    # Saving the same step again replaces it in place and keeps `latest` valid.
    ckpt.save(20, models=model)
    assert [p.name for p in ckpt.list_checkpoints()] == ["step_000015", "step_000020"]


def test_crash_while_replacing_a_step_leaves_no_hidden_copy(tiny_model_dir, tmp_path, monkeypatch):
    """Saving a step again moves the old copy aside (``.step_N.*.old``) and deletes it; a kill
    during that deletion leaves it behind, and the next save must clear it, not keep it forever."""
    model = load_causal_lm(tiny_model_dir)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, models=model)
    import shutil

    rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        if str(path).endswith(".old"):
            raise _Boom("killed while deleting the replaced copy")
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(_Boom):
        ckpt.save(1, models=model)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.glob(".step_*.old")]  # the debris is really there
    assert ckpt.latest() == root / "step_000001"
    ckpt.save(2, models=model)
    assert not list(root.glob(".step_*.old"))


def test_stale_latest_pointer_falls_back_to_newest_complete(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir)
    ckpt = Checkpointer(tmp_path, keep_last=None)
    ckpt.save(1, models=model)
    ckpt.save(2, models=model)
    (tmp_path / "checkpoints" / "latest").write_text("step_000009\n")
    assert ckpt.latest().name == "step_000002"


def test_resume_without_checkpoint(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir)
    ckpt = Checkpointer(tmp_path / "run")
    assert ckpt.load_latest(models=model) is None
    with pytest.raises(ValueError, match=r"resume=true but no checkpoint found in .*run"):
        ckpt.load_latest(models=model, required=True)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="every_n_steps"):
        Checkpointer(tmp_path, every_n_steps=0)


# ---------------------------------------------------------------------------------------------
# 2 processes, FSDP2 over gloo


def _fsdp_worker(rank: int, world_size: int, model_dir: str, out_dir: str) -> None:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = parallelize(load_causal_lm(model_dir))
    assert isinstance(model.lm_head.weight, DTensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = warmup_cosine_scheduler(opt, warmup_steps=1, total_steps=10)
    # Per-rank data position: each rank has read a different number of batches.
    loader = StatefulDataLoader(list(range(100 * rank, 100 * rank + 40)), batch_size=4)
    it = iter(loader)
    for _ in range(rank + 1):
        next(it)
    for s in range(2):
        _train_step(model, opt, sched, 10 * rank + s)
    ckpt = Checkpointer(out_dir, keep_last=1)
    torch.manual_seed(100 + rank)
    ckpt.save(
        2, models=model, optimizers=opt, schedulers=sched, dataloaders=loader, extra={"rank": rank}
    )
    saved = _snapshot(model, opt, sched)
    want_batch, want_rand = next(it), torch.rand(4)

    _train_step(model, opt, sched, 99)
    state = ckpt.load_latest(
        models=model, optimizers=opt, schedulers=sched, dataloaders=loader, required=True
    )
    assert state.step == 2 and state.extra == {"rank": rank} and state.world_size == 2
    _assert_same(saved, _snapshot(model, opt, sched))
    assert torch.equal(torch.rand(4), want_rand)
    assert torch.equal(next(iter(loader)), want_batch)

    # A fresh model + optimizer (as in a restarted job) gets the same shards.
    model2 = parallelize(load_causal_lm(model_dir))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = warmup_cosine_scheduler(opt2, warmup_steps=1, total_steps=10)
    ckpt.load_latest(models=model2, optimizers=opt2, schedulers=sched2)
    _assert_same(saved, _snapshot(model2, opt2, sched2))
    full = {k: v.full_tensor() for k, v in model2.state_dict().items()}  # collective
    if rank == 0:
        torch.save(full, f"{out_dir}/full_weights.pt")


def test_fsdp2_two_process_save_load(tiny_model_dir, tmp_path):
    run_distributed(_fsdp_worker, str(tiny_model_dir), str(tmp_path))
    ckpt_dir = tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.name for p in ckpt_dir.glob("rank_*.json")) == [
        "rank_00000.json",
        "rank_00001.json",
    ]
    assert json.loads((ckpt_dir / "meta.json").read_text())["world_size"] == 2

    # Another world size gets rank 0's `extra` on every rank: one that differs across the
    # saved ranks has no owner, a clear error. (Loaders and RNG: tests/data, tests/recipes.)
    model = load_causal_lm(tiny_model_dir)
    with pytest.raises(CheckpointError, match=r"per-rank state \['rank'\] differs between its 2"):
        Checkpointer(tmp_path).load_latest(models=model)
    # ... but model weights alone reshard fine (DCP) when per-rank state is not asked for.
    state = Checkpointer(tmp_path).load_latest(models=model, restore_rng=False)
    assert state.step == 2
    full = torch.load(tmp_path / "full_weights.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k


# ---------------------------------------------------------------------------------------------
# Data order across an epoch boundary (the pattern docs/checkpoints.md recommends)


def _epoch_loader():
    from torch.utils.data import DistributedSampler

    data = list(range(12))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
    return StatefulDataLoader(data, batch_size=4, sampler=sampler), sampler


def _run_epochs(loader, sampler, start_epoch: int, epochs: int, stop_after: int | None = None):
    """Batches seen, optionally stopping after ``stop_after`` batches; returns (batches, epoch)."""
    seen = []
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            seen.append(batch.tolist())
            if stop_after is not None and len(seen) == stop_after:
                return seen, epoch
    return seen, epochs


@pytest.mark.parametrize("stop_after", [3, 4], ids=["epoch_end", "mid_epoch"])
def test_resume_at_epoch_boundary_continues_with_next_epoch(tmp_path, stop_after):
    want, _ = _run_epochs(*_epoch_loader(), 0, 3)  # 3 epochs x 3 batches

    loader, sampler = _epoch_loader()
    first, epoch = _run_epochs(loader, sampler, 0, 3, stop_after=stop_after)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(stop_after, models=torch.nn.Linear(1, 1), dataloaders=loader, extra={"epoch": epoch})

    loader, sampler = _epoch_loader()
    state = ckpt.load_latest(models=torch.nn.Linear(1, 1), dataloaders=loader, required=True)
    rest, _ = _run_epochs(loader, sampler, state.extra["epoch"], 3)
    assert first + rest == want and len(rest) == 9 - stop_after


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_and_rng_round_trip(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = _batch(0).cuda()
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    opt.step()
    ckpt = Checkpointer(tmp_path)
    torch.cuda.manual_seed(3)
    ckpt.save(1, models=model, optimizers=opt)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_rand = torch.rand(4, device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ckpt.load_latest(models=model, optimizers=opt)
    for k, v in model.state_dict().items():
        assert v.is_cuda and torch.equal(v, want[k]), k
    assert torch.equal(torch.rand(4, device="cuda"), want_rand)


def test_resharded_load_without_rank_state_gives_rank_0s_extra(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Saved by 3 ranks, loaded by rank 1 of 2 with no dataloaders and no RNG (weights alone):
    ``extra`` is rank 0's on every rank, as the docstring says, not the saved rank 1's."""
    import lightrft.training.checkpoint as mod

    model, opt, sched = _setup(tiny_model_dir)
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(3, models=model, optimizers=opt, schedulers=sched, extra={"epoch": 1})
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "world_size": 3}))
    state0 = json.loads((path / "rank_00000.json").read_text())
    for r in (1, 2):  # what ranks 1 and 2 of the saving run wrote (tensors beside the JSON)
        (path / f"rank_{r:05d}.json").write_text(json.dumps(state0))
        shutil.copy(path / "rank_00000.safetensors", path / f"rank_{r:05d}.safetensors")
    monkeypatch.setattr(mod, "_rank_and_world", lambda: (1, 2))
    state = ckpt.load(path, models=model, optimizers=opt, schedulers=sched, restore_rng=False)
    assert state.extra == {"epoch": 1} and state.world_size == 3
    (path / "rank_00001.json").write_text(json.dumps({**state0, "extra": {"epoch": 2}}))
    state = ckpt.load(path, models=model, optimizers=opt, schedulers=sched, restore_rng=False)
    assert state.extra == {"epoch": 1}  # rank 0's (it was the saved rank 1's, epoch 2)
