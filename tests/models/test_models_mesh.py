"""Device meshes (FSDP 1-D, HSDP 2-D) and checkpoints that reshard across world sizes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _serial import each

from lightrft.models.parallel import build_mesh
from lightrft.models.sharded import load_parallel
from lightrft.sections import StrategyConfig, mesh_shape
from lightrft.tasks import make_tiny_model
from lightrft.training import Checkpointer

# A fixed global batch per step: 4 rows of 12 tokens; rank r of 2 trains on rows 2r, 2r+1.
STEPS = 4
BATCHES = [
    torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)
]


# ------------------------------------------------------------------------------ options


def test_mesh_shape_from_sizes():
    assert mesh_shape(None, None, 8) == (1, 8)
    assert mesh_shape(4, None, 8) == (2, 4)
    assert mesh_shape(None, 4, 8) == (4, 2)
    assert mesh_shape(2, 4, 8) == (4, 2)
    assert mesh_shape(1, None, 1) == (1, 1)


@pytest.mark.parametrize(
    ("shard", "replicate", "world", "message"),
    [
        (3, None, 8, "shard_size=3 does not divide the world size 8"),
        (None, 3, 4, "replicate_size=3 does not divide the world size 4"),
        (2, 2, 8, "replicate_size=2 x shard_size=2 = 4 ranks, but the run has 8"),
        (2, None, 1, "shard_size=2 does not divide the world size 1"),
    ],
)
def test_mesh_sizes_that_do_not_fit_are_refused(shard, replicate, world, message):
    with pytest.raises(ValueError, match=message):
        mesh_shape(shard, replicate, world)


@pytest.mark.parametrize(
    ("shard", "replicate", "message"),
    [
        (0, None, "shard_size must be >= 1, got 0"),
        (None, -2, "replicate_size must be >= 1, got -2"),
        ("4", None, "shard_size expects int, got '4'"),
        (2.5, None, "shard_size expects int, got 2.5"),
    ],
)
def test_mesh_options_are_checked(shard, replicate, message):
    with pytest.raises(ValueError, match=message):
        StrategyConfig.read({"shard_size": shard, "replicate_size": replicate})


def test_mesh_config_checks_the_launch_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert StrategyConfig.read({"shard_size": 4}).shard_size == 4  # validate without torchrun
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="shard_size=4 does not divide the world size 6"):
        StrategyConfig.read({"shard_size": 4})


def test_one_plain_process_has_no_mesh():
    assert build_mesh(None, None, "cpu") is None
    assert build_mesh(1, 1, "cpu") is None


# ------------------------------------------------------------------------------ training


def _rows(world: int, rank: int, batch: torch.Tensor) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def _train(model, opt, steps: range) -> list[float]:
    """One AdamW step per global batch; the global mean loss of each step (before the step)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for s in steps:
        ids = _rows(world, rank, BATCHES[s])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def _model_and_opt(path, mesh=None):
    model = load_parallel(path, mesh=mesh)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _uninterrupted(path) -> list[float]:
    torch.manual_seed(0)
    model, opt = _model_and_opt(path)
    return _train(model, opt, range(STEPS))


