"""The <tool_call> format: parsing a turn's calls, and probing a chat template for it."""

import pytest

from lightrft.environments import (
    ErrorKind,
    MalformedCall,
    ToolCall,
    parse_tool_calls,
    tool_call_format,
)


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
