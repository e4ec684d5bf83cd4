"""The sft and grpo recipes on a tiny Qwen2-VL through the real CLI, in-process: images ride the
text path (datasets -> batches / rollouts -> forward with ``media=``), the vision tower frozen
or trained, resume, export, 2 gloo processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _dist import build_recipe, run_distributed

from lightrft import cli
from lightrft.data.media import MediaOptions
from lightrft.data.vision import ImageOptions
from lightrft.training import read_metrics

TOWER = ("visual.", "model.visual.")  # Qwen2-VL's vision tower (patch merger included)


def _prepare(tmp: Path) -> list[dict]:
    return [
        {
            "_component_": "lightrft.tasks.ensure_tiny_model",
            "out_dir": str(tmp / "model"),
            "arch": "qwen2_vl",
        },
        {
            "_component_": "lightrft.tasks.ensure_shapes_dataset",
            "out_dir": str(tmp / "data"),
            "n_train": 32,
            "n_test": 8,
            "grid": 2,
            "max_count": 3,
        },
    ]


def _sft_config(tmp: Path, **overrides) -> Path:
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "prepare": _prepare(tmp),
        "model": {"path": str(tmp / "model")},
        "dataset": {
            "_component_": "lightrft.data.SFTDataset",
            "path": str(tmp / "data" / "train.jsonl"),
            "media": {"image": {"max_pixels": 56 * 56}},
        },
        "eval_dataset": {
            "_component_": "lightrft.data.SFTDataset",
            "path": str(tmp / "data" / "test.jsonl"),
            "media": {"image": {"max_pixels": 56 * 56}},
        },
        "packing": False,
        "batch_size": 8,
        "epochs": 2,
        "max_steps": 6,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
        "log_every": 1,
        "eval_every": None,
        "metrics": {"tensorboard": False},
    }
    cfg.update(overrides)
    path = tmp / "sft.yaml"
    path.write_text("# lightrft run sft --config sft.yaml\n" + yaml.safe_dump(cfg))
    return path


def _losses(out: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(out) if key in r}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _changed(before: dict, after: dict) -> tuple[set[str], set[str]]:
    """(names whose weights changed, names unchanged) over the shared keys."""
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    return changed, set(before) - changed


def _eval_loss(model_dir: Path, data: Path) -> float:
    """Mean next-token NLL of the exported model on the test set, computed outside the recipe
    from AutoModelForImageTextToText + AutoProcessor logits (plain log_softmax)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import lightrft.models.processors  # noqa: F401  (registers the image-only processors)
    from lightrft.data import SFTDataset, pack_or_pad_collator

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(model_dir)
    items = list(SFTDataset(proc, data, media=MediaOptions(image=ImageOptions(max_pixels=56 * 56))))
    nll, count = 0.0, 0
    for item in items:
        batch = pack_or_pad_collator(proc.tokenizer)([item])
        kwargs = batch["media"].image.model_inputs()
        ids = batch["input_ids"]
        with torch.no_grad():
            mm = (ids == model.config.image_token_id).long()  # Qwen2-VL wants it with grids
            logits = model(input_ids=ids, mm_token_type_ids=mm, **kwargs).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        targets = batch["labels"][:, 1:]
        keep = targets != -100
        nll -= logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].sum().item()
        count += int(keep.sum())
    return nll / count


def test_vlm_sft_learns_freezes_the_tower_and_exports(tmp_path):
    cfg = _sft_config(tmp_path, save_every=3, keep_last=5)
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < 0.7 * losses[1], losses

    before, after = _weights(tmp_path / "model"), _weights(out / "final")
    changed, same = _changed(before, after)
    tower = {k for k in before if k.startswith(TOWER)}
    assert tower and tower <= same  # frozen by default
    assert changed == set(before) - tower  # every language-model weight trained

    # Export round trip: AutoModelForImageTextToText + AutoProcessor load the export back, and
    # its plain-logit test loss is the recipe's own final eval loss.
    evals = _losses(out, "eval/loss")
    assert abs(_eval_loss(out / "final", tmp_path / "data" / "test.jsonl") - evals[6]) < 1e-5

    # Resume from the step-3 checkpoint gives the uninterrupted losses, bitwise.
    crashed = tmp_path / "crashed"
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_000003", ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000003")
    # Same model and data paths: resume refuses a config that changed them.
    cfg = _sft_config(
        tmp_path, save_every=3, keep_last=5, resume=True, output_dir=str(crashed / "out")
    )
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    resumed = _losses(crashed / "out")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == losses[s] for s in resumed), (resumed, losses)


