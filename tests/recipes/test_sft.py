"""The SFT recipe through the real CLI, in-process: 1 process, 2 gloo processes, resume, export."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _dist import build_recipe, run_distributed

from lightrft import cli
from lightrft.training import read_metrics
from lightrft.training.outputs import release_output_dir


def _config(tmp: Path, **overrides) -> Path:
    """A small SFT config on a 2-layer tiny model and 240 arithmetic problems."""
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "prepare": [
            {
                "_component_": "lightrft.tasks.ensure_tiny_model",
                "out_dir": str(tmp / "model"),
                "layers": 2,
                "hidden": 32,
                "heads": 2,
                "kv_heads": 1,
                "max_positions": 64,
            },
            {
                "_component_": "lightrft.tasks.ensure_arith_dataset",
                "out_dir": str(tmp / "data"),
                "n_train": 240,
                "n_test": 40,
                "digits": 2,
            },
        ],
        "model": {"path": str(tmp / "model")},
        "dataset": {
            "_component_": "lightrft.data.SFTDataset",
            "path": str(tmp / "data" / "train.jsonl"),
            "max_length": 48,
        },
        "eval_dataset": {
            "_component_": "lightrft.data.SFTDataset",
            "path": str(tmp / "data" / "test.jsonl"),
        },
        "packing": True,
        "batch_size": 16,
        "gradient_accumulation_steps": 2,
        "epochs": 1,
        "max_steps": 6,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
        "lr_scheduler": {"warmup_steps": 2},
        "clip_grad_norm": 1.0,
        "log_every": 1,
        "eval_every": 3,
        "metrics": {"tensorboard": True},
    }
    cfg.update(overrides)
    path = tmp / "sft.yaml"
    path.write_text("# lightrft run sft --config sft.yaml\n" + yaml.safe_dump(cfg))
    return path


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(out) if "train/loss" in r}


def test_sft_one_process_learns_logs_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _config(
        tmp_path, max_steps=None, epochs=2, save_every=7
    )  # 240 / (16 * 2) = 7 steps per epoch
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 15))
    assert losses[14] < 0.8 * losses[1], losses
    records = read_metrics(out)
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 1 + 4 + 1 and evals[-1] < evals[0]  # start, every 3 steps, end (14)
    last = [r for r in records if "train/loss" in r][-1]
    for key in ("train/grad_norm", "train/lr", "train/tokens_per_s", "memory/peak_rss_gib"):
        assert key in last
    assert any("data/loss_tokens" in r for r in records)
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))

    # Export round trip: the HF directory loads with AutoModelForCausalLM and gives the logits
    # of the checkpoint the run ended with.
    final = out / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 9, 23, 11, 30]])
    from lightrft.training import Checkpointer

    ckpt_model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    Checkpointer(out).load_latest(models=ckpt_model, required=True)
    assert torch.equal(exported(ids).logits, ckpt_model(ids).logits)


def test_sft_resume_gives_the_uninterrupted_loss_curve(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    cfg = _config(full, save_every=3, keep_last=5, eval_every=None)
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    reference = _losses(full / "out")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    # The state on disk of a run that crashed after its step-3 checkpoint.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(full / "out" / "checkpoints" / "step_000003", ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000003")
    # Same model and data (a changed model.path would be refused by the config check).
    cfg = _config(
        full,
        save_every=3,
        keep_last=5,
        eval_every=None,
        resume=True,
        output_dir=str(crashed / "out"),
    )
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    resumed = _losses(crashed / "out")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == reference[step], step  # bitwise on CPU fp32


def test_sft_resume_at_an_epoch_boundary_starts_the_next_epoch(tmp_path):
    # 240 samples / (16 * 2) = 7 steps per epoch; a checkpoint at step 7 ends epoch 0.
    cfg = _config(tmp_path, max_steps=None, epochs=2, save_every=7, eval_every=None)
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    reference = _losses(tmp_path / "out")
    shutil.rmtree(tmp_path / "out" / "checkpoints" / "step_000014")
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step_000007")
    shutil.rmtree(tmp_path / "out" / "final")
    cfg = _config(tmp_path, max_steps=None, epochs=2, save_every=7, eval_every=None, resume=True)
    (tmp_path / "out" / "metrics.jsonl").rename(tmp_path / "first.jsonl")
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    resumed = _losses(tmp_path / "out")
    assert sorted(resumed) == list(range(8, 15))
    assert all(resumed[s] == reference[s] for s in resumed)


def _two_rank_sft(rank: int, world_size: int, cfg_path: str, hsdp: bool = False) -> None:

    from torch.distributed.tensor import DTensor

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("sft", cfg)
    recipe.setup(cfg)
    params = list(recipe.model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)
    if hsdp:  # replicate_size=2 on 2 ranks: a 2x1 mesh, each rank a whole replica
        assert all(p.device_mesh.mesh_dim_names == ("replicate", "shard") for p in params)
        assert all(p.placements[0].is_replicate() for p in params)
        assert all(p.to_local().shape == p.shape for p in params)
    else:
        assert all(p.placements[0].is_shard() for p in params)
    recipe.train()
    recipe.logger.close()
    if rank == 0:
        losses = _losses(Path(cfg.output_dir))
        assert sorted(losses) == [1, 2, 3, 4, 5, 6]
        assert losses[6] < 0.85 * losses[1], losses


def _two_rank_sft_runs(rank: int, world_size: int, runs: list[tuple[str, bool]]) -> None:
    """:func:`_two_rank_sft` on each ``(config, hsdp)`` in turn, in one process group: the
    2-rank runs below share one start-up of the two processes (imports are most of a run)."""
    for cfg_path, hsdp in runs:
        _two_rank_sft(rank, world_size, cfg_path, hsdp)


@pytest.fixture(scope="module")
def two_rank_sft(tmp_path_factory) -> dict[str, Path]:
    """name -> the directory of a finished 2-rank run: plain FSDP (``fsdp``), a 2-D HSDP mesh
    (``hsdp``), rows-only micro-batches without packing (``rows``) and the same with a token
    budget (``budget``); each ran :func:`_two_rank_sft`'s checks in both ranks."""
    root = tmp_path_factory.mktemp("two_rank_sft")
    configs = {
        "fsdp": {"gradient_accumulation_steps": 1, "batch_size": 8, "clip_grad_norm": 1.0},
        "hsdp": {
            "gradient_accumulation_steps": 1,
            "batch_size": 8,
            "clip_grad_norm": 1.0,
            "replicate_size": 2,
        },
        "rows": {"packing": False, "batch_size": 8},
        "budget": {"packing": False, "batch_size": 8, "micro_batch_tokens": 84},
    }
    runs = []
    for name, over in configs.items():
        (root / name).mkdir()
        runs.append((str(_config(root / name, eval_every=None, **over)), name == "hsdp"))
    run_distributed(_two_rank_sft_runs, runs, world_size=2)
    return {name: root / name for name in configs}


