"""The reward-model recipe on DeepSpeed ZeRO-3 (strategy=deepspeed), 2 gloo processes."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from _dist import run_distributed
from test_reward_model import _config, _two_ranks_metrics

from lightrft.rewards import Sample
from lightrft.training import read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'lightrft[deepspeed]')",
)


def _two_ranks_metrics_all_partitioned(rank: int, world_size: int, cfg_path: str) -> None:
    """As ``_two_ranks_metrics``, with ZeRO-3 partitioning every parameter: by default it keeps
    those under 1e5 elements (all of a tiny model's) whole on every rank."""
    from lightrft.models import deepspeed as lds

    plain = lds.ds_config

    def partition_all(*args, **kwargs):
        cfg = plain(*args, **kwargs)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return cfg

    lds.ds_config = partition_all
    _two_ranks_metrics(rank, world_size, cfg_path)


def _fsdp2_and_zero3(tmp_path, score_head=None, *, zero3_worker=_two_ranks_metrics, **overrides):
    """The same run on FSDP2 and on ZeRO-3 (2 gloo ranks): each run's (loss, grad norm) per step
    and its export's scores of two (prompt, response) pairs through RewardModel."""
    from lightrft.rewards import RewardModel

    runs, scores = {}, {}
    model = overrides.pop("model", {})
    for name, strategy in (
        ("fsdp2", {}),
        ("zero3", {"strategy": "deepspeed", "deepspeed": {"stage": 3}}),
    ):
        root = tmp_path / name
        root.mkdir()
        at = {**model, "path": str(root / "model")}
        cfg = _config(root, model=at, eval_every=None, **overrides, **strategy)
        run_distributed(zero3_worker if strategy else _two_ranks_metrics, str(cfg), world_size=2)
        rows = read_metrics(root / "out")
        runs[name] = [(r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]
        rm = RewardModel(str(root / "out" / "final"), score_head=score_head)
        scores[name] = rm(Sample.batch(["apple river?", "sun moon?"], ["river apple no", "a b"]))
    return runs, scores


@pytest.mark.deepspeed
def test_zero3_follows_fsdp2_and_exports_what_reward_model_loads(tmp_path):
    """Two heads, attention pooling, token-budget micro-batches: ZeRO-3 gives FSDP2's losses and
    gradient norms, and its final/ (gathered layer by layer) scores like FSDP2's export."""
    heads = ["helpful", "cost"]
    model = {"heads": heads, "cost_heads": ["cost"], "pooling": "attention"}
    runs, scores = _fsdp2_and_zero3(
        tmp_path, "cost", heads=heads, model=model, micro_batch_tokens=190
    )
    meta = json.loads((tmp_path / "zero3" / "out" / "final" / "config.json").read_text())
    assert meta["lightrft_reward"]["heads"] == heads
    assert len(runs["zero3"]) == 3
    torch.testing.assert_close(runs["zero3"], runs["fsdp2"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores["zero3"], scores["fsdp2"], rtol=1e-4, atol=1e-5)


@pytest.mark.deepspeed
def test_zero3_likelihood_pooling_gathers_the_lm_head_and_follows_fsdp2(tmp_path):
    """The likelihood pooling reads lm_head.weight directly (the fused kernel), not through the
    head's forward: ZeRO-3 (every parameter partitioned) must gather it with the root. Losses,
    gradient norms and the export's scores equal FSDP2's."""
    runs, scores = _fsdp2_and_zero3(
        tmp_path,
        zero3_worker=_two_ranks_metrics_all_partitioned,
        model={"pooling": "likelihood"},
        loss={"nll_coef": 0.5},
        max_steps=2,
    )
    assert len(runs["zero3"]) == 2
    torch.testing.assert_close(runs["zero3"], runs["fsdp2"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores["zero3"], scores["fsdp2"], rtol=1e-4, atol=1e-5)


def test_lora_with_deepspeed_is_refused_before_anything_loads(tmp_path, capsys):
    from lightrft import cli

    cfg = _config(tmp_path, strategy="deepspeed", lora={"rank": 4})
    assert cli.main(["validate", str(cfg)]) == 2
    assert "lora is not supported with strategy=deepspeed" in capsys.readouterr().err
