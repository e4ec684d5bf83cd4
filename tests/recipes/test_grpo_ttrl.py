"""TTRL inside the unchanged GRPO recipe: the reward reads groups from the recipe's layout."""

from test_grpo import _run, _train_rows, assets  # noqa: F401 - the fixture is used by name


def test_ttrl_reward_trains_through_grpo(tmp_path, assets):  # noqa: F811
    reward = {
        "_component_": "lightrft.rewards.CombinedReward",
        "functions": {
            "ttrl": {
                "_component_": "lightrft.rewards.TTRLReward",
                "verifier": {"_component_": "lightrft.rewards.MathVerifier", "symbolic": False},
                "group_size": "${rollout.n}",
            },
        },
    }
    rows = _run(tmp_path, assets, reward=reward, eval=None, eval_dataset=None)
    train = _train_rows(rows)
    assert sorted(train) == [1, 2]
    for row in train.values():
        assert 0.0 <= row["reward/ttrl/mean"] <= 1.0
        assert row["reward/ttrl/count"] == 8  # 2 prompts x 4 samples, all scored
        # The reward's own metrics reach the log (a random model often answers nothing: 0).
        assert 0.0 <= row["reward/ttrl/vote_share"] <= 1.0
        assert row["reward/ttrl/labelled_groups"] in (0.0, 0.5, 1.0)


def test_ttrl_with_eval_groups_by_prompt(tmp_path, assets):  # noqa: F811
    """Without group_size (the shipped config), groups are runs of one prompt, so the same reward
    also scores the eval set, where each prompt has one sample (agreement 1 by construction);
    the true-answer accuracy comes from a weight-0 verifier."""
    reward = {
        "_component_": "lightrft.rewards.CombinedReward",
        "functions": {
            "ttrl": {
                "_component_": "lightrft.rewards.TTRLReward",
                "verifier": {"_component_": "lightrft.rewards.MathVerifier", "symbolic": False},
            },
            "accuracy": {"_component_": "lightrft.rewards.MathVerifier", "symbolic": False},
        },
        "weights": {"accuracy": 0.0},
    }
    rows = _run(tmp_path, assets, reward=reward, **{"eval.accuracy_reward": "accuracy"})
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert r["eval/reward/ttrl"] == 1.0 and 0.0 <= r["eval/accuracy"] <= 1.0
    assert _train_rows(rows)[2]["reward/ttrl/count"] == 8
