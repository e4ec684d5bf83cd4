"""The <tool_call> format: parsing a turn's calls, and probing a chat template for it."""

import gc
import time

import pytest

from lightrft.engine.protocol import Turn
from lightrft.environments import (
    Episodes,
    ErrorKind,
    MalformedCall,
    ToolCall,
    ToolEnvironment,
    calculator_tool,
    parse_tool_calls,
    tool_call_format,
)

MAX_CALLS = 16  # lightrft.environments.tool_calls.MAX_CALLS, as docs/environments.md states it

OPEN_CALL = "<tool_call>"
CALL_C = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
CALL_P = '<tool_call>{"name": "python", "arguments": {"code": "print(4)"}}</tool_call>'


def test_calls_in_order_with_text_around():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2+2"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    assert parse_tool_calls("The answer is 4.") == []
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize(
    "body, reason",
    [
        ('{"name": "calculator", "arguments": {"expression": "2+2"}', "not valid JSON"),
        ('["calculator"]', "must be a JSON object with 'name'"),
        ('{"arguments": {}}', "no 'name' string"),
        ('{"name": "", "arguments": {}}', "no 'name' string"),
        ('{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}', "got a str"),
        ('{"name": "calculator", "arguments": [1]}', "got a list"),
    ],
)
def test_malformed_calls_keep_their_place(body, reason):
    text = f'<tool_call>\n{body}\n</tool_call><tool_call>{{"name": "ok"}}</tool_call>'
    first, second = parse_tool_calls(text)
    assert isinstance(first, MalformedCall) and first.kind is ErrorKind.malformed_call
    assert reason in first.reason
    assert second == ToolCall("ok", {})


def test_an_unclosed_call_is_malformed():
    (call,) = parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {}}')
    assert isinstance(call, MalformedCall) and call.reason == "<tool_call> without </tool_call>"


def test_qwen_template_speaks_hermes(qwen_tok):
    assert tool_call_format(qwen_tok) == "hermes"


def test_a_template_without_tools_is_refused_naming_the_model(chatml_tok):
    with pytest.raises(
        ValueError, match=r"'tiny-chatml' has no tool support: it does not render the tools"
    ):
        tool_call_format(chatml_tok)
    chatml_tok.chat_template = None
    with pytest.raises(ValueError, match=r"'tiny-chatml': there is none"):
        tool_call_format(chatml_tok)


