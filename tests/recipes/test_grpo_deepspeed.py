"""The GRPO recipe with a DeepSpeed ZeRO-3 actor (strategy=deepspeed), 2 gloo processes."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _dist import build_recipe, run_distributed
from test_grpo import _config, _train_rows, assets  # noqa: F401 (a fixture)

from lightrft.training import read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'lightrft[deepspeed]')",
)


def _two_rank_grpo(rank: int, world_size: int, cfg_path: str) -> None:

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("grpo", cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.logger.close()
    if cfg.get("strategy") == "deepspeed":
        # The rollout engine holds exactly the trained weights, gathered from the ZeRO-3 shards.
        from lightrft.models.deepspeed import gathered_modules
        from lightrft.models.names import hf_name

        for params in gathered_modules(recipe.strategy.engine):
            for name, tensor in params:
                assert torch.equal(
                    recipe.source.parts.engine.engine._params[hf_name(name)], tensor
                ), name
    torch.distributed.barrier()  # both ranks leave together (gloo teardown under load)


@pytest.mark.deepspeed
def test_zero3_actor_follows_fsdp2_syncs_checkpoints_and_exports(tmp_path, assets):  # noqa: F811
    """A ZeRO-3 actor beside an FSDP2 reference (KL in the loss) and an FSDP2 GAE critic (one
    backward of the combined loss reaches both trained models), token-budget micro-batches: the
    same rollouts, losses, KL and gradient norms (actor and critic) as an all-FSDP2 run; the
    rollout engine receives the gathered weights; the checkpoint holds the actor as DeepSpeed's
    files and the critic as DCP state; final/ loads."""
    import json

    from transformers import AutoModelForCausalLM

    from lightrft.training.checkpoint import check_readable

    runs = {}
    for name, strategy in (
        ("fsdp2", {}),
        ("zero3", {"strategy": "deepspeed", "deepspeed": {"stage": 3}}),
    ):
        (tmp_path / name).mkdir()
        cfg = _config(
            tmp_path / name,
            assets,
            **{
                "algorithm.kl": {"coef": 0.05},
                "algorithm.advantage.estimator": "gae",
                "critic": {"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}},
                "train": {"micro_batch_size": 4, "micro_batch_tokens": 30, "packing": True},
                "eval": None,
                "save_every": 2,
                **strategy,
            },
        )
        run_distributed(_two_rank_grpo, str(cfg), world_size=2)
        rows = _train_rows(read_metrics(tmp_path / name / "out"))
        keys = ("reward/total/mean", "train/loss", "train/kl", "train/grad_norm")
        runs[name] = [[rows[s][k] for k in (*keys, "critic/grad_norm")] for s in sorted(rows)]
    assert len(runs["zero3"]) == 2
    torch.testing.assert_close(runs["zero3"], runs["fsdp2"], rtol=1e-4, atol=1e-6)
    out = tmp_path / "zero3" / "out"
    step = out / "checkpoints" / "step_000002"
    assert (step / "deepspeed.policy").is_dir()
    check_readable(step)  # DeepSpeed's real files pass the damage check (zip archives)
    meta = json.loads((step / "meta.json").read_text())
    assert meta["deepspeed"] == ["policy"] and sorted(meta["models"]) == ["critic", "policy"]
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_deepspeed_refuses_what_it_does_not_build(tmp_path, assets, capsys):  # noqa: F811
    from lightrft import cli

    cfg = _config(tmp_path, assets, strategy="deepspeed")
    for override, msg in [
        ("lora.rank=4", "lora is not supported with strategy=deepspeed"),
        ("shard_size=1", "shard_size is not supported with strategy=deepspeed"),
    ]:
        assert cli.main(["validate", str(cfg), override]) == 2, override
        assert msg in capsys.readouterr().err, override