def _run_recipe(name: str, cfg_path: str):
    """The recipe as the CLI runs it, minus the process-group teardown (the harness owns it)."""
    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe(name, cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.logger.close()
    return recipe


def _two_rank_sft(rank: int, world_size: int, cfg_path: str) -> None:
    from torch.distributed.tensor import DTensor

    recipe = _run_recipe("sft", cfg_path)
    visual = [p for n, p in recipe.model.named_parameters() if "visual." in n]
    assert visual and all(isinstance(p, DTensor) and p.requires_grad for p in visual)


@pytest.mark.slow  # 9 s; the VLM GRPO resume trains the tower and runs in the default suite
def test_vlm_sft_two_processes_train_the_tower(tmp_path):
    cfg = _sft_config(tmp_path, batch_size=4, max_steps=3, eval_dataset=None)
    data = yaml.safe_load(cfg.read_text())
    data["model"]["train_vision_tower"] = True
    cfg.write_text("# lightrft run sft --config sft.yaml\n" + yaml.safe_dump(data))
    run_distributed(_two_rank_sft, str(cfg), world_size=2)
    out = tmp_path / "out"
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3]
    changed, same = _changed(_weights(tmp_path / "model"), _weights(out / "final"))
    assert not same, same  # every weight trained, the vision tower included
    assert any(k.startswith(TOWER) for k in changed)


def test_train_vision_tower_on_a_text_model_is_refused(tmp_path, capsys):
    from lightrft.tasks import make_tiny_model

    make_tiny_model(tmp_path / "model", layers=1, hidden=16, heads=2, kv_heads=1)
    cfg = _sft_config(tmp_path, prepare=None)
    data = yaml.safe_load(cfg.read_text())
    data["model"]["train_vision_tower"] = True
    cfg.write_text("# lightrft run sft --config sft.yaml\n" + yaml.safe_dump(data))
    assert cli.main(["validate", str(cfg)]) == 2
    assert "model.train_vision_tower=true but" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- grpo


def _grpo_config(tmp: Path, assets: Path | None = None, **overrides) -> Path:
    """2 steps of 2 counting prompts x 4 samples of 4 tokens on the tiny Qwen2-VL."""
    src = assets or tmp
    prompts = {
        "_component_": "lightrft.data.PromptDataset",
        "media": {"image": {"max_pixels": 56 * 56}},
    }
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "prepare": _prepare(src),
        "model": {"path": str(src / "model")},
        "dataset": {**prompts, "path": str(src / "data" / "train.jsonl")},
        "eval_dataset": {**prompts, "path": str(src / "data" / "test.jsonl")},
        "reward": {"_component_": "lightrft.rewards.MathVerifier"},
        "rollout": {"prompts_per_step": 2, "n": 4, "max_tokens": 4},
        "algorithm": {"advantage": {"estimator": "grpo"}, "old_logprobs": "engine"},
        "train": {"micro_batch_size": 8, "ppo_epochs": 1},  # both prompts in one forward
        "max_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "eval": {"every": 2, "max_tokens": 3},
        "metrics": {"tensorboard": False},
    }
    for key, value in overrides.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    return path


def _train_rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "train/lr" in r}


def _on_policy(row: dict) -> None:
    """Old log-probs are the engine's and the step is one on-policy mini-batch: the trainer's
    forward (with the rows' images) must give the engine's log-probs, so the ratio is 1 (0.0
    measured; the rows' images in reversed order give 2.5e-5)."""
    assert row["train/approx_kl"] < 1e-8, row["train/approx_kl"]
    assert row["train/clip_frac"] == 0.0


@pytest.fixture(scope="module")
def vlm_assets(tmp_path_factory) -> Path:
    from omegaconf import OmegaConf

    from lightrft import config as lconfig

    root = tmp_path_factory.mktemp("vlm_grpo")
    for node in _prepare(root):
        lconfig.instantiate(OmegaConf.create(node))
    return root


