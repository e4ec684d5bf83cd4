"""Online DPO (the dpo recipe's ``online:`` section) through the real CLI: each step samples,
scores and pairs; the trained weights reach the engine; the shipped config runs cut down; bad
config is refused by name before any model loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from _dist import build_recipe, run_distributed

from lightrft import cli
from lightrft.training import read_metrics


class DigitReward:
    """Fraction of the response's characters that are digits: a tiny random model's answers
    score apart, so prompts give pairs."""

    def __call__(self, samples):
        return [sum(c.isdigit() for c in s.response) / max(len(s.response), 1) for s in samples]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("online_dpo_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=40, n_test=8, digits=1)
    return root


def _config(tmp: Path, assets: Path, **overrides) -> Path:
    """2 steps of 4 prompts x 4 samples of 4 tokens, DPO on their pairs."""
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(assets / "model")},
        "loss": {"type": "dpo", "beta": 0.5},
        "online": {
            "reward": {
                "_component_": "lightrft.rewards.CombinedReward",
                "functions": {"digits": {"_component_": "test_dpo_online.DigitReward"}},
            },
            "rollout": {"prompts_per_step": 4, "n": 4, "max_tokens": 4},
        },
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(assets / "data" / "train.jsonl"),
        },
        "eval_dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(assets / "data" / "test.jsonl"),
        },
        "batch_size": 2,
        "epochs": 1,
        "max_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
        "log_every": 1,
        "eval_every": 1,
        "metrics": {"tensorboard": False},
    }
    for k, v in overrides.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    path = tmp / "dpo.yaml"
    tmp.mkdir(parents=True, exist_ok=True)
    path.write_text("# lightrft run dpo --config dpo.yaml\n" + yaml.safe_dump(cfg))
    return path


def test_online_dpo_samples_scores_pairs_trains_and_publishes(tmp_path, assets):
    from lightrft import config as lconfig
    from lightrft.engine.sync import iter_weight_buckets

    cfg, _ = lconfig.load(str(_config(tmp_path, assets)))
    recipe = build_recipe("dpo", cfg)
    recipe.setup(cfg)
    start = {n: p.detach().clone() for n, p in recipe.model.named_parameters()}
    recipe.train()
    recipe.logger.close()
    rows = read_metrics(tmp_path / "out")
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # every prompt gave a pair or was counted as giving none
        assert r["online/pairs"] >= 1 and r["online/pairs"] + r["online/no_pair"] == 4
        assert r["online/no_pair_frac"] == r["online/no_pair"] / 4
        assert r["reward/digits/count"] == 16.0  # 4 prompts x 4 samples scored
        assert math.isfinite(r["train/loss"]) and "train/rewards/margins" in r
    assert len([r for r in rows if "eval/accuracy" in r]) == 3  # start, step 1, step 2
    moved = any(not torch.equal(p.detach(), start[n]) for n, p in recipe.model.named_parameters())
    assert moved
    # The trained weights were published: the engine holds them under HF names.
    engine = dict(recipe.pairs.source.parts.engine.engine.model.named_parameters())
    for bucket in iter_weight_buckets(recipe.model):
        for name, t in bucket:
            assert torch.equal(engine[name].data, t.to(engine[name].dtype)), name
    assert (tmp_path / "out" / "final" / "config.json").is_file()


def _two_ranks(rank: int, world_size: int, cfg_path: str) -> None:
    from lightrft import config as lconfig
    from lightrft.engine.sync import iter_weight_buckets

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("dpo", cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.logger.close()
    engine = dict(recipe.pairs.source.parts.engine.engine.model.named_parameters())
    for bucket in iter_weight_buckets(recipe.model):  # collective: every rank gathers
        for name, t in bucket:
            assert torch.equal(engine[name].data, t.to(engine[name].dtype)), name


def test_two_gloo_processes_share_the_pairs_and_publish(tmp_path, assets):
    """FSDP2 over 2 ranks: each draws 2 of the 4 prompts, the samples are gathered, each rank
    trains on every other pair (a rank with none runs a weightless micro-batch), and each
    rank's engine ends with the trained weights."""
    cfg = _config(tmp_path, assets, eval_every=None)
    run_distributed(_two_ranks, str(cfg))
    train = [r for r in read_metrics(tmp_path / "out") if "online/pairs" in r]
    assert len(train) == 2
    assert all(r["online/pairs"] + r["online/no_pair"] == 4 for r in train)
    assert all(math.isfinite(r["train/loss"]) for r in train)


