"""`lightrft export`: a mid-run checkpoint becomes, on one process, exactly the directory the
run's final/ is when the run stops at that step (every safetensors tensor torch.equal, every
other file byte for byte); eval and RewardModel take a checkpoint directly; bad input is
refused naming the path and key."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _dist import run_distributed
from _exports import assert_same_export
from test_grpo import _config as _grpo_config
from test_reward_model import _config as _rm_config
from test_sft import _config as _sft_config

from lightrft import cli
from lightrft.rewards import Sample


def _export(ckpt: Path, out: Path) -> Path:
    assert cli.main(["export", str(ckpt), "--out", str(out)]) == 0
    return out


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:06d}"


# ------------------------------------------------------------------ FSDP2, one process


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """A 1-process SFT run stopped at step 2, its last checkpoint at step 2 (activation
    checkpointing on: the wrapper's names are not the model's)."""
    root = tmp_path_factory.mktemp("export_sft")
    cfg = _sft_config(
        root,
        model={"path": str(root / "model"), "activation_checkpointing": True},
        max_steps=2,
        save_every=2,
        eval_every=None,
        eval_dataset=None,
        metrics={},
    )
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    return root


def test_export_of_an_fsdp2_checkpoint_equals_final_bitwise(sft_run, tmp_path, capsys):
    out = sft_run / "out"
    meta = json.loads((_step(out, 2) / "meta.json").read_text())
    assert meta["format"] == 2
    assert meta["export"]["kind"] == "causal_lm" and meta["export"]["strategy"] == "fsdp2"
    got = _export(_step(out, 2), tmp_path / "exported")
    assert f"exported {_step(out, 2)} to {got}" in capsys.readouterr().out
    assert_same_export(got, out / "final")


def test_bad_inputs_are_refused_naming_path_and_key(sft_run, tmp_path, capsys):
    from lightrft.export import export_checkpoint

    out = sft_run / "out"

    def refused(path: Path, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            export_checkpoint(path, tmp_path / "x")
        assert cli.main(["export", str(path), "--out", str(tmp_path / "x")]) == 2
        assert match.replace("\\", "") in capsys.readouterr().err
        assert not (tmp_path / "x").exists()

    refused(tmp_path / "nope", "is not a directory")
    taken = tmp_path / "taken"
    (taken / "x").mkdir(parents=True)
    with pytest.raises(ValueError, match="taken exists and is not empty; give a new directory"):
        export_checkpoint(_step(out, 2), taken)
    refused(out, "it has no meta.json; it is a run's output_dir")
    refused(out / "final", "it has no meta.json; it is already a model directory")

    def copy(name: str, edit=None) -> Path:
        dst = tmp_path / name / "step_000002"
        shutil.copytree(_step(out, 2), dst)
        if edit is not None:
            meta = json.loads((dst / "meta.json").read_text())
            edit(meta)
            (dst / "meta.json").write_text(json.dumps(meta))
        return dst

    # A checkpoint of an older version, without the export record.
    old = copy("old", lambda m: (m.pop("export"), m.pop("format")))
    refused(old, r"meta.json has no 'export' key \(format 1")
    # A newer format, an unknown kind or strategy, a missing key.
    refused(copy("newer", lambda m: m.update(format=9)), "'format' is 9, written by a newer")
    refused(
        copy("kind", lambda m: m["export"].update(kind="critic")),
        "'export.kind' is 'critic'; this version exports",
    )
    refused(
        copy("strategy", lambda m: m["export"].update(strategy="megatron")),
        "'export.strategy' is 'megatron'",
    )
    refused(copy("key", lambda m: m["export"].pop("path")), "'export' lacks the key 'path'")
    refused(
        copy("ds", lambda m: m["export"].update(strategy="deepspeed")),
        "'export.strategy' is 'deepspeed' but model 'model' is stored as DCP state",
    )
    refused(
        copy("base", lambda m: m["export"].update(path=str(tmp_path / "gone"))),
        "'export.path' names the base model",
    )
    # Missing files: a rank's state, the DCP shards.
    no_rank = copy("rank")
    (no_rank / "rank_00000.safetensors").unlink()
    refused(no_rank, "rank_00000")
    no_shard = copy("shard")
    (no_shard / "__0_0.distcp").unlink()
    refused(no_shard, r"__0_0.distcp is damaged \(truncated: missing\)")
    # eval's config check reads the export record before anything loads.
    cfg = {
        "output_dir": str(tmp_path / "eval"),
        "model": {"path": str(old)},
        "dataset": {"_component_": "lightrft.data.PromptDataset", "path": "p.jsonl"},
        "reward": {"_component_": "lightrft.rewards.GSM8KVerifier"},
    }
    path = tmp_path / "eval.yaml"
    path.write_text("# lightrft run eval --config eval.yaml\n" + yaml.safe_dump(cfg))
    capsys.readouterr()
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.path: " in err and "meta.json has no 'export' key" in err, err
    # A training recipe's model.path refuses a checkpoint with the command that exports it.
    from lightrft.sections import check_model_path

    with pytest.raises(ValueError, match="is a training checkpoint, not a model directory: export"):
        check_model_path(str(_step(out, 2)))


def _planted_remote_code(sft_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the step-2 checkpoint whose meta.json says ``trust_remote_code: true`` and
    names a base directory whose config.json maps AutoConfig to a module that, once imported,
    creates a marker file. Returns the checkpoint and the marker."""
    base = tmp_path / "base"
    shutil.copytree(sft_run / "model", base)
    marker = tmp_path / "code_ran"
    (base / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    config = json.loads((base / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}
    (base / "config.json").write_text(json.dumps(config))
    ckpt = tmp_path / "planted" / "step_000002"
    shutil.copytree(_step(sft_run / "out", 2), ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["export"].update(trust_remote_code=True, path=str(base))
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt, marker


def test_a_checkpoint_cannot_grant_itself_trust_remote_code(sft_run, tmp_path, capsys, monkeypatch):
    """Before: export ran the base directory's auto_map code because meta.json said so."""
    from lightrft.export import resolve_model_dir

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setenv("LIGHTRFT_EXPORT_CACHE", str(tmp_path / "cache"))
    ckpt, marker = _planted_remote_code(sft_run, tmp_path)
    assert cli.main(["export", str(ckpt), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "trust_remote_code=true, and a checkpoint cannot grant that itself" in err, err
    assert "--trust-remote-code" in err and str(tmp_path / "base") in err
    with pytest.raises(ValueError, match="a checkpoint cannot grant that itself"):
        resolve_model_dir(ckpt)  # eval's model.path, RewardModel
    assert not marker.exists() and not (tmp_path / "x").exists()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_export_out_touches_only_what_it_creates(sft_run, tmp_path):
    """Before: an existing X.tmp/ was deleted, X.old/ too when X was empty, and an X.tmp that
    is a file or a symlink ended in a raw NotADirectoryError."""
    ckpt = _step(sft_run / "out", 2)
    theirs = {}
    for name in ("x.tmp", "x.old", "x_merged.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(name)
        theirs[name] = "dir"
    (tmp_path / "x").mkdir()  # an empty --out is taken
    _export(ckpt, tmp_path / "x")
    assert_same_export(tmp_path / "x", sft_run / "out" / "final")
    for name in theirs:
        assert (tmp_path / name / "keep.txt").read_text() == name
    # A file and a symlink where the old code put its temporary directory.
    (tmp_path / "y.tmp").write_text("a file of theirs")
    (tmp_path / "z.tmp").symlink_to(tmp_path / "x.tmp")
    _export(ckpt, tmp_path / "y")
    _export(ckpt, tmp_path / "z")
    assert (tmp_path / "y.tmp").read_text() == "a file of theirs"
    assert (tmp_path / "z.tmp").is_symlink() and (tmp_path / "x.tmp" / "keep.txt").exists()
    # Nothing of the command's own is left beside the outputs, and the output is readable.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["x", "x.tmp", "x.old", "x_merged.tmp", "y", "y.tmp", "z", "z.tmp"]
    )
    assert (tmp_path / "y").stat().st_mode & 0o777 == 0o755


def test_export_out_under_a_file_is_one_line(sft_run, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert (
        cli.main(["export", str(_step(sft_run / "out", 2)), "--out", str(tmp_path / "file" / "x")])
        == 2
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"--out: {tmp_path / 'file'} is a file, not a dir" in err, err


def test_eval_takes_a_checkpoint_and_evaluates_its_export(sft_run, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTRFT_EXPORT_CACHE", str(tmp_path / "cache"))
    out = sft_run / "out"
    cfg = {
        "output_dir": str(tmp_path / "eval"),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(_step(out, 2))},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(sft_run / "data" / "test.jsonl"),
        },
        "reward": {
            "_component_": "lightrft.rewards.CombinedReward",
            "functions": {"accuracy": {"_component_": "lightrft.rewards.GSM8KVerifier"}},
        },
        "max_prompts": 2,
        "sampling": {"n": 1, "temperature": 0.0, "max_tokens": 2},
    }
    path = tmp_path / "eval.yaml"
    path.write_text("# lightrft run eval --config eval.yaml\n" + yaml.safe_dump(cfg))
    assert cli.main(["run", "eval", "--config", str(path)]) == 0
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["prompts"] == 2
    (cached,) = (tmp_path / "cache").iterdir()
    assert_same_export(cached, out / "final")
    # Made once: a second use of the same checkpoint reuses it.
    from lightrft.export import resolve_model_dir

    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(_step(out, 2)) == str(cached)
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp


# ------------------------------------------------------------------ a reward model


def test_reward_model_checkpoint_exports_heads_and_scores_in_reward_model(tmp_path, monkeypatch):
    """Two named heads with attention pooling (head, pooler and lightrft_reward statistics in
    the export); RewardModel takes the checkpoint and scores as it scores final/."""
    from lightrft.rewards import RewardModel

    monkeypatch.setenv("LIGHTRFT_EXPORT_CACHE", str(tmp_path / "cache"))
    cfg = _rm_config(
        tmp_path,
        heads=["helpful", "harmless"],
        model={
            "path": str(tmp_path / "model"),
            "heads": ["helpful", "harmless"],
            "pooling": "attention",
        },
        max_steps=2,
        save_every=2,
        eval_every=1,  # the statistics at the checkpoint are the ones final/ carries
        metrics={},
    )
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    got = _export(_step(out, 2), tmp_path / "exported")
    assert_same_export(got, out / "final")
    block = json.loads((got / "config.json").read_text())["lightrft_reward"]
    assert block["heads"] == ["helpful", "harmless"] and block["pooling"] == "attention"
    assert set(block["stats"]) == {"helpful", "harmless"}

    prompts, responses = ["apple river?", "stone lamp?"], ["river apple yes", "lamp stone no"]
    want = RewardModel(str(out / "final"), score_head="harmless", normalize=True)
    rm = RewardModel(str(_step(out, 2)), score_head="harmless", normalize=True)
    assert torch.equal(rm(Sample.batch(prompts, responses)), want(Sample.batch(prompts, responses)))


# ------------------------------------------------------------------ slower variants


LORA = {"rank": 4, "alpha": 8, "target_modules": "auto", "export_merged": True}


@pytest.mark.slow
def test_export_of_a_lora_checkpoint_equals_final_adapter_and_merged(tmp_path):
    cfg = _sft_config(
        tmp_path,
        max_steps=2,
        save_every=2,
        eval_every=None,
        eval_dataset=None,
        metrics={},
        lora={**LORA, "trained_modules": ["lm_head"]},
    )
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    got = _export(_step(out, 2), tmp_path / "exp" / "final")
    assert (got / "adapter_config.json").is_file()
    assert_same_export(got, out / "final")
    assert_same_export(tmp_path / "exp" / "final_merged", out / "final_merged")

    # A record whose LoRA config does not build this checkpoint's adapters is refused.
    from lightrft.export import export_checkpoint

    for name, edit, match in (
        ("full", lambda e: e.update(lora=None), "holds '.*lora_A.*', which the model rebuilt"),
        ("rank", lambda e: e["lora"].update(rank=8), "does not load into the model rebuilt"),
        ("key", lambda e: e["lora"].update(bias="all"), "'export.lora' is not a lora section"),
    ):
        bad = tmp_path / name / "step_000002"
        shutil.copytree(_step(out, 2), bad)
        meta = json.loads((bad / "meta.json").read_text())
        edit(meta["export"])
        (bad / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=match):
            export_checkpoint(bad, tmp_path / name / "x")


def _two_rank_sft(rank: int, world_size: int, cfg_path: str) -> None:
    from _dist import build_recipe

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("sft", cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.logger.close()
    # Under the process group, a checkpoint given as a model is exported collectively.
    from lightrft.export import resolve_model_dir

    got = resolve_model_dir(Path(cfg.output_dir) / "checkpoints" / "step_000002")
    assert Path(got).parent == Path(os.environ["LIGHTRFT_EXPORT_CACHE"])


@pytest.mark.slow
def test_export_of_a_two_rank_fsdp2_checkpoint_equals_final(tmp_path, monkeypatch):
    """Saved by 2 gloo ranks (DCP shards of both), exported in this one process, and by both
    ranks together (resolve_model_dir under the process group)."""
    monkeypatch.setenv("LIGHTRFT_EXPORT_CACHE", str(tmp_path / "cache"))
    cfg = _sft_config(
        tmp_path,
        max_steps=2,
        save_every=2,
        eval_every=None,
        eval_dataset=None,
        metrics={},
        batch_size=8,
        gradient_accumulation_steps=1,
    )
    run_distributed(_two_rank_sft, str(cfg), world_size=2)
    out = tmp_path / "out"
    assert json.loads((_step(out, 2) / "meta.json").read_text())["world_size"] == 2
    assert_same_export(_export(_step(out, 2), tmp_path / "exported"), out / "final")
    (cached,) = (tmp_path / "cache").iterdir()
    assert_same_export(cached, out / "final")


def _two_rank_recipe(rank: int, world_size: int, recipe_name: str, cfg_path: str) -> None:
    from _dist import build_recipe

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe(recipe_name, cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.logger.close()


@pytest.mark.deepspeed
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'lightrft[deepspeed]')",
)
def test_export_of_deepspeed_zero_checkpoints_equals_final(tmp_path):
    """SFT on ZeRO-1, ZeRO-2 and ZeRO-3 and a two-head reward model on ZeRO-3 (2 gloo ranks, one
    spawn): each step-2 checkpoint (DeepSpeed's partitioned files) exported in this one process
    equals the run's final/ bitwise."""
    from _serial import each

    ds = {"strategy": "deepspeed", "batch_size": 8, "gradient_accumulation_steps": 1}
    short = dict(max_steps=2, save_every=2, metrics={})
    runs = {
        "zero1": ("sft", _sft_config, {**ds, "deepspeed": {"stage": 1}, "eval_dataset": None}),
        "zero2": ("sft", _sft_config, {**ds, "deepspeed": {"stage": 2}, "eval_dataset": None}),
        "zero3": ("sft", _sft_config, {**ds, "deepspeed": {"stage": 3}, "eval_dataset": None}),
        # eval_every=1: the held-out statistics at the checkpoint are the ones final/ carries
        "rm_zero3": (
            "reward_model",
            _rm_config,
            {**ds, "deepspeed": {"stage": 3}, "eval_every": 1, "heads": ["a", "b"]},
        ),
    }
    calls = []
    for name, (recipe, config, over) in runs.items():
        (tmp_path / name).mkdir()
        cfg = config(tmp_path / name, **short, **over)
        calls.append((_two_rank_recipe, (recipe, str(cfg))))
    run_distributed(each, calls, world_size=2)
    for name in runs:
        out = tmp_path / name / "out"
        meta = json.loads((_step(out, 2) / "meta.json").read_text())
        assert meta["deepspeed"] == ["model"] and meta["export"]["strategy"] == "deepspeed"
        got = _export(_step(out, 2), tmp_path / name / "exported")
        assert_same_export(got, out / "final")


@pytest.fixture(scope="module")
def grpo_assets(tmp_path_factory) -> Path:
    """test_grpo's tiny model and arithmetic prompts."""
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("grpo_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=40, n_test=8, digits=1)
    return root


@pytest.mark.slow
def test_export_of_a_grpo_checkpoint_with_a_critic_equals_final(tmp_path, grpo_assets):
    """GRPO with a critic names its actor `policy` in the checkpoint (beside the critic); the
    export writes the actor, as final/."""
    over = {
        "algorithm.advantage.estimator": "gae",
        "critic": {"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}},
        "algorithm.value": {"clip": 0.2},
        "eval": None,
        "eval_dataset": None,
        "save_every": 2,
    }
    cfg = _grpo_config(tmp_path, grpo_assets, **over)
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    meta = json.loads((_step(out, 2) / "meta.json").read_text())
    assert meta["models"] == ["critic", "policy"] and meta["export"]["model"] == "policy"
    assert_same_export(_export(_step(out, 2), tmp_path / "exported"), out / "final")