# rloo and reinforce_pp share the multimodal path with grpo (the estimators are covered on text):
# opt-in, to keep the default suite under 15 minutes.
@pytest.mark.parametrize(
    "estimator",
    [
        "grpo",
        pytest.param("rloo", marks=pytest.mark.slow),
        pytest.param("reinforce_pp", marks=pytest.mark.slow),
    ],
)
def test_vlm_grpo_estimators_on_policy(tmp_path, vlm_assets, estimator):
    over = {"algorithm.advantage.estimator": estimator, "prepare": None}
    if estimator == "grpo":  # a reference model with a KL in the loss: 0 before any update
        over["algorithm.kl"] = {"coef": 0.1, "estimator": "k3", "placement": "loss"}
    cfg = _grpo_config(tmp_path, vlm_assets, **over)
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 0
    train = _train_rows(tmp_path / "out")
    assert sorted(train) == [1, 2]
    for row in train.values():
        _on_policy(row)
        assert row["rollout/samples"] == 8
    if estimator == "grpo":
        assert train[1]["train/kl"] == 0.0
    evals = [r for r in read_metrics(tmp_path / "out") if "eval/accuracy" in r]
    assert evals and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    # The vision tower is frozen (the RL default): the export keeps its weights.
    changed, same = _changed(_weights(vlm_assets / "model"), _weights(tmp_path / "out" / "final"))
    tower = {k for k in same | changed if k.startswith(TOWER)}
    assert tower and tower <= same and changed


def test_vlm_grpo_resume_is_bitwise(tmp_path, vlm_assets):
    over = {
        "prepare": None,
        "max_steps": 3,
        "save_every": 2,
        "keep_last": 5,
        "eval": None,
        "eval_dataset": None,
        "model.train_vision_tower": True,
        "algorithm.kl": {"coef": 0.1, "placement": "loss"},
        "train": {"micro_batch_size": 3, "ppo_epochs": 2, "mini_batch_size": 4, "packing": True},
    }
    full = tmp_path / "full"
    assert cli.main(["run", "grpo", "--config", str(_grpo_config(full, vlm_assets, **over))]) == 0
    reference = _train_rows(full / "out")
    assert sorted(reference) == [1, 2, 3]
    changed, _ = _changed(_weights(vlm_assets / "model"), _weights(full / "out" / "final"))
    assert any(k.startswith(TOWER) for k in changed)  # trained tower, packed rows

    crashed = tmp_path / "crashed"
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(full / "out" / "checkpoints" / "step_000002", ckpts / "step_000002")
    (ckpts / "latest").write_text("step_000002")
    cfg = _grpo_config(crashed, vlm_assets, resume=True, **over)
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 0
    resumed = _train_rows(crashed / "out")
    assert sorted(resumed) == [3]
    keys = [k for k in reference[3] if k.split("/")[0] in ("train", "reward", "rollout")]
    assert len(keys) > 15
    for key in keys:
        assert resumed[3][key] == reference[3][key], key


def _two_rank_grpo(rank: int, world_size: int, cfg_path: str) -> None:
    _run_recipe("grpo", cfg_path)


@pytest.mark.slow  # the VLM SFT two-process test shards and trains the tower via a recipe
def test_vlm_grpo_two_processes(tmp_path, vlm_assets):
    cfg = _grpo_config(tmp_path, vlm_assets, prepare=None, **{"eval.every": 1})
    run_distributed(_two_rank_grpo, str(cfg), world_size=2)
    train = _train_rows(tmp_path / "out")
    assert sorted(train) == [1, 2]
    for row in train.values():
        _on_policy(row)
        assert row["rollout/samples"] == 8
    assert (tmp_path / "out" / "final" / "processor_config.json").is_file()


