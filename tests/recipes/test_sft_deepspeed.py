"""The SFT recipe on DeepSpeed ZeRO (strategy=deepspeed), 2 gloo processes.

Skipped where DeepSpeed is not installed (it is an optional extra); CPU images that ship it run
these in the default suite (about a minute on 2 cores).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _dist import build_recipe, run_distributed
from test_sft import _config, _losses

from lightrft import cli
from lightrft.training import read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'lightrft[deepspeed]')",
)

_IDS = torch.arange(1, 17).view(1, -1)
_ZERO3_OFFLOAD = {"stage": 3, "offload_optimizer": True, "offload_param": True}


def _two_rank_sft(rank: int, world_size: int, cfg_path: str) -> None:

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("sft", cfg)
    recipe.setup(cfg)
    if cfg.get("strategy") == "deepspeed":
        assert type(recipe.strategy.engine).__name__ == "DeepSpeedEngine"
    recipe.train()
    recipe.logger.close()
    with torch.no_grad():  # collective under ZeRO-3: every rank runs the forward
        logits = recipe.model(_IDS).logits
    if rank == 0:
        torch.save(logits, Path(cfg.output_dir) / "trained_logits.pt")
    torch.distributed.barrier()  # both ranks leave together (gloo teardown under load)


def _curve(out: Path) -> list[tuple[float, float, float]]:
    rows = read_metrics(out)
    return [
        (r["train/loss"], r["train/grad_norm"], r["train/lr"]) for r in rows if "train/loss" in r
    ]


@pytest.mark.deepspeed
def test_sft_zero2_and_zero3_follow_fsdp2_and_export(tmp_path):
    """ZeRO-2 (with activation checkpointing) and ZeRO-3 (optimizer and parameters offloaded)
    on 2 gloo ranks train the same steps as FSDP2: the same losses, gradient norms (clipped at
    1.0 by DeepSpeed) and LRs (our schedule on the wrapped optimizer), with token-budget
    micro-batches whose count differs across ranks and steps (DeepSpeed's unmanaged
    accumulation). final/ loads in transformers with the trained model's logits."""
    from transformers import AutoModelForCausalLM

    runs = {}
    for name, strategy in (
        ("fsdp2", {}),
        # ZeRO-2 with activation checkpointing (per block, from parallelize, as under FSDP2).
        ("zero2", {"strategy": "deepspeed", "deepspeed": {"stage": 2}, "checkpointing": True}),
        # ZeRO-3 with the optimizer (states and step) and the parameters offloaded to the CPU.
        ("zero3", {"strategy": "deepspeed", "deepspeed": _ZERO3_OFFLOAD}),
    ):
        (tmp_path / name).mkdir()
        model = {"path": str(tmp_path / name / "model")}
        if strategy.pop("checkpointing", False):
            model["activation_checkpointing"] = True
        cfg = _config(
            tmp_path / name,
            model=model,
            packing=False,
            batch_size=8,
            micro_batch_tokens=84,
            eval_every=None,
            **strategy,
        )
        run_distributed(_two_rank_sft, str(cfg), world_size=2)
        runs[name] = _curve(tmp_path / name / "out")
    assert len(runs["fsdp2"]) == 6 and runs["fsdp2"][-1][0] < 0.85 * runs["fsdp2"][0][0]
    for name in ("zero2", "zero3"):
        torch.testing.assert_close(runs[name], runs["fsdp2"], rtol=1e-4, atol=1e-5)
        out = tmp_path / name / "out"
        exported = AutoModelForCausalLM.from_pretrained(out / "final")
        initial = AutoModelForCausalLM.from_pretrained(tmp_path / name / "model")
        with torch.no_grad():
            got, before = exported(_IDS).logits, initial(_IDS).logits
        torch.testing.assert_close(got, torch.load(out / "trained_logits.pt"), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, before)  # the export holds the trained weights


@pytest.mark.deepspeed
def test_sft_zero3_resume_gives_the_uninterrupted_curve(tmp_path):
    """A ZeRO-3 run resumed from its step-3 checkpoint (DeepSpeed's partitioned model and
    optimizer files inside our atomic step directory) continues with the uninterrupted losses."""
    ds = {"strategy": "deepspeed", "deepspeed": {"stage": 3}}
    full = tmp_path / "full"
    full.mkdir()
    cfg = _config(full, save_every=3, keep_last=5, eval_every=None, batch_size=8, **ds)
    run_distributed(_two_rank_sft, str(cfg), world_size=2)
    reference = _losses(full / "out")
    step3 = full / "out" / "checkpoints" / "step_000003"
    assert (step3 / "deepspeed.model").is_dir()

    crashed = tmp_path / "crashed" / "out" / "checkpoints"
    crashed.mkdir(parents=True)
    shutil.copytree(step3, crashed / "step_000003")
    (crashed / "latest").write_text("step_000003")
    cfg = _config(
        full,
        save_every=3,
        keep_last=5,
        eval_every=None,
        batch_size=8,
        resume=True,
        output_dir=str(crashed.parent),
        **ds,
    )
    run_distributed(_two_rank_sft, str(cfg), world_size=2)
    resumed = _losses(crashed.parent)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step

    # The same checkpoint under FSDP2 is refused with the reason, before training.
    cfg = _config(full, eval_every=None, batch_size=8, resume=True, output_dir=str(crashed.parent))
    with pytest.raises(Exception, match="as a DeepSpeed engine's files.*strategy=deepspeed"):
        run_distributed(_two_rank_sft, str(cfg), world_size=2)


def test_deepspeed_options_are_checked_before_anything_loads(tmp_path, capsys):
    cfg = _config(tmp_path, strategy="deepspeed")
    for override, msg in [
        ("deepspeed.stage=4", "deepspeed.stage must be 1, 2 or 3"),
        ("deepspeed.offload_param=true", "offload_param=true needs deepspeed.stage=3"),
        ("deepspeed.config.gradient_clipping=2.0", "deepspeed.config.gradient_clipping conflicts"),
        ("lora.rank=4", "lora is not supported with strategy=deepspeed"),
    ]:
        assert cli.main(["validate", str(cfg), *override.split()]) == 2, override
        assert msg in capsys.readouterr().err, override
    fsdp = _config(tmp_path, deepspeed={"stage": 2})
    assert cli.main(["validate", str(fsdp)]) == 2
    assert "a deepspeed: section is set but strategy=fsdp2" in capsys.readouterr().err


def test_fsdp2_recipes_do_not_import_deepspeed(tmp_path):
    """Nothing imports DeepSpeed unless strategy=deepspeed is chosen."""
    import subprocess

    probe = (
        "import runpy, sys; from lightrft.cli import recipes_dir\n"
        "for r in ('sft', 'reward_model', 'grpo'): runpy.run_path(str(recipes_dir() / f'{r}.py'))\n"
        "print('deepspeed' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