def _curve(run_dir: Path) -> list[tuple[float, float]]:
    rows = read_metrics(run_dir / "out")
    return [(r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]


def test_sft_two_gloo_processes_shard_and_learn(two_rank_sft):
    # _two_rank_sft checked the sharded parameters and the falling loss in both ranks.
    assert (two_rank_sft["fsdp"] / "out" / "final" / "model.safetensors").is_file()


def test_sft_token_budget_micro_batches_give_the_rows_only_curve(two_rank_sft):
    """micro_batch_tokens cuts each step's samples (shortest first) by a token budget instead
    of a row count: on 2 ranks whose micro-batch counts then differ, the losses and gradient
    norms equal the rows-only run's (same samples per step, same token-mean normalisation)."""
    budget, rows = _curve(two_rank_sft["budget"]), _curve(two_rank_sft["rows"])
    assert len(budget) == 6
    torch.testing.assert_close(budget, rows, rtol=1e-5, atol=1e-6)


def test_sft_hsdp_mesh_from_config(two_rank_sft):
    """replicate_size=2: the recipe trains on a 2-D (replicate x shard) mesh, and its losses and
    clipped gradient norms equal plain FSDP's on the same 2 ranks."""
    hsdp, fsdp = _curve(two_rank_sft["hsdp"]), _curve(two_rank_sft["fsdp"])
    assert len(hsdp) == 6
    torch.testing.assert_close(hsdp, fsdp, rtol=1e-5, atol=1e-6)


def test_sft_bad_inputs_fail_before_training(tmp_path, capsys):
    cfg = _config(tmp_path)
    # A misspelled key names itself and the closest valid key.
    assert cli.main(["run", "sft", "--config", str(cfg), "optimizer.lr=abc"]) == 2
    assert "optimizer.lr" in capsys.readouterr().err
    assert cli.main(["run", "sft", "--config", str(cfg), "batch_sise=4"]) == 2
    err = capsys.readouterr().err
    assert "batch_sise" in err and "batch_size" in err
    # resume=true with nothing to resume from, and the other options rules: `validate` and
    # `run` refuse them with the same message (build_options), before any side effect.
    for override, msg in [
        ("resume=true", "resume=true but no checkpoint"),
        ("packing=false max_tokens_per_row=64", "max_tokens_per_row applies only with packing"),
        ("log_every=0", "log_every must be >= 1"),
        ("gradient_accumulation_steps=0", "gradient_accumulation_steps must be >= 1"),
        ("lr_scheduler.min_lr_ratio=1.5", "min_lr_ratio must be in [0, 1]"),
        ("max_steps=3 lr_scheduler.warmup_steps=4", "warmup_steps=4 is more than max_steps=3"),
        ("strategy=zero3", "strategy: unknown strategy 'zero3'; choose one of"),
        ("shard_size=0", "shard_size must be >= 1, got 0"),
        ("replicate_size=two", "replicate_size"),
        ("lora.alpha=4", "lora.rank: set the adapter rank"),
        # Component arguments the component itself would refuse only once it is built.
        ("dataset.max_length=-5", "dataset.max_length must be >= 2, got -5"),
        ("eval_dataset.max_length=1", "eval_dataset.max_length must be >= 2, got 1"),
        ("optimizer.lr=-1e-3", "optimizer.lr must be >= 0, got -0.001"),
        ("optimizer.eps=-1e-8", "optimizer.eps must be >= 0"),
        ("model.path=/etc", "model.path='/etc' is not a model directory"),
        (f"model.path={tmp_path}/modle", f"model.path='{tmp_path}/modle' does not exist"),
    ]:
        assert cli.main(["validate", str(cfg), *override.split()]) == 2
        err = capsys.readouterr().err
        assert msg in err, err
        assert cli.main(["run", "sft", "--config", str(cfg), *override.split()]) == 2
        assert capsys.readouterr().err == err
        assert "Traceback" not in err
    if importlib.util.find_spec("deepspeed") is None:  # else tests/recipes/test_sft_deepspeed.py
        assert cli.main(["validate", str(cfg), "strategy=deepspeed"]) == 2
        assert "strategy=deepspeed needs the DeepSpeed extra" in capsys.readouterr().err
    # A missing data file names the path.
    cfg2 = _config(
        tmp_path,
        prepare=[
            {
                "_component_": "lightrft.tasks.ensure_tiny_model",
                "out_dir": str(tmp_path / "model"),
                "layers": 1,
                "hidden": 16,
                "heads": 2,
                "kv_heads": 1,
            }
        ],
    )
    capsys.readouterr()
    assert cli.main(["run", "sft", "--config", str(cfg2)]) == 2  # a user error: one clean line
    err = capsys.readouterr().err
    assert "train.jsonl" in err and "Traceback" not in err, err
    # A chat-template variable the model's template never reads (the tiny ChatML has no
    # thinking mode) is refused naming the key, once `prepare` made the model and before the
    # weights load.
    assert cli.main(["run", "sft", "--config", str(cfg), "model.chat_template_args.x=1"]) == 2
    err = capsys.readouterr().err
    assert "model.chat_template_args.x: the chat template of" in err and "Traceback" not in err


def test_cli_ls_cp_validate_and_run_a_copied_recipe(tmp_path, capsys):
    assert cli.main(["ls"]) == 0
    listing = capsys.readouterr().out
    assert "sft" in listing and "tiny/arith_sft" in listing
    assert cli.main(["validate", "tiny/arith_sft"]) == 0
    assert cli.main(["validate", "tiny/arith_sft", "optimizer.lr=abc"]) != 0
    capsys.readouterr()

    copy = tmp_path / "my_sft.py"
    assert cli.main(["cp", "sft", str(copy)]) == 0
    # The user's edit: a marker metric logged at the end.
    export = '        self.strategy.export(self.processor, self.run.output_dir / "final")'
    src = copy.read_text().replace(
        export, '        self.logger.log(self.step, {"custom/edited": 1.0})\n' + export
    )
    assert "custom/edited" in src
    copy.write_text(src)
    cfg = _config(tmp_path, max_steps=2, eval_every=None)
    assert cli.main(["run", str(copy), "--config", str(cfg)]) == 0
    assert any(r.get("custom/edited") == 1.0 for r in read_metrics(tmp_path / "out"))

    conf_copy = tmp_path / "mine.yaml"
    assert cli.main(["cp", "tiny/arith_sft", str(conf_copy)]) == 0
    assert conf_copy.read_text().startswith("# lightrft run sft")
    json.dumps(yaml.safe_load(conf_copy.read_text()))  # plain YAML


GSM8K = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.mark.skipif(not GSM8K.is_file(), reason=f"GSM8K not at {GSM8K}")
def test_sft_on_gsm8k_counts_truncation(tmp_path):
    dataset = {
        "_component_": "lightrft.data.SFTDataset",
        "path": str(GSM8K),
        "prompt_field": "question",
        "completion_field": "answer",
        "max_length": 400,
        "truncation": "drop",
    }
    cfg = _config(
        tmp_path,
        dataset=dataset,
        eval_dataset=None,
        max_steps=2,
        batch_size=2,
        gradient_accumulation_steps=1,
        lr_scheduler={"warmup_steps": 0},
    )
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    stats = next(r for r in read_metrics(tmp_path / "out") if "data/records" in r)
    assert stats["data/records"] == 7473
    assert 0 < stats["data/dropped"] < 7473  # long solutions dropped and counted
    assert stats["data/samples"] == 7473 - stats["data/dropped"]
    assert sorted(_losses(tmp_path / "out")) == [1, 2]


@pytest.mark.slow
def test_sft_with_torchao_adamw8bit(tmp_path):
    cfg = _config(
        tmp_path,
        eval_every=None,
        max_steps=3,
        optimizer={"_component_": "torchao.optim.AdamW8bit", "lr": 1e-2},
    )
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    losses = _losses(tmp_path / "out")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]


