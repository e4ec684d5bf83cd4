"""The environment protocol and the tool-calling environment: episodes, concurrent calls, every
failure an observation, the turn budget, wrong types from user environments."""

import threading
import time

import pytest

from lightrft.environments import (
    Environment,
    EpisodeStats,
    ErrorKind,
    Step,
    ToolEnvironment,
    aggregate_stats,
    calculator,
)


def call(name, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def nap(seconds: float, label: str) -> str:
    """Sleep, then say which call this was.

    Args:
        seconds: how long to sleep.
        label: returned.
    """
    time.sleep(seconds)
    return label


def test_an_episode_with_the_calculator():
    env = ToolEnvironment([calculator], max_turns=3)
    first = env.reset({"prompt": "What is 1234 * 5678?", "messages": None})
    assert first == [{"role": "user", "content": "What is 1234 * 5678?"}]
    step = env.step("I will compute.\n" + call("calculator", expression="1234 * 5678"))
    assert step == Step(observation=[{"role": "tool", "name": "calculator", "content": "7006652"}])
    final = env.step("The answer is 7006652.")
    assert final.done and final.observation == [] and final.reward is None
    assert env.stats.turns == 2 and env.stats.tool_calls == 1 and env.stats.errors == {}
    assert not env.stats.truncated and len(env.stats.tool_seconds) == 1


def test_reset_takes_the_items_chat_and_starts_fresh_stats():
    env = ToolEnvironment([calculator])
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+2?"}]
    env.step(call("calculator", expression="2+2"))
    assert env.reset({"messages": chat, "prompt": "ignored"}) == chat
    assert env.stats == EpisodeStats()
    with pytest.raises(ValueError, match="neither 'messages' nor 'prompt'"):
        env.reset({"question": "?"})


def test_calls_of_a_turn_run_concurrently_and_answer_in_call_order():
    env = ToolEnvironment([nap])
    start = time.monotonic()
    step = env.step(call("nap", seconds=0.6, label="slow") + call("nap", seconds=0.1, label="fast"))
    assert time.monotonic() - start < 1.0  # not 0.7 s in a row plus overhead
    assert [m["content"] for m in step.observation] == ["slow", "fast"]
    assert env.stats.tool_calls == 2 and len(env.stats.tool_seconds) == 2


def test_every_failure_is_an_observation_and_counted():
    release = threading.Event()

    def explode(x: int) -> str:
        """Raise.

        Args:
            x: ignored.
        """
        raise KeyError(x)

    def stall(x: int) -> str:
        """Block.

        Args:
            x: ignored.
        """
        release.wait(30)
        return "late"

    from lightrft.environments import Tool

    env = ToolEnvironment([calculator, explode, Tool(stall, timeout=0.2)], error_penalty=0.5)
    text = (
        "<tool_call>{not json}</tool_call>"
        + call("search", query="x")
        + call("calculator", expression=7)
        + call("explode", x=1)
        + call("stall", x=1)
        + call("calculator", expression="6*7")
    )
    try:
        step = env.step(text)
    finally:
        release.set()
    contents = [m["content"] for m in step.observation]
    assert contents[0].startswith("Error: malformed tool call: the call is not valid JSON")
    assert "name" not in step.observation[0]
    assert contents[1] == "Error: unknown tool 'search'; the tools are: calculator, explode, stall"
    assert contents[2].startswith("Error: bad arguments for tool 'calculator'")
    assert contents[3] == "Error: tool 'explode' failed: KeyError: 1"
    assert contents[4] == "Error: tool 'stall' did not finish within 0.2 s"
    assert contents[5] == "42"
    kinds = [ErrorKind.malformed_call, ErrorKind.unknown_tool, ErrorKind.bad_arguments]
    kinds += [ErrorKind.tool_exception, ErrorKind.tool_timeout]
    assert step.errors == {k: 1 for k in kinds} and not step.done
    assert step.reward == -2.5  # 5 errors * 0.5
    assert (
        env.stats.errors == step.errors and env.stats.tool_calls == 6 and env.stats.reward == -2.5
    )


def test_the_turn_budget_ends_an_episode_that_would_go_on():
    env = ToolEnvironment([calculator], max_turns=2)
    assert not env.step(call("calculator", expression="1+1")).done
    last = env.step(call("calculator", expression="2+2"))
    assert last.done and last.observation == []
    assert env.stats.turns == 2 and env.stats.truncated


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None])
def test_max_turns_below_one_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match=r"ToolEnvironment: max_turns must be an int >= 1"):
        ToolEnvironment([calculator], max_turns=bad)