def test_a_tool_template_in_another_format_is_refused(chatml_tok):
    # tools listed and tool messages rendered, but calls are written some other way
    chatml_tok.chat_template = (
        "{% for t in tools %}[TOOL {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"'tiny-chatml' supports tools but in a tool-call format"):
        tool_call_format(chatml_tok)


# Sampled text is hostile input: every reproduction below raised (RecursionError, ValueError)
# out of ToolEnvironment.step and Episodes.continuation, ending the rollout.

MIB = 2**20
HOSTILE_TURNS = {
    "1000 brackets": OPEN_CALL + "[" * 1000 + "</tool_call>",
    "a 4301-digit integer": OPEN_CALL
    + '{"name": "calculator", "arguments": {"x": '
    + "9" * 4301
    + "}}</tool_call>",
    "900-deep valid JSON": OPEN_CALL
    + '{"name": "calculator", "arguments": {"x": '
    + "[" * 900
    + "]" * 900
    + "}}</tool_call>",
    "10 MB of brackets": OPEN_CALL + "[" * (10 * MIB) + "</tool_call>",
    "10 MB of opening tags": OPEN_CALL * (10 * MIB // 11),
    "10 MB of empty calls": (OPEN_CALL + "</tool_call>") * (10 * MIB // 23),
    "10 MB of think tags": "</think><think><tool_call>" * (10 * MIB // 26),
    "10 MB of think blocks and calls": "<think></think><tool_call>{}</tool_call>"
    * (10 * MIB // 40),
    "10 MB of an escaped string": OPEN_CALL + '{"name": "' + '\\"' * (5 * MIB),
    "150 calls of 64 KB": (OPEN_CALL + "[" * 65530 + "</tool_call>") * 150,
}


@pytest.mark.parametrize("name", list(HOSTILE_TURNS))
def test_hostile_turns_parse_to_malformed_calls_in_bounded_time(name):
    text = HOSTILE_TURNS[name]
    gc.collect()  # other tests' garbage is not this call's time
    start = time.thread_time()  # CPU time: other tests' left-behind tool threads share the GIL
    calls = parse_tool_calls(text)
    seconds = time.thread_time() - start
    assert seconds < 1.0, f"{name}: {seconds:.2f} s"
    assert all(isinstance(c, MalformedCall) for c in calls)
    assert bool(calls) == (name != "10 MB of think tags")  # all of that one is reasoning
    assert len(calls) <= MAX_CALLS + 1
    assert all(len(c.text) <= 65536 and len(c.reason) < 300 for c in calls)


def test_the_reasons_name_the_bound():
    reasons = {
        name: calls[-1].reason
        for name, t in HOSTILE_TURNS.items()
        if (calls := parse_tool_calls(t))
    }
    assert reasons["1000 brackets"] == "the call nests deeper than 32 levels"
    assert reasons["900-deep valid JSON"] == "the call nests deeper than 32 levels"
    assert "4300 digits" in reasons["a 4301-digit integer"]
    assert reasons["10 MB of brackets"].startswith("the call is longer than 65536 characters")
    assert reasons["10 MB of empty calls"] == (
        f"more than {MAX_CALLS} tool calls in one turn: the last 455886 were not run"
    )


@pytest.mark.parametrize("name", ["1000 brackets", "a 4301-digit integer", "10 MB of empty calls"])
def test_hostile_turns_are_observations_through_the_environment_and_episodes(name, qwen_tok):
    env = ToolEnvironment([calculator_tool()])
    step = env.step(HOSTILE_TURNS[name])
    assert not step.done and step.errors == {ErrorKind.malformed_call: len(step.observation)}
    assert all(m["content"].startswith("Error: malformed tool call: ") for m in step.observation)
    if name == "10 MB of empty calls":
        return  # 10 MB through the character tokenizer is slow and shows nothing new
    eps = Episodes(lambda: ToolEnvironment([calculator_tool()]), [{"prompt": "2+2?"}], 1, qwen_tok)
    ids = qwen_tok(HOSTILE_TURNS[name] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    turn = Turn(
        request_index=0,
        sample_index=0,
        turn_index=0,
        token_ids=ids,
        logprobs=[0.0] * len(ids),
        response_token_ids=ids,
        max_observation_tokens=10**6,
    )
    observation = eps.continuation(turn)
    assert observation and "Error: malformed tool call" in qwen_tok.decode(observation)


# A <tool_call> inside <think>...</think> is reasoning (a draft or a quotation), not a call: it
# is ignored, as llama.cpp's Hermes parser ignores it.


@pytest.mark.parametrize(
    "text, names",
    [
        ("<think>\nI could " + CALL_C + "\n</think>\n\nThe answer is 4.", []),
        ("<think>\nmaybe " + CALL_C + "\n</think>\n\n" + CALL_P, ["python"]),
        (
            "I might call " + CALL_C + " later.</think>\n\n" + CALL_P,
            ["python"],
        ),  # opened by the prompt
        (CALL_P + "<think>\nnever closed " + CALL_C, ["python"]),
        ("<think>a</think>" + CALL_C + "<think>b" + CALL_P + "</think>", ["calculator"]),
        ("<think>\n\n</think>\n\n" + CALL_C, ["calculator"]),  # Qwen3 no-think: an empty block
    ],
)
def test_calls_inside_think_blocks_are_not_calls(text, names):
    assert [c.name for c in parse_tool_calls(text)] == names
    assert parse_tool_calls(text) == [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)]
