"""pass@k / maj@k / mean@k with hand-computed numbers, and summarize()."""

import pickle

import pytest

from lightrft.evaluation import EvalRecord, maj_at_k, mean_at_k, pass_at_k, summarize


def test_pass_at_k_hand_numbers():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # only one wrong sample: any 2 hold a right one
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_maj_and_mean_at_k():
    answers = ["3", "4", "4.0", None, "3"]
    correct = [True, False, False, False, True]
    assert maj_at_k(answers, correct, 1) == 1.0  # "3" alone
    assert maj_at_k(answers, correct, 3) == 0.0  # "4" and "4.0" vote together: wrong
    assert maj_at_k(answers, correct, 5) == 1.0  # 2-2 tie: "3" was seen first
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    assert mean_at_k([1.0, 0.0, 0.0, 1.0], 2) == 0.5
    assert mean_at_k([1.0, 0.0, 0.0, 1.0], 4) == 0.5


def _rec(i, answers, correct):
    n = len(answers)
    return EvalRecord(
        i, "p", "r", ["s"] * n, answers, [float(c) for c in correct], correct, [2] * n
    )


def test_summarize_hand_numbers_and_order_independence():
    recs = [
        _rec(0, ["1", "1", "2", "2"], [True, True, False, False]),
        _rec(1, ["5", "6", "6", "6"], [False, False, False, False]),
    ]
    s = summarize(recs, [1, 2, 4])
    assert s["prompts"] == 2 and s["samples_per_prompt"] == 4
    assert s["pass@1"] == pytest.approx((0.5 + 0) / 2)
    assert s["pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # 1 - C(2,2)/C(4,2)
    assert s["pass@4"] == pytest.approx(0.5)
    assert s["maj@4"] == pytest.approx(0.5)  # prompt 0: 2-2 tie, "1" first and right
    assert s["mean@2"] == pytest.approx(0.5)
    assert s["reward"] == pytest.approx(0.25) and s["response_length"] == 2
    assert summarize(recs[::-1], [1, 2, 4]) == s
    with pytest.raises(ValueError, match="k=8"):
        summarize(recs, [8])


def test_summarize_over_episodes_hand_numbers_and_json_rows():
    """With episodes: the env/* means over every sample, observation tokens counted from the
    ids the episodes appended; each JSON row holds every turn."""
    from lightrft.environments import Episode, EpisodeStats, ErrorKind, TurnRecord

    tool = {"role": "tool", "name": "calculator", "content": "408"}
    called = Episode(
        messages=[{"role": "user", "content": "q"}],
        turns=[TurnRecord([1, 2], "call", [tool], [7, 7, 7], tool_calls=1), TurnRecord([3], "a")],
        stats=EpisodeStats(turns=2, tool_calls=1, tool_seconds=[0.5]),
        final_text="a",
    )
    failed = Episode(
        messages=[{"role": "user", "content": "q"}],
        stats=EpisodeStats(turns=1, tool_calls=1, errors={ErrorKind.unknown_tool: 1}),
        final_text="b",
    )
    plain = Episode(messages=[{"role": "user", "content": "q"}], stats=EpisodeStats(turns=1))
    recs = [_rec(0, ["a", "b"], [True, False]), _rec(1, ["c", "c"], [False, False])]
    recs[0].lengths = [6, 2]  # 2 + 3 observation + 1 sampled; 2 sampled
    recs[1].lengths = [2, 2]
    recs[0].episodes, recs[1].episodes = [called, failed], [plain, plain]
    s = summarize(recs, [1, 2])
    assert s["pass@2"] == 0.5 and s["maj@2"] == 0.5
    assert s["env/turns"] == 5 / 4 and s["env/tool_calls"] == 2 / 4
    assert s["env/tool_use_frac"] == 2 / 4 and s["env/errors/unknown_tool"] == 1 / 4
    assert s["env/observation_token_frac"] == 3 / 12 and s["env/tool_seconds_max"] == 0.5
    row = recs[0].to_json()
    assert [e["final_text"] for e in row["episodes"]] == ["a", "b"]
    assert row["episodes"][0]["turns"][0]["observation"] == [tool]
    assert row["episodes"][1]["stats"]["errors"] == {"unknown_tool": 1}
    assert "episodes" not in _rec(0, ["a"], [True]).to_json()  # a single-turn row as before
    # Records travel between ranks pickled (all_gather_objects): episodes included.
    assert pickle.loads(pickle.dumps(recs[0])).to_json() == row
