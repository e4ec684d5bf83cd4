"""SFT on tool-use transcripts (``ToolSFTDataset``): the ids are the multi-turn rollout's
(prompt + sampled ids + observation ids, token for token), labels only on assistant turns,
and bad transcripts refused naming the file, line and field."""

from __future__ import annotations

import json

import pytest

from lightrft.data import DataError, SFTDataset
from lightrft.engine.protocol import Turn
from lightrft.environments import Episodes, ToolEnvironment, ToolSFTDataset, calculator_tool

QUESTION = "What is 12 * 34 + 5?"


def call(expression: str) -> str:
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(payload)}\n</tool_call>"


def structured(expression: str, as_string: bool = True) -> dict:
    """An OpenAI-style call; ``arguments`` as a JSON string, as the OpenAI API writes it."""
    arguments = {"expression": expression}
    return {
        "id": "call_0",
        "type": "function",
        "function": {
            "name": "calculator",
            "arguments": json.dumps(arguments) if as_string else arguments,
        },
    }


def trained(tok, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive loss tokens."""
    runs, run = [], []
    for t, lab in zip(ids, labels, strict=True):
        if lab != -100:
            assert lab == t
            run.append(t)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


def test_labels_cover_assistant_turns_and_their_end_tokens_only(qwen_tok):
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "First the product.\n" + call("12 * 34")},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": None, "tool_calls": [structured("408 + 5")]},
        {"role": "tool", "name": "calculator", "content": "413"},
        {"role": "assistant", "content": "The answer is 413."},
    ]
    ds = ToolSFTDataset(qwen_tok, records=[{"messages": messages, "tools": ["calculator"]}])
    item = ds[0]
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    assert trained(qwen_tok, ids, labels) == [
        "First the product.\n" + call("12 * 34") + "<|im_end|>",
        call("408 + 5") + "<|im_end|>",  # the template wrote the structured call as text
        "The answer is 413.<|im_end|>",
    ]
    text = qwen_tok.decode(ids)
    # system (with the tools), user and tool results are context only; the ids end at the
    # last turn's end token
    assert text.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools")
    assert '"name": "calculator"' in text and text.endswith("413.<|im_end|>")
    assert text.count("<tool_response>") == 2
    assert ds.stats["loss_tokens"] == sum(lab != -100 for lab in labels)


def _turn(tok, sample: int, index: int, text: str, so_far: list[int]) -> Turn:
    ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return Turn(0, sample, index, ids, [-0.5] * len(ids), so_far + ids, 10_000)


@pytest.fixture
def tiny_model_tok(tiny_model_dir):
    """The tokenizer of a tiny model directory, with the Qwen2.5-style tool template."""
    from transformers import AutoTokenizer

    from lightrft.tasks.tiny import TOOL_CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("tokenizer", ["tiny_model_tok", "bpe_tok"])
def test_a_transcript_is_tokenised_as_the_rollout_holds_it(tokenizer, request):
    """An episode played through the rollout's environment side (``Episodes``: first prompt,
    a real calculator, observation ids; the engine's turns are the texts' ids and the stop
    token), then the same conversation as an SFT record: the same ids token for token, and the
    labels exactly on the sampled ids."""
    tok = request.getfixturevalue(tokenizer)
    eps = Episodes(
        lambda: ToolEnvironment([calculator_tool()], max_turns=4), [{"prompt": QUESTION}], 1, tok
    )
    turns = [
        "I will compute it.\n" + call("12 * 34"),
        call("408 + 5") + "\n" + call("1 / 0"),  # two calls, one error: two tool messages
        "The answer is 413.",
    ]
    response: list[int] = []
    sampled: list[bool] = []
    for index, text in enumerate(turns):
        turn = _turn(tok, 0, index, text, response)
        response += turn.token_ids
        sampled += [True] * len(turn.token_ids)
        obs = eps.continuation(turn)
        if obs is None:
            break
        response += obs
        sampled += [False] * len(obs)
    episode = eps.episodes[0, 0]
    episode.final_text = episode.turns[-1].text
    record = {
        "messages": [*episode.conversation(), {"role": "assistant", "content": episode.final_text}],
        "tools": ["calculator"],
    }
    assert [m["role"] for m in record["messages"]] == [
        "user", "assistant", "tool", "assistant", "tool", "tool", "assistant"
    ]  # fmt: skip
    item = ToolSFTDataset(tok, records=[record])[0]
    prompt = eps.prompt_ids[0]
    assert item["input_ids"].tolist() == prompt + response
    loss = [lab != -100 for lab in item["labels"].tolist()]
    assert loss == [False] * len(prompt) + sampled


def test_a_json_tool_result_is_shown_as_the_environment_shows_it(qwen_tok):
    def chat(result) -> dict:
        return {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": call("2+2")},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": "4"},
            ]
        }

    ds = ToolSFTDataset(qwen_tok, records=[chat({"value": 4}), chat('{"value": 4}')])
    assert ds[0]["input_ids"].tolist() == ds[1]["input_ids"].tolist()
    with pytest.raises(DataError, match=r"messages\[2\].content must be a string"):
        ToolSFTDataset(qwen_tok, records=[chat(None)])


def test_prompt_completion_records_and_plain_chats_render_the_same_way(qwen_tok):
    tools = [calculator_tool().schema]
    as_chat = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        "tools": tools,
    }
    as_pair = {"prompt": "2+2?", "completion": "4", "tools": tools}
    ds = ToolSFTDataset(qwen_tok, records=[as_chat, as_pair, {**as_pair, "tools": None}])
    assert ds[0]["input_ids"].tolist() == ds[1]["input_ids"].tolist()
    assert "# Tools" not in qwen_tok.decode(ds[2]["input_ids"].tolist())


BAD = [
    # a tool result that no call asked for
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "no call"},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
        ["calculator"],
        "messages[2] is a tool result with no assistant tool call before it",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": call("2+2")},
            {"role": "tool", "content": "4"},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
        ["calculator"],
        "messages[3] is a tool result with no assistant tool call before it (messages[1] makes "
        "1 tool call(s), each answered already)",
    ),
    # tool-call JSON that does not parse: in the content, and as OpenAI's arguments string
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": '<tool_call>\n{"name": "calculator", "arg\n</tool_call>',
            },
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
        ["calculator"],
        "messages[1]: tool call 1 does not parse: the call is not valid JSON",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expr'}}],
            },
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
        ["calculator"],
        "messages[1].tool_calls[0].function.arguments does not parse as JSON",
    ),
    # the last turn is not the assistant's
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": call("2+2")},
            {"role": "tool", "content": "4"},
        ],
        ["calculator"],
        "the last message (messages[2], role 'tool') is not an assistant turn",
    ),
    # calls that the record's tools do not allow, and tools that do not exist
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": call("2+2").replace("calculator", "search")},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
        ["calculator"],
        "messages[1]: tool call 1 names 'search', which is not among the record's tools",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [structured(7, as_string=False)]},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"},
        ],
        ["calculator"],
        "messages[1]: tool call 1 ('calculator'): arguments.expression must be string",
    ),
    (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "4"}],
        ["calculater"],
        "tools[0]: no shipped tool is named 'calculater'",
    ),
    # an unanswered call before the next turn, and two turns with nothing between
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": call("1") + call("2")},
            {"role": "tool", "content": "1"},
            {"role": "assistant", "content": "4"},
        ],
        ["calculator"],
        "messages[1] makes 2 tool call(s) but only 1 tool message(s) answer them before messages[3]",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": "b"},
        ],
        None,
        "messages[2] follows the assistant turn messages[1] with no observation between them",
    ),
]


BAD_IDS = [
    "tool-without-call",
    "more-results-than-calls",
    "call-not-json",
    "arguments-not-json",
    "last-turn-not-assistant",
    "unknown-tool",
    "bad-arguments",
    "unknown-shipped-tool",
    "unanswered-call",
    "two-assistant-turns",
]


@pytest.mark.parametrize("messages, tools, msg", BAD, ids=BAD_IDS)
def test_bad_transcripts_are_refused_naming_file_line_and_field(
    qwen_tok, tmp_path, messages, tools, msg
):
    path = tmp_path / "train.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": messages, "tools": tools}))
    with pytest.raises(DataError) as e:
        ToolSFTDataset(qwen_tok, path)
    assert f"{path} line 2: " in str(e.value) and msg in str(e.value), str(e.value)


def test_tools_need_a_template_with_tool_support(chatml_tok):
    record = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "4"}],
        "tools": ["calculator"],
    }
    with pytest.raises(
        DataError, match=r"records\[0\]: field 'tools': .*'tiny-chatml' has no tool"
    ):
        ToolSFTDataset(chatml_tok, records=[record])


def test_the_plain_sft_dataset_points_tool_transcripts_to_the_tool_dataset(qwen_tok):
    record = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [structured("2+2")]},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"},
        ]
    }
    with pytest.raises(DataError, match=r"message 1 has tool_calls\): train on it with .*ToolSFT"):
        SFTDataset(qwen_tok, records=[record])
    with pytest.raises(DataError, match=r"field 'tools'"):
        SFTDataset(qwen_tok, records=[{"prompt": "q", "completion": "a", "tools": ["calculator"]}])


def test_shipped_tools_by_name():
    from lightrft.environments import shipped_tool

    assert [shipped_tool(n).name for n in ("calculator", "python")] == ["calculator", "python"]
    with pytest.raises(ValueError, match="the shipped tools are: calculator, python"):
        shipped_tool("search")