def _mesh_worker(rank: int, world: int, path: str, expected: list[float]) -> None:
    from torch.distributed.tensor import DTensor

    for shard, replicate, dims in ((2, None, ("shard",)), (1, 2, ("replicate", "shard"))):
        mesh = build_mesh(shard, replicate, "cpu")
        assert mesh.mesh_dim_names == dims
        model, opt = _model_and_opt(path, mesh)
        w = model.model.layers[0].mlp.up_proj.weight
        assert isinstance(w, DTensor) and w.device_mesh.mesh_dim_names == dims
        # HSDP with shard_size=1: every rank holds the whole weight, replicated.
        assert w.to_local().shape[0] == (w.shape[0] // 2 if shard == 2 else w.shape[0])
        losses = _train(model, opt, range(STEPS))
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


def _mesh_timeout_worker(rank: int, world: int) -> None:
    """HSDP's sub-groups get the default group's collective_timeout_s (torch would make them
    with its own 30 min on gloo). The harness made the group itself; set what init_distributed
    records for collective_timeout_s=7, and put it back after."""
    from datetime import timedelta

    import lightrft.distributed as ld

    def timeouts(mesh) -> list[timedelta]:
        groups = [mesh.get_group(name) for name in ("replicate", "shard")]
        return [g._get_backend(torch.device("cpu")).options._timeout for g in groups]

    assert timeouts(build_mesh(1, 2, "cpu")) == [timedelta(minutes=30)] * 2  # torch's default
    ld._collective_timeout = timedelta(seconds=7)
    try:
        assert timeouts(build_mesh(1, 2, "cpu")) == [timedelta(seconds=7)] * 2
    finally:
        ld._collective_timeout = None


@pytest.fixture(scope="module")
def two_rank_mesh(tmp_path_factory) -> dict:
    """One spawn of 2 gloo ranks for both tests below: :func:`_mesh_worker` (FSDP and HSDP
    meshes against one process's losses), then the 2-rank halves of the resharding test, a save
    (``two_to_one``, resumed by the test in this process) and a resume of the one-process save
    (``one_to_two``, made here first)."""
    tmp = tmp_path_factory.mktemp("mesh")
    path = str(make_tiny_model(tmp / "m"))
    expected = _uninterrupted(path)
    two_to_one, one_to_two = str(tmp / "a"), str(tmp / "b")
    _save_first_half(0, 1, path, one_to_two)
    run_distributed(
        each,
        [
            (_mesh_worker, (path, expected)),
            (_mesh_timeout_worker, ()),
            (_save_first_half, (path, two_to_one)),
            (_resume_second_half, (path, one_to_two, expected)),
        ],
    )
    return {"path": path, "expected": expected, "two_to_one": two_to_one}


def test_hsdp_sub_groups_get_the_collective_timeout(two_rank_mesh):
    """Checked in both ranks by the fixture's spawn (:func:`_mesh_timeout_worker`)."""
    assert two_rank_mesh["path"]


def test_fsdp_and_hsdp_meshes_train_like_one_process(two_rank_mesh):
    """2 gloo ranks on a 1x2 mesh (FSDP) and a 2x1 mesh (HSDP: replicate x shard) give the
    losses of one process on the whole batch (checked in both ranks by the fixture's spawn)."""
    assert len(two_rank_mesh["expected"]) == STEPS


def _save_first_half(rank: int, world: int, path: str, out: str) -> None:
    torch.manual_seed(0)
    model, opt = _model_and_opt(path)
    _train(model, opt, range(STEPS // 2))
    Checkpointer(out).save(STEPS // 2, models=model, optimizers=opt)


def _resume_second_half(rank: int, world: int, path: str, out: str, expected: list[float]):
    model, opt = _model_and_opt(path)
    state = Checkpointer(out).load_latest(
        models=model, optimizers=opt, restore_rng=False, required=True
    )
    assert state.step == STEPS // 2
    losses = _train(model, opt, range(STEPS // 2, STEPS))
    torch.testing.assert_close(losses, expected[STEPS // 2 :], rtol=1e-5, atol=1e-6)


def test_checkpoint_reshards_between_two_processes_and_one(two_rank_mesh):
    """Model and AdamW state saved by 2 FSDP2 ranks resume in 1 plain process, and the
    reverse; the resumed losses equal the uninterrupted run's (1 -> 2: checked in both ranks by
    the fixture's spawn; 2 -> 1 here)."""
    m = two_rank_mesh
    _resume_second_half(0, 1, m["path"], m["two_to_one"], m["expected"])


def _one_rank_group_worker(rank: int, world: int, path: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from lightrft.models.parallel import default_sharding, parallelize

    assert dist.get_world_size() == 1
    assert default_sharding() is False  # FSDP2 over one rank: copies for nothing
    assert default_sharding(offload=True) and default_sharding(scoring=True)
    plain = load_parallel(path)  # an asynchronous run's lone trainer loads this way
    assert not isinstance(plain, FSDPModule)
    assert not any(type(p).__name__ == "DTensor" for p in plain.parameters())
    assert isinstance(parallelize(load_parallel(path), shard=True), FSDPModule)  # when asked


def test_a_one_rank_group_keeps_plain_tensors(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=1, hidden=16, heads=2, kv_heads=1)
    run_distributed(_one_rank_group_worker, str(path), world_size=1)