def test_tool_list_mistakes_are_refused():
    with pytest.raises(ValueError, match="tools is empty"):
        ToolEnvironment([])
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolEnvironment([calculator, calculator])


class Guess(Environment):
    """A guessing game: 'higher' / 'lower' as user messages, a reward for the right number."""

    def __init__(self, max_turns: int = 5):
        super().__init__(max_turns=max_turns)
        self.secret = 0

    def reset(self, item):
        self.secret = item["secret"]
        return [{"role": "user", "content": "Guess a number from 1 to 100."}]

    def step(self, assistant_text):
        guess = int(assistant_text.strip())
        if guess == self.secret:
            return Step(reward=1.0, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return Step(observation=[{"role": "user", "content": hint}])


def test_a_user_environment_plays_and_is_counted():
    env = Guess(max_turns=5)
    assert env.reset({"secret": 30})[0]["role"] == "user"
    assert env.step("50").observation == [{"role": "user", "content": "lower"}]
    assert env.step("25").observation == [{"role": "user", "content": "higher"}]
    assert env.step("30") == Step(reward=1.0, done=True)
    assert env.stats.turns == 3 and env.stats.reward == 1.0 and not env.stats.truncated


def test_a_subclass_calling_super_step_counts_one_turn():
    class Hinted(ToolEnvironment):
        def step(self, assistant_text):
            out = super().step(assistant_text)
            return Step(out.observation, 0.1, out.done, out.errors)

    env = Hinted([calculator])
    env.step(call("calculator", expression="1"))
    assert env.stats.turns == 1 and env.stats.tool_calls == 1 and env.stats.reward == 0.1


class Wrong(Environment):
    def __init__(self, out):
        super().__init__(max_turns=3)
        self.out = out

    def reset(self, item):
        return self.out

    def step(self, assistant_text):
        return self.out


@pytest.mark.parametrize(
    "out, message",
    [
        ("lower", r"Wrong\.step must return a Step, got a str"),
        ({"observation": []}, r"Wrong\.step must return a Step, got a dict"),
        (Step(observation="lower"), r"Wrong\.step \(Step\.observation\) must return a list"),
        (Step([{"role": "assistant", "content": "x"}]), r"Wrong\.step: observation roles must be"),
        (Step([{"role": "user", "content": "x"}], reward="1"), r"Step\.reward must be a float"),
        (Step(done=True, errors={"tool_timeout": 1}), r"Step\.errors must map ErrorKind"),
        (Step(), r"Wrong\.step: a Step that is not done needs an observation"),
    ],
)
def test_wrong_step_types_are_refused_naming_class_and_method(out, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Wrong(out).step("hi")


def test_wrong_reset_type_is_refused_naming_class_and_method():
    with pytest.raises(
        TypeError, match=r"Wrong\.reset must return a list of message dicts, got a str"
    ):
        Wrong("hello").reset({})
    with pytest.raises(TypeError, match=r"Wrong\.reset returned a message without a 'role'"):
        Wrong([{"content": "x"}]).reset({})


def test_a_subclass_that_skips_super_init_is_told_to_call_it():
    class Bare(Environment):
        def __init__(self):
            pass

        def step(self, assistant_text):
            return Step(done=True)

    with pytest.raises(
        ValueError, match=r"Bare: max_turns must be an int >= 1, got None \(call super"
    ):
        Bare().step("x")


def test_aggregate_stats_by_hand():
    a = EpisodeStats(
        turns=3, tool_calls=2, errors={ErrorKind.unknown_tool: 1}, tool_seconds=[0.1, 0.3]
    )
    b = EpisodeStats(turns=1, truncated=True)
    m = aggregate_stats([a, b])
    assert m["env/turns"] == 2.0 and m["env/tool_calls"] == 1.0 and m["env/truncated"] == 0.5
    assert m["env/tool_use_frac"] == 0.5
    assert m["env/errors/unknown_tool"] == 0.5 and m["env/errors/tool_timeout"] == 0.0
    assert m["env/tool_seconds_mean"] == pytest.approx(0.2) and m["env/tool_seconds_max"] == 0.3


def test_python_and_calculator_in_one_turn():
    from lightrft.environments import python_tool

    env = ToolEnvironment([calculator, python_tool(timeout=2.0)])
    code = "print(sum(range(10)))\nprint(undefined)"
    step = env.step(call("python", code=code) + call("calculator", expression="45 * 2"))
    sandboxed, calc = step.observation
    assert sandboxed["name"] == "python" and sandboxed["content"].startswith("45\nTraceback")
    assert sandboxed["content"].rstrip().endswith("NameError: name 'undefined' is not defined")
    assert calc == {"role": "tool", "name": "calculator", "content": "90"}
    assert step.errors == {}
