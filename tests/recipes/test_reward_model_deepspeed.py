"""The reward-model recipe on DeepSpeed ZeRO-3 (strategy=deepspeed), 2 gloo processes."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from _dist import run_distributed
from test_reward_model import _config, _two_ranks_metrics

from lightrft.training import read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'lightrft[deepspeed]')",
)


@pytest.mark.deepspeed
def test_zero3_follows_fsdp2_and_exports_what_reward_model_loads(tmp_path):
    """Two heads, attention pooling, token-budget micro-batches: ZeRO-3 gives FSDP2's losses and
    gradient norms, and its final/ (gathered layer by layer) scores like FSDP2's export."""
    from lightrft.rewards import RewardModel

    runs, scores = {}, {}
    for name, strategy in (
        ("fsdp2", {}),
        ("zero3", {"strategy": "deepspeed", "deepspeed": {"stage": 3}}),
    ):
        root = tmp_path / name
        root.mkdir()
        cfg = _config(
            root,
            heads=["helpful", "cost"],
            model={
                "path": str(root / "model"),
                "heads": ["helpful", "cost"],
                "cost_heads": ["cost"],
                "pooling": "attention",
            },
            micro_batch_tokens=190,
            eval_every=None,
            **strategy,
        )
        run_distributed(_two_ranks_metrics, str(cfg), world_size=2)
        rows = read_metrics(root / "out")
        runs[name] = [(r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]
        final = root / "out" / "final"
        assert json.loads((final / "config.json").read_text())["lightrft_reward"]["heads"] == [
            "helpful",
            "cost",
        ]
        rm = RewardModel(str(final), score_head="cost")
        scores[name] = torch.as_tensor(rm(["apple river?", "sun moon?"], ["river apple no", "a b"]))
    assert len(runs["zero3"]) == 3
    torch.testing.assert_close(runs["zero3"], runs["fsdp2"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores["zero3"], scores["fsdp2"], rtol=1e-4, atol=1e-5)


def test_lora_with_deepspeed_is_refused_before_anything_loads(tmp_path, capsys):
    from lightrft import cli

    cfg = _config(tmp_path, strategy="deepspeed", lora={"rank": 4})
    assert cli.main(["validate", str(cfg)]) == 2
    assert "lora is not supported with strategy=deepspeed" in capsys.readouterr().err


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


@pytest.mark.deepspeed
def test_zero3_likelihood_pooling_gathers_the_lm_head_and_follows_fsdp2(tmp_path):
    """The likelihood pooling reads lm_head.weight directly (the fused kernel), not through the
    head's forward: ZeRO-3 (every parameter partitioned) must gather it with the root. Losses,
    gradient norms and the export's scores equal FSDP2's."""
    from lightrft.rewards import RewardModel

    runs, scores = {}, {}
    for name, strategy in (
        ("fsdp2", {}),
        ("zero3", {"strategy": "deepspeed", "deepspeed": {"stage": 3}}),
    ):
        root = tmp_path / name
        root.mkdir()
        cfg = _config(
            root,
            model={"path": str(root / "model"), "pooling": "likelihood"},
            loss={"nll_coef": 0.5},
            max_steps=2,
            eval_every=None,
            **strategy,
        )
        worker = _two_ranks_metrics_all_partitioned if strategy else _two_ranks_metrics
        run_distributed(worker, str(cfg), world_size=2)
        rows = read_metrics(root / "out")
        runs[name] = [(r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]
        rm = RewardModel(str(root / "out" / "final"))
        scores[name] = rm(["apple river?", "sun moon?"], ["river apple no", "a b"])
    assert len(runs["zero3"]) == 2
    torch.testing.assert_close(runs["zero3"], runs["fsdp2"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores["zero3"], scores["fsdp2"], rtol=1e-4, atol=1e-5)
