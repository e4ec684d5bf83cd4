"""CombinedReward: weights, per-label routing, logging metrics, config building, and errors."""

import math
import textwrap

import numpy as np
import pytest
import torch

from lightrft import config
from lightrft.rewards import (
    CombinedReward,
    MathVerifier,
    RewardError,
    Sample,
    ThinkFormatReward,
    build_reward,
    check_reward_output,
)


class Recorder:
    """A reward function that remembers what it was called with and returns fixed values."""

    def __init__(self, value=1.0):
        self.calls = []
        self.value = value

    def __call__(self, samples):
        self.calls.append(
            dict(
                prompts=[s.prompt for s in samples],
                responses=[s.response for s in samples],
                references=[s.reference for s in samples],
                labels=[s.label for s in samples],
            )
        )
        return [self.value] * len(samples)


PROMPTS = ["p0", "p1", "p2", "p3"]
RESPONSES = [r"<think>a</think> \boxed{4}", r"\boxed{5}", "<think>b</think> hi", "x"]
REFS = ["4", "4", None, None]
LABELS = ["math", "math", "chat", "chat"]


def test_weights_routes_and_parts():
    chat = Recorder(value=0.25)
    fn = CombinedReward(
        functions={"math": MathVerifier(), "format": ThinkFormatReward(), "chat": chat},
        weights={"math": 1.0, "format": 0.5, "chat": 2.0},
        routes={"math": ["math", "format"], "chat": ["chat", "format"]},
    )
    out = fn(Sample.batch(PROMPTS, RESPONSES, references=REFS, labels=LABELS))
    # math: [1, 0, -, -]; format: [1, 0, 1, 0]; chat: [-, -, .25, .25]
    torch.testing.assert_close(out.total, torch.tensor([1.5, 0.0, 1.0, 0.5]))
    torch.testing.assert_close(out.parts["math"], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(out.parts["format"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert out.applied["math"].tolist() == [True, True, False, False]
    assert out.applied["chat"].tolist() == [False, False, True, True]
    # Each function is called once, on its samples only, in batch order.
    assert len(chat.calls) == 1
    assert chat.calls[0] == dict(
        prompts=["p2", "p3"],
        responses=RESPONSES[2:],
        references=[None, None],
        labels=["chat", "chat"],
    )
    m = out.metrics()
    assert m["reward/total/mean"] == pytest.approx(0.75)
    assert m["reward/total/std"] == pytest.approx(float(np.std([1.5, 0.0, 1.0, 0.5])))
    assert m["reward/math/mean"] == pytest.approx(0.5)  # over the 2 math samples only
    assert m["reward/math/count"] == 2.0 and m["reward/format/count"] == 4.0
    assert m["reward/chat/std"] == 0.0
    assert set(out.seconds) == {"math", "format", "chat"}
    assert all(m[f"reward/{k}/seconds"] >= 0 for k in ("math", "format", "chat"))


def test_no_routes_applies_every_function_to_every_sample():
    a, b = Recorder(1.0), Recorder(3.0)
    out = CombinedReward({"a": a, "b": b}, weights={"b": -1.0})(
        Sample.batch(PROMPTS, RESPONSES, labels=["x", None, "y", "z"])
    )
    torch.testing.assert_close(out.total, torch.full((4,), -2.0))
    assert len(a.calls[0]["responses"]) == 4 and a.calls[0]["references"] == [None] * 4


def test_wildcard_route_and_default_reward():
    a, b = Recorder(1.0), Recorder(2.0)
    fn = CombinedReward({"a": a, "b": b}, routes={"math": ["a"], "*": ["b"]})
    out = fn(Sample.batch(PROMPTS, RESPONSES, labels=["math", "other", None, "math"]))
    assert out.total.tolist() == [1.0, 2.0, 2.0, 1.0]
    fn = CombinedReward({"a": a}, routes={"math": ["a"]}, default_reward=-0.5)
    out = fn(Sample.batch(PROMPTS, RESPONSES, labels=["math", "other", None, "math"]))
    assert out.total.tolist() == [1.0, -0.5, -0.5, 1.0]
    assert out.applied["a"].tolist() == [True, False, False, True]


def test_unrouted_label_is_an_error_naming_the_sample():
    fn = CombinedReward({"a": Recorder()}, routes={"math": ["a"]})
    with pytest.raises(ValueError, match=r"sample 2 \(prompt 'p2'\) has label 'maths'.*routes"):
        fn(Sample.batch(PROMPTS, RESPONSES, labels=["math", "math", "maths", "math"]))


def test_function_that_raises_is_named():
    def broken(samples):
        raise KeyError("boom")

    fn = CombinedReward({"ok": Recorder(), "judge": broken})
    with pytest.raises(
        RewardError,
        match=r"reward function 'judge' \(function\) failed on a batch "
        r"of 4 samples: KeyError: 'boom'",
    ) as info:
        fn(Sample.batch(PROMPTS, RESPONSES))
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    "returned, match",
    [
        ([1.0, 2.0, 3.0], r"'bad' returned 3 rewards for 4 samples"),
        ([1.0] * 5, r"'bad' returned 5 rewards for 4 samples"),
        (1.0, r"'bad' returned float; expected a list or 1-D tensor of 4 rewards"),
        (torch.tensor(1.0), r"'bad' returned a tensor of shape \(\)"),
        (torch.ones(4, 1), r"'bad' returned a tensor of shape \(4, 1\)"),
        (np.float64(1.0), r"'bad' returned a scalar"),
        (None, r"'bad' returned NoneType"),
        ("1111", r"'bad' returned str"),
        ([1.0, "2", 3.0, 4.0], r"'bad' returned a non-number at position 1: '2'"),
        ([[1.0], [2.0], [3.0], [4.0]], r"'bad' returned nested lists"),
        (
            [0.0, 1.0, float("nan"), 0.0],
            r"'bad' returned a non-finite reward \(nan\) for sample 2 "
            r"\(prompt 'p2'\)",
        ),
        (torch.tensor([0.0, math.inf, 0.0, 0.0]), r"non-finite reward \(inf\) for sample 1"),
    ],
)
def test_bad_outputs_fail_naming_the_function(returned, match):
    fn = CombinedReward({"good": Recorder(), "bad": lambda samples: returned})
    with pytest.raises(RewardError, match=match):
        fn(Sample.batch(PROMPTS, RESPONSES))


def test_nan_index_is_the_batch_index_under_routing():
    def nan_on_second(samples):
        return [0.0, float("nan")]

    fn = CombinedReward({"a": nan_on_second, "b": Recorder()}, routes={"x": ["a"], "y": ["b"]})
    with pytest.raises(
        RewardError,
        match=r"'a' returned a non-finite reward \(nan\) for sample 3 "
        r"\(prompt 'p3'\)",
    ):
        fn(Sample.batch(PROMPTS, RESPONSES, labels=["y", "x", "y", "x"]))


def test_good_output_types_are_accepted():
    for out in (
        [1, 0, 1, 0],
        (1.0, 0.0, 1.0, 0.0),
        np.array([1.0, 0.0, 1.0, 0.0]),
        torch.tensor([1, 0, 1, 0]),
        [np.float32(1), 0.0, torch.tensor(1.0), False],
    ):
        vals = check_reward_output("f", out, 4)
        assert vals.dtype == torch.float32 and vals.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_missing_reference_names_function_and_sample():
    fn = CombinedReward(
        {"math": MathVerifier(), "fmt": ThinkFormatReward()},
        routes={"math": ["math", "fmt"], "chat": ["fmt"]},
    )
    refs = ["4", None, None, "1"]  # sample 1 is a chat sample: it needs no reference
    labels = ["math", "chat", "math", "math"]
    prompts = ["p0", "p1", "Janet's ducks lay 16 eggs per day and she eats three", "p3"]
    with pytest.raises(
        ValueError,
        match=r"'math' needs a reference answer, but sample 2 \(label "
        r"'math', prompt .Janet's ducks lay 16 eggs per day",
    ):
        fn(Sample.batch(prompts, RESPONSES, references=refs, labels=labels))


def test_input_lengths_are_checked():
    fn = CombinedReward({"a": Recorder()})
    with pytest.raises(ValueError, match="labels has 3 entries but responses has 4"):
        fn(Sample.batch(PROMPTS, RESPONSES, labels=["a"] * 3))
    with pytest.raises(ValueError, match="prompts has 2 entries"):
        fn(Sample.batch(PROMPTS[:2], RESPONSES))


class ChatReader(Recorder):
    def __call__(self, samples):
        self.calls.append(
            dict(
                prompts=[s.prompt for s in samples], conversations=[s.conversation for s in samples]
            )
        )
        return [self.value] * len(samples)


def test_each_function_gets_its_routed_samples_whole():
    """A function gets its routed samples, each with its conversation."""
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    reader, plain = ChatReader(), Recorder()
    fn = CombinedReward(
        {"chat": reader, "plain": plain}, routes={"chat": ["chat"], "math": ["plain"]}
    )
    fn(Sample.batch(PROMPTS, RESPONSES, references=REFS, labels=LABELS, conversations=chats))
    assert reader.calls == [{"prompts": PROMPTS[2:], "conversations": chats[2:]}]
    assert plain.calls[0]["prompts"] == PROMPTS[:2]
    fn(Sample.batch(PROMPTS, RESPONSES, references=REFS, labels=LABELS))
    assert reader.calls[-1]["conversations"] == [None, None]
    with pytest.raises(ValueError, match="conversations has 3 entries but responses has 4"):
        fn(
            Sample.batch(
                PROMPTS, RESPONSES, references=REFS, labels=LABELS, conversations=chats[:3]
            )
        )


def test_empty_batch():
    out = CombinedReward({"a": Recorder()})(Sample.batch([], [], references=[], labels=[]))
    assert out.total.shape == (0,)
    assert out.metrics()["reward/total/mean"] == 0.0
    assert out.metrics()["reward/a/count"] == 0.0


def test_constructor_errors():
    with pytest.raises(ValueError, match="non-empty mapping"):
        CombinedReward({})
    with pytest.raises(ValueError, match=r"weights.mth: no reward function named 'mth'"):
        CombinedReward({"math": Recorder()}, weights={"mth": 1.0})
    with pytest.raises(ValueError, match=r"weights.math must be a finite number"):
        CombinedReward({"math": Recorder()}, weights={"math": float("nan")})
    with pytest.raises(ValueError, match=r"routes.gsm8k: no reward function named 'gsm'"):
        CombinedReward({"math": Recorder()}, routes={"gsm8k": ["gsm"]})
    with pytest.raises(ValueError, match=r"functions.math is a int, not callable"):
        CombinedReward({"math": 3})
    with pytest.raises(ValueError, match="reserved"):
        CombinedReward({"total": Recorder()})


def test_build_reward_wraps_single_functions():
    def my_judge(samples):
        return [0.5] * len(samples)

    assert list(build_reward(MathVerifier()).functions) == ["math"]
    assert list(build_reward(my_judge).functions) == ["my_judge"]
    assert list(build_reward(Recorder()).functions) == ["recorder"]
    assert list(build_reward(my_judge, name="judge").functions) == ["judge"]
    combined = CombinedReward({"a": Recorder()})
    assert build_reward(combined) is combined
    fn = build_reward({"_component_": "lightrft.rewards.GSM8KVerifier", "incorrect": -1.0})
    out = fn(Sample.batch(["q"], ["#### 3"], references=["4"]))
    assert list(fn.functions) == ["gsm8k"] and out.total.tolist() == [-1.0]


def test_yaml_config_with_nested_components(tmp_path):
    path = tmp_path / "rewards.yaml"
    path.write_text(
        textwrap.dedent("""\
        reward:
          _component_: lightrft.rewards.CombinedReward
          functions:
            accuracy:
              _component_: lightrft.rewards.MathVerifier
              extractors: [boxed, last_number]
            format:
              _component_: lightrft.rewards.ThinkFormatReward
              answer: boxed
          weights: {accuracy: 1.0, format: 0.1}
          routes: {math: [accuracy, format], "*": [format]}
        """)
    )
    cfg, src = config.load(path, ["reward.weights.format=0.5"])
    config.check(cfg, {"reward": config.Component}, src)
    fn = build_reward(cfg.reward)
    out = fn(
        Sample.batch(
            ["q", "q"],
            [r"<think>t</think> \boxed{2}", r"<think>t</think> \boxed{2}"],
            references=["2", None],
            labels=["math", "chat"],
        )
    )
    assert out.total.tolist() == [1.5, 0.5]
    assert set(out.metrics()) >= {"reward/accuracy/mean", "reward/format/mean"}


def test_yaml_config_errors_are_caught(tmp_path):
    path = tmp_path / "rewards.yaml"
    path.write_text(
        textwrap.dedent("""\
        reward:
          _component_: lightrft.rewards.CombinedReward
          functions: {math: {_component_: lightrft.rewards.MathVerifier}}
          wieghts: {math: 1.0}
        """)
    )
    cfg, src = config.load(path)
    with pytest.raises(config.ConfigError, match="did you mean 'weights'"):
        config.check(cfg, {"reward": config.Component}, src)


def test_a_function_of_the_list_interface_is_refused_naming_it():
    """Custom functions written for ``fn(prompts, responses, references, labels)`` get a clear
    error when the reward is built, before any step (docs/reward_models.md)."""

    def old(prompts, responses, references, labels):
        return [0.0] * len(responses)

    with pytest.raises(ValueError, match=r"'functions.old' takes \(prompts, responses.*Sample"):
        CombinedReward({"old": old})
    with pytest.raises(ValueError, match=r"'functions.old' takes \(prompts, responses"):
        build_reward(old)
