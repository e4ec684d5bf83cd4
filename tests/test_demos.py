"""The README's CPU demos (text, vision, audio, RLHF) chain as shipped: each first config's outputs
are where the next one reads them. Run through the CLI in-process in a scratch directory with
the data sets and step counts cut down (the measured, full-length runs are in docs/grpo.md,
docs/vision.md and docs/audio.md)."""

import json

from lightrft import cli


def _accuracies(path):
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]


def test_text_demo_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = [
        "prepare.1.n_train=64",
        "prepare.1.n_test=8",
        "max_steps=2",
        "eval_every=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "sft", "--config", "tiny/add_sft", *small]) == 0
    assert (tmp_path / "outputs/tiny/add_sft/final/config.json").is_file()
    assert (
        cli.main(
            [
                "run",
                "grpo",
                "--config",
                "tiny/add_grpo",
                "max_steps=1",
                "eval.every=1",
                "rollout.prompts_per_step=2",
                "rollout.n=2",
                "lr_scheduler.warmup_steps=0",
                "metrics.tensorboard=false",
            ]
        )
        == 0
    )
    assert len(_accuracies(tmp_path / "outputs/tiny/add_grpo/metrics.jsonl")) == 2  # start, end


def test_vision_demo_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = [
        "prepare.1.n_train=16",
        "prepare.1.n_test=4",
        "prepare.1.n_rl=8",
        "batch_size=8",
        "max_steps=2",
        "eval_every=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "sft", "--config", "tiny/vision_sft", *small]) == 0
    assert (tmp_path / "outputs/tiny/vision_sft/final/processor_config.json").is_file()
    assert (
        cli.main(
            [
                "run",
                "grpo",
                "--config",
                "tiny/vision_grpo",
                "max_steps=1",
                "eval.every=1",
                "rollout.prompts_per_step=2",
                "rollout.n=2",
                "lr_scheduler.warmup_steps=0",
                "metrics.tensorboard=false",
            ]
        )
        == 0
    )
    assert len(_accuracies(tmp_path / "outputs/tiny/vision_grpo/metrics.jsonl")) == 2


def test_audio_demo_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = [
        "prepare.1.n_train=16",
        "prepare.1.n_test=4",
        "prepare.1.n_rl=8",
        "batch_size=8",
        "max_steps=2",
        "eval_every=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "sft", "--config", "tiny/audio_sft", *small]) == 0
    assert (tmp_path / "outputs/tiny/audio_sft/final/processor_config.json").is_file()
    assert (
        cli.main(
            [
                "run",
                "grpo",
                "--config",
                "tiny/audio_grpo",
                "max_steps=1",
                "eval.every=1",
                "rollout.prompts_per_step=2",
                "rollout.n=2",
                "lr_scheduler.warmup_steps=0",
                "metrics.tensorboard=false",
            ]
        )
        == 0
    )
    assert len(_accuracies(tmp_path / "outputs/tiny/audio_grpo/metrics.jsonl")) == 2


def test_rlhf_demo_chain(tmp_path, monkeypatch):
    """SFT -> a likelihood reward model from it -> GRPO with that reward model as the only
    reward."""
    monkeypatch.chdir(tmp_path)
    small = [
        "prepare.1.n_train=64",
        "prepare.1.n_test=8",
        "max_steps=2",
        "eval_every=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "sft", "--config", "tiny/add_sft", *small]) == 0
    rm = ["max_steps=2", "eval_every=2", "lr_scheduler.warmup_steps=0", "metrics.tensorboard=false"]
    assert cli.main(["run", "reward_model", "--config", "tiny/rlhf_rm", *rm]) == 0
    assert (tmp_path / "outputs/tiny/rlhf_rm/final/config.json").is_file()
    grpo = [
        "max_steps=1",
        "eval.every=1",
        "rollout.prompts_per_step=2",
        "rollout.n=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "grpo", "--config", "tiny/rlhf_grpo", *grpo]) == 0
    assert len(_accuracies(tmp_path / "outputs/tiny/rlhf_grpo/metrics.jsonl")) == 2


def test_vision_rlhf_demo_chain(tmp_path, monkeypatch):
    """Vision SFT -> a vision-language likelihood reward model from it (pairs with images) ->
    GRPO with that reward model, which reads each sample's picture, as the only reward."""
    monkeypatch.chdir(tmp_path)
    small = [
        "prepare.1.n_train=16",
        "prepare.1.n_test=4",
        "prepare.1.n_rl=8",
        "batch_size=8",
        "max_steps=2",
        "eval_every=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "sft", "--config", "tiny/vision_sft", *small]) == 0
    rm = [
        "batch_size=8",
        "max_steps=2",
        "eval_every=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "reward_model", "--config", "tiny/vision_rm", *rm]) == 0
    assert (tmp_path / "outputs/tiny/vision_rm/final/processor_config.json").is_file()
    grpo = [
        "max_steps=1",
        "eval.every=1",
        "rollout.prompts_per_step=2",
        "rollout.n=2",
        "lr_scheduler.warmup_steps=0",
        "metrics.tensorboard=false",
    ]
    assert cli.main(["run", "grpo", "--config", "tiny/vision_rlhf_grpo", *grpo]) == 0
    rows = [
        json.loads(x)
        for x in (tmp_path / "outputs/tiny/vision_rlhf_grpo/metrics.jsonl").read_text().splitlines()
    ]
    assert any("reward/rm/mean" in r for r in rows)
    assert len(_accuracies(tmp_path / "outputs/tiny/vision_rlhf_grpo/metrics.jsonl")) == 2
