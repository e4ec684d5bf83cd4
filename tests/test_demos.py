"""The README's CPU demos (text, vision, audio, RLHF with text and with images) chain as shipped:
each config's outputs are where the next one reads them. Run through the CLI in-process in a
scratch directory with the data sets and step counts cut down (the measured, full-length runs are
in docs/grpo.md, docs/vision.md, docs/audio.md, docs/reward_models.md and docs/dpo.md)."""

import json

import pytest

from lightrft import cli

TRAIN = ["max_steps=2", "eval_every=2", "lr_scheduler.warmup_steps=0", "metrics.tensorboard=false"]
# The first prepare step's data set, cut down: text (arithmetic), media (boards, tones).
TEXT_DATA = ["prepare.1.n_train=64", "prepare.1.n_test=8"]
MEDIA_DATA = ["prepare.1.n_train=16", "prepare.1.n_test=4", "prepare.1.n_rl=8", "batch_size=8"]
GRPO = [
    "max_steps=1",
    "eval.every=1",
    "rollout.prompts_per_step=2",
    "rollout.n=2",
    "lr_scheduler.warmup_steps=0",
    "metrics.tensorboard=false",
]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _run(recipe: str, config: str, overrides: list[str]) -> None:
    assert cli.main(["run", recipe, "--config", config, *overrides]) == 0


def _grpo_evaluated(tmp_path, config: str) -> list[dict]:
    """Run the GRPO config cut down; its metrics rows, checked to hold a start and an end eval."""
    _run("grpo", config, GRPO)
    rows = _rows(tmp_path / "outputs" / config / "metrics.jsonl")
    assert len([r for r in rows if "eval/accuracy" in r]) == 2  # start, end
    return rows


def test_text_demo_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/add_sft", TEXT_DATA + TRAIN)
    assert (tmp_path / "outputs/tiny/add_sft/final/config.json").is_file()
    _grpo_evaluated(tmp_path, "tiny/add_grpo")


def test_dpo_demo_chain(tmp_path, monkeypatch):
    """SFT, then DPO on the pairs made from the SFT data, then the greedy eval of its export."""
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/add_sft", TEXT_DATA + TRAIN)
    _run("dpo", "tiny/add_dpo", TRAIN)
    rows = _rows(tmp_path / "outputs/tiny/add_dpo/metrics.jsonl")
    assert any("train/rewards/margins" in r for r in rows)
    assert any(r.get("data/pairs") == 64 for r in rows)  # one pair per SFT training problem
    _run("eval", "tiny/add_dpo_eval", ["sampling.max_tokens=4"])
    summary = json.loads((tmp_path / "outputs/tiny/add_dpo_eval/summary.json").read_text())
    assert summary["prompts"] == 8 and 0.0 <= summary["pass@1"] <= 1.0  # greedy, held-out


def test_distillation_demo_chain(tmp_path, monkeypatch):
    """SFT, GRPO (the teacher), then on-policy distillation of the SFT model from it."""
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/add_sft", TEXT_DATA + TRAIN)
    _grpo_evaluated(tmp_path, "tiny/add_grpo")
    rows = _grpo_evaluated(tmp_path, "tiny/add_distill")
    assert any("train/distill/reverse_kl" in r for r in rows)


def test_vision_demo_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/vision_sft", MEDIA_DATA + TRAIN)
    assert (tmp_path / "outputs/tiny/vision_sft/final/processor_config.json").is_file()
    _grpo_evaluated(tmp_path, "tiny/vision_grpo")


def test_audio_demo_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/audio_sft", MEDIA_DATA + TRAIN)
    assert (tmp_path / "outputs/tiny/audio_sft/final/processor_config.json").is_file()
    _grpo_evaluated(tmp_path, "tiny/audio_grpo")


def test_rlhf_demo_chain(tmp_path, monkeypatch):
    """SFT -> a likelihood reward model from it -> GRPO with that reward model as the only
    reward."""
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/add_sft", TEXT_DATA + TRAIN)
    _run("reward_model", "tiny/rlhf_rm", TRAIN)
    assert (tmp_path / "outputs/tiny/rlhf_rm/final/config.json").is_file()
    rows = _grpo_evaluated(tmp_path, "tiny/rlhf_grpo")
    assert any("reward/rm/mean" in r for r in rows)


def test_vision_rlhf_demo_chain(tmp_path, monkeypatch):
    """Vision SFT -> a vision-language likelihood reward model from it (pairs with images) ->
    GRPO with that reward model, which reads each sample's picture, as the only reward."""
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/vision_sft", MEDIA_DATA + TRAIN)
    _run("reward_model", "tiny/vision_rm", ["batch_size=8", *TRAIN])
    assert (tmp_path / "outputs/tiny/vision_rm/final/processor_config.json").is_file()
    rows = _grpo_evaluated(tmp_path, "tiny/vision_rlhf_grpo")
    assert any("reward/rm/mean" in r for r in rows)


@pytest.mark.slow
def test_vision_judge_demo_chain(tmp_path, monkeypatch):
    """Vision SFT -> a vision-language judge trained by SFT on judgment data with the boards ->
    GRPO with that judge, which sees each sample's picture, as the only reward."""
    monkeypatch.chdir(tmp_path)
    _run("sft", "tiny/vision_sft", MEDIA_DATA + TRAIN)
    _run("sft", "tiny/vision_judge_sft", ["batch_size=8", *TRAIN])
    assert (tmp_path / "outputs/tiny/vision_judge_sft/final/processor_config.json").is_file()
    rows = _grpo_evaluated(tmp_path, "tiny/vision_judge_grpo")
    means = [r["reward/judge/mean"] for r in rows if "reward/judge/mean" in r]
    assert means and all(0.0 <= m <= 1.0 for m in means)
    assert any("reward/judge/parse_failures" in r for r in rows)
