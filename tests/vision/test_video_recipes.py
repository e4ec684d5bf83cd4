"""The shipped video configs (configs/tiny/video_{sft,grpo,eval}.yaml) through the real CLI,
in-process, shrunk by overrides: SFT, then GRPO from its export (on-policy: the trainer's
forward with each row's video gives the engine's log-probs), then eval."""

from __future__ import annotations

import json

import pytest

from lightrft import cli
from lightrft.training import read_metrics


# About 40 s on 2 shared cores (three recipes): opt-in, to keep the default suite under 15
# minutes; the paths it joins are covered one by one in the default suite (test_video_*.py).
@pytest.mark.slow
def test_video_sft_grpo_eval_configs_run_on_moving_squares(tmp_path):
    data, model = tmp_path / "motion", tmp_path / "model"
    where = [f"dataset.path={data}/train.jsonl", f"eval_dataset.path={data}/test.jsonl"]
    sft = [
        "run",
        "sft",
        "--config",
        "tiny/video_sft",
        f"output_dir={tmp_path}/sft",
        f"prepare.0.out_dir={model}",
        "prepare.0.layers=1",
        "prepare.0.hidden=64",
        f"prepare.1.out_dir={data}",
        "prepare.1.n_train=16",
        "prepare.1.n_test=4",
        "prepare.1.n_rl=8",
        f"model.path={model}",
        "batch_size=8",
        "max_steps=2",
        "eval_every=2",
        "lr_scheduler.warmup_steps=1",
        "metrics.tensorboard=false",
        *where,
    ]
    assert cli.main(sft) == 0
    rows = read_metrics(tmp_path / "sft")
    assert [r["step"] for r in rows if "train/loss" in r] and any("eval/loss" in r for r in rows)
    meta = json.loads((data / "meta.json").read_text())
    assert meta["n_train"] == 16 and len(list((data / "videos").glob("*.mp4"))) == 28

    grpo = [
        "run",
        "grpo",
        "--config",
        "tiny/video_grpo",
        f"output_dir={tmp_path}/grpo",
        f"model.path={tmp_path}/sft/final",
        f"dataset.path={data}/rl.jsonl",
        f"eval_dataset.path={data}/test.jsonl",
        "rollout.prompts_per_step=2",
        "rollout.n=4",
        "train.micro_batch_size=8",
        "algorithm.old_logprobs=engine",
        "max_steps=2",
        "eval.every=2",
        "save_every=null",
        "log_every=1",
        "metrics.tensorboard=false",
    ]
    assert cli.main(grpo) == 0
    train = [r for r in read_metrics(tmp_path / "grpo") if "train/lr" in r]
    assert len(train) == 2
    for row in train:
        assert row["rollout/samples"] == 8
        assert row["train/approx_kl"] < 1e-8, row["train/approx_kl"]
    evals = [r["eval/accuracy"] for r in read_metrics(tmp_path / "grpo") if "eval/accuracy" in r]
    assert evals and all(0.0 <= a <= 1.0 for a in evals)

    ev = [
        "run",
        "eval",
        "--config",
        "tiny/video_eval",
        f"output_dir={tmp_path}/eval",
        f"model.path={tmp_path}/grpo/final",
        f"dataset.path={data}/test.jsonl",
        "sampling.n=2",
        "ks=[1,2]",
    ]
    assert cli.main(ev) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert any("pass@2" in k for k in summary), summary
    lines = (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 4  # the 4 test videos