@pytest.mark.slow  # test_run_contract.py covers SIGTERM, overwrite and changed config for every recipe
def test_sft_sigterm_saves_and_a_fresh_run_needs_overwrite(tmp_path, capsys):
    """A real SIGTERM to a real `lightrft run sft`: the step in flight finishes, a checkpoint of
    it is written, the run exits 143 and says where; then a fresh run into that directory is
    refused, a resume with a changed learning rate is refused and `resume=true` goes on from the
    saved step (issue 16 items 4, 6, 7). The follow-up runs are in-process (the same CLI entry,
    ``lightrft.cli.main``): only the signal needs a process of its own."""
    import signal
    import subprocess
    import sys
    import time

    cfg = _config(tmp_path, max_steps=400, epochs=50, log_every=1, eval_every=None)
    cmd = [sys.executable, "-m", "lightrft.cli", "run", "sft", "--config", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and '"train/loss"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=240)[0].decode()
    assert proc.returncode == 143, out
    assert "Traceback" not in out, out
    steps = sorted(_losses(tmp_path / "out"))
    latest = (tmp_path / "out" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps[-1]:06d}", (latest, steps)  # the step in flight was saved
    assert "stopped by SIGTERM: checkpoint saved in" in out, out

    def run(*extra: str) -> tuple[int, str]:
        capsys.readouterr()
        try:
            rc = cli.main(["run", "sft", "--config", str(cfg), *extra])
        finally:  # in-process the lock would last until this process exits
            release_output_dir(tmp_path / "out")
        captured = capsys.readouterr()
        return rc, captured.out + captured.err

    rc, fresh = run()
    assert rc != 0 and "overwrite=true" in fresh, fresh
    rc, changed = run("resume=true", "optimizer.lr=0.5")
    assert rc != 0 and "optimizer.lr" in changed, changed
    # A shorter max_steps reshapes the decaying schedule: allowed with the explicit opt-in.
    rc, resumed = run("resume=true", "max_steps=" + str(steps[-1] + 1), "resume_override_lr=true")
    assert rc == 0, resumed
    assert f"resumed from step {steps[-1]}" in resumed, resumed
    assert max(_losses(tmp_path / "out")) == steps[-1] + 1


def _sft_data(root: Path, split: str) -> dict:
    return {
        "_component_": "lightrft.data.SFTDataset",
        "path": str(root / "data" / f"{split}.jsonl"),
    }


LORA = {"rank": 4, "alpha": 8, "target_modules": "auto", "export_merged": True}


def test_sft_lora_resumes_bitwise_exports_adapter_and_merged(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full = tmp_path / "full"
    full.mkdir()
    cfg = _config(full, save_every=3, keep_last=5, eval_every=None, lora=LORA)
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    reference = _losses(full / "out")
    assert reference[6] < reference[1], reference
    step3 = full / "out" / "checkpoints" / "step_000003"
    assert json.loads((step3 / "meta.json").read_text())["lora"] == ["model"]

    crashed = tmp_path / "crashed"
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(step3, ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000003")
    # The resumed run reads the same model and data (a changed path would be refused on resume).
    same = {"model": {"path": str(full / "model")}, "prepare": []}
    same["dataset"] = {**_sft_data(full, "train"), "max_length": 48}
    same["eval_dataset"] = _sft_data(full, "test")
    # A LoRA checkpoint cannot resume a full fine-tune: refused before anything loads.
    bad = _config(crashed, save_every=3, keep_last=5, eval_every=None, resume=True, **same)
    assert cli.main(["validate", str(bad)]) == 2
    assert "holds LoRA adapters of model 'model' but this run is a full" in capsys.readouterr().err
    cfg = _config(
        crashed, save_every=3, keep_last=5, eval_every=None, resume=True, lora=LORA, **same
    )
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    resumed = _losses(crashed / "out")
    assert all(resumed[s] == reference[s] for s in (4, 5, 6)), (resumed, reference)

    # Export: the adapter directory and the merged model give the same logits.
    ids = torch.tensor([[5, 17, 9, 23, 11, 30]])
    final = crashed / "out" / "final"
    assert (final / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(full / "model", dtype=torch.float32)
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, final).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(crashed / "out" / "final_merged")(ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)

    # The reverse: a full fine-tune's checkpoint cannot resume with LoRA.
    latest = ckpts / (ckpts / "latest").read_text().strip()
    meta = json.loads((latest / "meta.json").read_text())
    (latest / "meta.json").write_text(json.dumps({**meta, "lora": []}))
    assert cli.main(["validate", str(cfg)]) == 2
    assert "holds a full fine-tune of model 'model' but this run trains LoRA" in (
        capsys.readouterr().err
    )
    # A LoRA target that matches nothing is refused once the model is built, before training.
    bad = _config(tmp_path / "full", overwrite=True, lora={"rank": 4, "target_modules": ["qkv"]})
    with pytest.raises(ValueError, match="lora.target_modules: 'qkv' matches no linear layer"):
        cli.main(["run", "sft", "--config", str(bad)])


def _tool_transcript(a: int, b: int) -> dict:
    """A calculator transcript: the call, the tool's result, the answer."""
    call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
    return {
        "messages": [
            {"role": "user", "content": f"{a} * {b}?"},
            {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ],
        "tools": ["calculator"],
    }


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """A tiny model whose chat template has Qwen2.5's tool support."""
    from transformers import AutoTokenizer

    from lightrft.tasks import make_tiny_model
    from lightrft.tasks.tiny import TOOL_CHAT_TEMPLATE

    path = tmp_path_factory.mktemp("tool_sft") / "model"
    make_tiny_model(path, layers=2, hidden=32, heads=2, kv_heads=1, max_positions=1152)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def _tool_config(tmp: Path, model: Path, records: list[dict]) -> Path:
    data = tmp / "transcripts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = {"_component_": "lightrft.environments.ToolSFTDataset", "path": str(data)}
    return _config(
        tmp,
        prepare=[],
        model={"path": str(model)},
        dataset=dataset,
        eval_dataset=None,
        batch_size=2,
        gradient_accumulation_steps=1,
        epochs=2,
        max_steps=4,
        eval_every=None,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-2},
        lr_scheduler={"warmup_steps": 0},
    )


def test_sft_on_tool_transcripts_learns_the_assistant_turns(tmp_path, tool_model):
    """Tool-use transcripts through the real CLI (``ToolSFTDataset``: the rollout's rendering,
    loss on the assistant turns only): the loss falls."""
    records = [_tool_transcript(a, b) for a, b in zip(range(11, 15), range(37, 41), strict=True)]
    cfg = _tool_config(tmp_path, tool_model, records)
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    losses = _losses(tmp_path / "out")
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < 0.9 * losses[1], losses
    stats = next(r for r in read_metrics(tmp_path / "out") if "data/records" in r)
    assert stats["data/samples"] == 4 and 0 < stats["data/loss_tokens"] < stats["data/tokens"]


def test_sft_refuses_a_bad_transcript_before_the_model_loads(
    tmp_path, tool_model, capsys, monkeypatch
):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr("lightrft.models.sharded.load_parallel", no_model)
    bad = _tool_transcript(2, 3)
    bad["messages"] = bad["messages"][:3]  # ends with the tool's result
    cfg = _tool_config(tmp_path, tool_model, [_tool_transcript(1, 2), bad])
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "transcripts.jsonl line 2: the last message (messages[2], role 'tool')" in err, err
    assert "Traceback" not in err