def test_vlm_grpo_refuses_a_critic(tmp_path, vlm_assets, capsys):
    cfg = _grpo_config(
        tmp_path,
        vlm_assets,
        prepare=None,
        critic={"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}},
        **{"algorithm.advantage.estimator": "gae"},
    )
    assert cli.main(["validate", str(cfg)]) == 2
    assert "not supported with a vision-language actor" in capsys.readouterr().err


def test_vlm_grpo_against_a_vlm_reward_model(tmp_path, vlm_assets):
    """A vision-language reward model as the reward: each sample's reward is what the model
    gives that sample's conversation with its own picture, scored alone (the untrained VLM,
    marked a likelihood reward model, scores by its own mean log-prob); eval scores with it too."""
    import json

    from _vision_helpers import likelihood_reward_model

    from lightrft.data import PromptDataset, conversation
    from lightrft.models import load_processor
    from lightrft.rewards import RewardModel, Sample

    rm_path = likelihood_reward_model(vlm_assets / "model", tmp_path / "rm")
    reward = {
        "_component_": "lightrft.rewards.CombinedReward",
        "functions": {
            "rm": {"_component_": "lightrft.rewards.RewardModel", "path": rm_path},
            "accuracy": {"_component_": "lightrft.rewards.MathVerifier"},
        },
        "weights": {"accuracy": 0.0},
    }
    over = {"prepare": None, "reward": reward, "max_steps": 1, "trajectories": True}
    over.update({"eval.every": 1, "eval.accuracy_reward": "accuracy"})
    cfg = _grpo_config(tmp_path, vlm_assets, **over)
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 0
    rows = (tmp_path / "out" / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    samples = [json.loads(x) for x in rows]
    assert len(samples) == 8

    processor = load_processor(str(vlm_assets / "model"))
    data = str(vlm_assets / "data" / "train.jsonl")
    # The prompts share their text: a trajectory finds its record (and picture) by file and line.
    by_where = {
        it["where"]: it
        for it in PromptDataset(
            processor, data, media=MediaOptions(image=ImageOptions(max_pixels=56 * 56))
        )
    }
    items = [by_where[s["where"]] for s in samples]
    alone = RewardModel(rm_path)(
        Sample.batch(
            [s["prompt"] for s in samples],
            [s["response"] for s in samples],
            conversations=[conversation(it["messages"], it["media"]) for it in items],
        )
    )
    got = torch.tensor([s["reward_parts"]["rm"] for s in samples])
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor([s["reward"] for s in samples]), got)
    assert len({s["where"] for s in samples}) == 2  # two pictures in the step
    evals = [r for r in read_metrics(tmp_path / "out") if "eval/reward/rm" in r]
    assert evals and all(r["eval/reward/rm"] < 0 for r in evals)  # mean log-probs


# ---------------------------------------------------------------------------------- eval


def test_eval_recipe_on_a_vlm_sends_each_prompt_its_images(tmp_path, vlm_assets, monkeypatch):
    """The eval recipe loads a vision-language model with its processor and hands the engine
    every prompt with its own images; its greedy samples equal the engine's for those requests."""
    import json

    from lightrft.data import PromptDataset
    from lightrft.engine import NativeEngine, SamplingParams
    from lightrft.models import load_processor

    seen = []
    generate = NativeEngine.generate

    def recording(self, requests, params, continuation=None):
        seen.extend(requests)
        return generate(self, requests, params, continuation)

    monkeypatch.setattr(NativeEngine, "generate", recording)
    data = vlm_assets / "data" / "test.jsonl"
    cfg = {
        "output_dir": str(tmp_path / "eval"),
        "device": "cpu",
        "model": {"path": str(vlm_assets / "model")},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(data),
            "media": {"image": {"max_pixels": 56 * 56}},
        },
        "reward": {"_component_": "lightrft.rewards.MathVerifier"},
        "sampling": {"n": 1, "temperature": 0.0, "max_tokens": 6},
        "ks": [1],
    }
    path = tmp_path / "eval.yaml"
    path.write_text("# lightrft run eval --config eval.yaml\n" + yaml.safe_dump(cfg))
    assert cli.main(["run", "eval", "--config", str(path)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]

    processor = load_processor(str(vlm_assets / "model"))
    items = list(
        PromptDataset(
            processor, path=str(data), media=MediaOptions(image=ImageOptions(max_pixels=56 * 56))
        )
    )
    assert len(seen) == len(items) == len(rows) == 8
    for req, item in zip(seen, items, strict=True):
        assert list(req.prompt_token_ids) == list(item["prompt_ids"])
        assert torch.equal(req.media.image.pixel_values, item["media"].image.pixel_values)
    # Greedy samples as the engine gives them for those requests.
    params = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    engine = NativeEngine(str(vlm_assets / "model"), processor.tokenizer, seed=0)
    direct = generate(engine, seen, params)
    assert [r["samples"][0] for r in rows] == [c.text for c in direct]


@pytest.mark.slow
def test_vlm_checkpoint_exports_as_final_with_its_processor(tmp_path):
    """A vision-language SFT checkpoint (frozen tower: not in the checkpoint, taken from the base
    model) exported on one process equals final/: weights and processor files, bitwise."""
    from _exports import assert_same_export

    cfg = _sft_config(tmp_path, max_steps=2, save_every=2, eval_dataset=None)
    assert cli.main(["run", "sft", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    got = tmp_path / "exported"
    assert cli.main(["export", str(out / "checkpoints" / "step_000002"), "--out", str(got)]) == 0
    assert (got / "processor_config.json").is_file()
    assert_same_export(got, out / "final")
