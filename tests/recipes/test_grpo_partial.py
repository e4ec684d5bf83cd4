"""Partial rollouts in the GRPO recipe (``rollout.partial.token_budget``): a tiny run carries
cut samples into the next step, corrects their stale tokens and trains; bad settings are refused
before anything loads."""

from __future__ import annotations

import math

import pytest
from test_grpo import _config, _run, _train_rows, assets  # noqa: F401 (the assets fixture)

from lightrft import cli


@pytest.mark.slow  # ~10 s: a whole run through the CLI
def test_a_budget_carries_samples_into_the_next_step_and_trains(tmp_path, assets):  # noqa: F811
    # One group fits the 6 cache rows at a time, and 10 tokens end a step's generation: the
    # second group is cut after 2 tokens per sample and finishes under the next weights.
    rows = _run(
        tmp_path,
        assets,
        eval=None,
        eval_dataset=None,
        max_steps=2,
        engine={"max_num_seqs": 6},
        **{
            "rollout.partial": {"token_budget": 10},
            "algorithm.tis": {"mode": "token"},
        },
    )
    train = _train_rows(rows)
    assert sorted(train) == [1, 2]
    for row in train.values():
        for key in ("train/loss", "train/grad_norm", "rollout/carried_tokens"):
            assert math.isfinite(row[key]), (key, row)
        assert row["rollout/trained_groups"] >= 1
    carried = [row["rollout/carried_tokens"] for row in train.values()]
    assert carried == [0, 8], carried  # 4 samples x 2 tokens sampled at step 1
    assert train[2]["rollout/max_policy_versions"] == 2
    assert train[2]["rollout/max_version_lag"] == 1
    # Every step stops at the budget, plus less than one token per row.
    assert all(row["rollout/generated_tokens"] < 10 + 6 * 2 for row in train.values())


@pytest.mark.parametrize(
    "over, msg",
    [
        (
            {"rollout.partial": {"token_budget": 7}},
            "rollout.partial.token_budget=7 is less than one token per row of a step "
            "(rollout.prompts_per_step x rollout.n = 8)",
        ),
        (
            {"rollout.partial": {"token_budget": 8}},
            "rollout.partial.token_budget: carried tokens were sampled by older weights",
        ),
        (
            {
                "rollout.partial": {"token_budget": 8},
                "algorithm.old_logprobs": "engine",
                "algorithm.shaping": {"dynamic_sampling": {"enabled": True}},
            },
            "rollout.partial.token_budget and algorithm.shaping.dynamic_sampling",
        ),
    ],
    ids=["budget below one token per row", "no importance correction", "dynamic sampling"],
)
def test_partial_settings_that_cannot_work_are_refused_before_loading(tmp_path, capsys, over, msg):
    # The rules run before the model path is looked at: no model is needed to be refused.
    cfg = _config(tmp_path, tmp_path / "no_assets", **over)
    assert cli.main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
