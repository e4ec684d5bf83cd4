"""FSDP2 CPU offload (``offload: params``) through the strategy object, on CPU over gloo.

On a CPU the "offload" is to the same memory, so the figures must equal the run without it
bitwise; what runs is the code path: the ``CPUOffloadPolicy`` on every FSDP2 group, shards
materialised in CPU memory (no pinning without an accelerator), clipping and the optimizer step
on the offloaded shards, a checkpoint saved and resumed into an offloaded model, and the weight
sync into the rollout engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from omegaconf import OmegaConf

from lightrft.distributed import DistInfo
from lightrft.sections import OptimConfig, StrategyConfig


def _strategy(offload: str, rank: int, world: int):
    from lightrft.strategy import build_strategy

    cfg = StrategyConfig.read({"offload": offload})
    return build_strategy(cfg, DistInfo(rank, world, rank, torch.device("cpu")))


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(3, 99, (2, 12), generator=g)  # [B, T]


def _run(model_dir: str, out: Path, offload: str, rank: int, world: int) -> dict:
    """3 clipped AdamW steps, a checkpoint, a 4th step; offloaded, a fresh model resumed from
    the checkpoint then takes the 4th step again and syncs into an engine."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightrft.engine import NativeEngine
    from lightrft.models.sharded import load_parallel
    from lightrft.training.checkpoint import Checkpointer

    def build():
        strategy = _strategy(offload, rank, world)
        model = load_parallel(model_dir, device="cpu", **strategy.loading())
        adamw = {"_component_": "torch.optim.AdamW", "lr": 1e-2}
        optim = OptimConfig.read(OmegaConf.create({"optimizer": adamw, "clip_grad_norm": 0.05}))
        strategy.setup(model, optim, micro_batch_size=2, accum=1)
        return strategy, model

    def step(strategy, model, i: int) -> tuple[float, float]:
        x = _batch(i, rank)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        strategy.backward(loss)
        return float(loss), strategy.step()

    strategy, model = build()
    groups = [
        m._get_fsdp_state()._fsdp_param_group
        for m in model.modules()
        if hasattr(m, "_get_fsdp_state")
    ]
    groups = [g for g in groups if g is not None]
    policies = {isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups}
    # every FSDP2 group offloads, or none does; one rank without offload is left unsharded
    assert policies == ({offload == "params"} if groups else set())
    assert groups or (offload == "none" and world == 1)
    for g in groups:
        if offload == "params":  # in CPU memory, unpinned: pinning needs an accelerator
            assert all(not p._sharded_param_data.is_pinned() for p in g.fsdp_params)
    curve = [step(strategy, model, i) for i in range(3)]
    ckpt = Checkpointer(out / offload)
    ckpt.save(3, **strategy.checkpoint_state())
    curve.append(step(strategy, model, 3))
    weights = {k: getattr(v, "full_tensor", v.detach)() for k, v in model.state_dict().items()}

    if offload == "none":
        return {"curve": curve, "weights": weights}
    strategy2, model2 = build()
    ckpt.load_latest(**strategy2.checkpoint_state(), restore_rng=False, required=True)
    again = step(strategy2, model2, 3)
    assert again == curve[3], (again, curve[3])  # resumed into offloaded shards: bitwise
    engine = NativeEngine(model_dir, dtype=torch.float32, max_model_len=32)
    strategy2.sync_weights(engine)
    synced = dict(engine.model.named_parameters())
    for k in model2.state_dict():
        assert torch.equal(synced[k], weights[k]), k
    return {"curve": curve, "weights": weights}


def _compare(rank: int, world: int, model_dir: str, out: str) -> None:
    torch.manual_seed(0)
    plain = _run(model_dir, Path(out), "none", rank, world)
    off = _run(model_dir, Path(out), "params", rank, world)
    assert off["curve"] == plain["curve"], (off["curve"], plain["curve"])
    assert plain["curve"][0][1] > 0.05  # the clipping is active
    for k, v in plain["weights"].items():
        assert torch.equal(off["weights"][k], v), k


@pytest.mark.slow  # 16 s on 2 cores; the refusals below stay in the default suite
def test_offload_params_equals_no_offload_on_two_gloo_processes(tiny_model_dir, tmp_path):
    run_distributed(_compare, str(tiny_model_dir), str(tmp_path), world_size=2)


@pytest.mark.slow
def test_offload_params_equals_no_offload_in_one_process_group(tiny_model_dir, tmp_path):
    run_distributed(_compare, str(tiny_model_dir), str(tmp_path), world_size=1)


def test_offload_refusals_name_the_key(monkeypatch):
    with pytest.raises(ValueError, match="offload=optimizer is not built: FSDP2 offers no"):
        StrategyConfig.read({"offload": "optimizer"})
    with pytest.raises(ValueError, match=r"offload: unknown value 'gpu'"):
        StrategyConfig.read({"offload": "gpu"})
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match="offload=params applies to strategy=fsdp2 only"):
        StrategyConfig.read({"strategy": "deepspeed", "offload": "params"})


def test_offload_without_a_process_group_is_refused_before_loading():
    with pytest.raises(ValueError, match="offload=params needs FSDP2 sharding, which needs a"):
        _strategy("params", 0, 1)
