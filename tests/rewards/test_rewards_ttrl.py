"""TTRL: majority-vote pseudo-labels over hand-built groups, and majority_vote itself."""

import pytest
from omegaconf import OmegaConf

from lightrft.rewards import CombinedReward, GSM8KVerifier, MathVerifier, Sample, TTRLReward
from lightrft.rewards.math_answer import majority_vote


def test_majority_vote_groups_equal_values():
    assert majority_vote(["0.5", r"\frac{1}{2}", "3", "1/2"]) == ("0.5", 3)
    assert majority_vote([None, None]) == (None, 0)
    assert majority_vote(["2", "3", "3", "2"]) == ("2", 2)  # a tie goes to the first seen
    assert majority_vote(["1,000", "1000", "x = 1000", "7"])[1] == 3


def _call(r, prompts, responses):
    return r(
        Sample.batch(
            prompts, responses, references=[None] * len(responses), labels=[None] * len(responses)
        )
    )


def test_hand_built_groups():
    r = TTRLReward(GSM8KVerifier(), group_size=4)
    prompts = ["p1"] * 4 + ["p2"] * 4
    responses = [
        "#### 5",
        "so 5.0",
        "#### 6",
        "no idea",  # 5 has 2 of 4 votes
        "#### 1",
        "#### 2",
        "#### 3",
        "#### 2",  # 2 has 2 of 4
    ]
    assert _call(r, prompts, responses) == [1, 1, 0, 0, 0, 1, 0, 1]
    assert r.last_labels == ["5", "2"]
    assert r.last_metrics == {"labelled_groups": 1.0, "vote_share": 0.5}
    # A higher bar: 2/4 is below 0.75, so both groups get nothing.
    strict = TTRLReward(GSM8KVerifier(), group_size=4, min_vote_share=0.75)
    assert _call(strict, prompts, responses) == [0] * 8
    responses[2] = "#### 5"
    assert _call(strict, prompts, responses) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_groups_from_prompts_and_symbolic_agreement():
    r = TTRLReward(MathVerifier(), correct=1.0, incorrect=-1.0)
    prompts = ["a", "a", "a", "b", "b"]
    responses = [r"\boxed{\frac{1}{2}}", "the answer is 0.5", r"\boxed{1}", "x", "y"]
    # Group "b" has no answer at all: no label, every sample gets `incorrect`.
    assert _call(r, prompts, responses) == [1.0, 1.0, -1.0, -1.0, -1.0]


def test_layout_errors_name_the_problem():
    r = TTRLReward(GSM8KVerifier(), group_size=2)
    with pytest.raises(ValueError, match="do not split into groups of group_size=2"):
        _call(r, ["a"] * 3, ["1"] * 3)
    with pytest.raises(ValueError, match="sample 1 .* group of sample 0"):
        _call(r, ["a", "b"], ["1", "1"])
    with pytest.raises(ValueError, match="extract"):
        TTRLReward(verifier=lambda samples: [0.0])
    with pytest.raises(ValueError, match="min_vote_share"):
        TTRLReward(GSM8KVerifier(), min_vote_share=1.5)


def test_from_config_inside_a_combined_reward():
    cfg = OmegaConf.create(
        {
            "rollout": {"n": 2},
            "reward": {
                "_component_": "lightrft.rewards.CombinedReward",
                "functions": {
                    "ttrl": {
                        "_component_": "lightrft.rewards.TTRLReward",
                        "verifier": {"_component_": "lightrft.rewards.GSM8KVerifier"},
                        "group_size": "${rollout.n}",
                    }
                },
            },
        }
    )
    from lightrft.rewards import build_reward

    reward = build_reward(cfg.reward)
    assert isinstance(reward, CombinedReward)
    out = reward(Sample.batch(["q", "q"], ["#### 3", "#### 3"]))  # no references needed
    assert out.total.tolist() == [1.0, 1.0]
    assert out.extra == {"ttrl/labelled_groups": 1.0, "ttrl/vote_share": 1.0}