class SameReward:
    def __call__(self, samples):
        return [1.0] * len(samples)


def test_a_step_without_any_pair_makes_no_update(tmp_path, assets):
    """Every answer scores alike: no prompt gives a pair, every step is skipped and counted."""
    from lightrft import config as lconfig

    reward = {"_component_": "test_dpo_online.SameReward"}
    online = {"reward": reward, "rollout": {"prompts_per_step": 4, "n": 4, "max_tokens": 4}}
    cfg, _ = lconfig.load(str(_config(tmp_path, assets, online=online, eval_every=None)))
    recipe = build_recipe("dpo", cfg)
    recipe.setup(cfg)
    start = {n: p.detach().clone() for n, p in recipe.model.named_parameters()}
    recipe.train()
    recipe.logger.close()
    train = [r for r in read_metrics(tmp_path / "out") if "online/pairs" in r]
    assert [(r["online/pairs"], r["online/no_pair"], r["train/skipped"]) for r in train] == [
        (0.0, 4.0, 1.0)
    ] * 2
    assert all(torch.equal(p.detach(), start[n]) for n, p in recipe.model.named_parameters())


def test_shipped_online_config_cut_down_builds_pairs(tmp_path, monkeypatch):
    """tiny/add_dpo_online after a cut-down SFT, with the digit reward in place of ExactMatch
    (a 2-step SFT model is never exactly right, so ExactMatch would give no pair)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    sft = ["max_steps=2", "eval_every=2", "lr_scheduler.warmup_steps=0",
           "metrics.tensorboard=false", "prepare.1.n_train=64", "prepare.1.n_test=8"]  # fmt: skip
    assert cli.main(["run", "sft", "--config", "tiny/add_sft", *sft]) == 0
    over = ["max_steps=2", "eval_every=2", "log_every=1", "online.rollout.prompts_per_step=4",
            "online.rollout.n=4", "lr_scheduler.warmup_steps=0", "metrics.tensorboard=false",
            "online.reward.functions.accuracy._component_=test_dpo_online.DigitReward"]  # fmt: skip
    assert cli.main(["run", "dpo", "--config", "tiny/add_dpo_online", *over]) == 0
    path = tmp_path / "outputs/tiny/add_dpo_online/metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    train = [r for r in rows if "online/pairs" in r]
    assert len(train) == 2 and sum(r["online/pairs"] for r in train) > 0
    assert len([r for r in rows if "eval/accuracy" in r]) == 2  # start, end


def test_bad_online_config_is_refused_by_name_before_models_load(tmp_path, assets, capsys):
    def refused(match: str, **over) -> None:
        cfg = _config(tmp_path / "bad", assets, **over)
        assert cli.main(["run", "dpo", "--config", str(cfg)]) == 2
        assert match in capsys.readouterr().err

    rollout = {"prompts_per_step": 4, "n": 1, "max_tokens": 4}
    reward = {"_component_": "test_dpo_online.DigitReward"}
    refused("online.rollout.n=1: online DPO pairs the best", online={"reward": reward,
            "rollout": rollout})  # fmt: skip
    refused("reference.precompute: online DPO samples its pairs each step",
            reference={"precompute": True})  # fmt: skip
    refused("gradient_accumulation_steps: an online DPO step", gradient_accumulation_steps=2)
    refused("reference: loss.type=simpo uses no reference", loss={"type": "simpo"},
            reference={"path": None})  # fmt: skip
    refused("dataset: online DPO samples its own answers to prompts",
            dataset={"_component_": "lightrft.data.PreferenceDataset"})  # fmt: skip
    refused("loss.beta must be > 0", loss={"beta": 0.0})
    # The rollout section's own rules name it where it sits: under online.
    for over, key in (
        ({"asynchronous": True}, "online.rollout.asynchronous=true generates"),
        ({"partial": {"token_budget": 3}}, "online.rollout.partial.token_budget=3"),
    ):
        refused(key, online={"reward": reward, "rollout": {**rollout, "n": 4, **over}})
    assert not (tmp_path / "bad" / "out" / "checkpoints").exists()
