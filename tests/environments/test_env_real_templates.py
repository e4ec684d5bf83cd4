"""Multi-turn token exactness with the real Qwen3 and Qwen2.5 chat templates (verbatim, see
templates/README.md), on Qwen's real tokenizer (qwen/README.md) and on a small byte-level BPE
trained here (its merges span the template's markup): prompt + sampled turns + observation ids
equal the template's rendering of the whole conversation, and the sampled mask covers exactly
the assistant turns. Before the fix, Qwen3's first observation raised ("renders the turns before
an observation differently once the observation follows")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from lightrft.environments import (
    ToolEnvironment,
    calculator_tool,
    initial_prompt_ids,
    observation_ids,
    parse_tool_calls,
)
from lightrft.environments.render import transcript_ids

TEMPLATES = Path(__file__).with_name("templates")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
QUESTION = "What is 12 * 34?"


# Published Qwen2.5 encodings (token ids printed in public code and issues, e.g. vLLM and
# transformers users' prompts), which the tokenizer built from Qwen's ranks must reproduce.
PUBLISHED = {
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n": [
        151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198,
    ],
    "How many r in strawberry.": [4340, 1657, 435, 304, 72600, 13],
    "What is 2+2?": [3838, 374, 220, 17, 10, 17, 30],
    "You are a helpful and truthful assistant. You should think step-by-step.": [
        2610, 525, 264, 10950, 323, 89867, 17847, 13, 1446, 1265, 1744, 3019, 14319, 29208, 13,
    ],
    "您好, 请从 1 数到 10000000.": [
        111308, 11, 220, 14880, 45181, 220, 16, 47685, 26939, 220, 16, 15, 15, 15, 15, 15, 15,
        15, 13,
    ],
}  # fmt: skip


def test_the_qwen_tokenizer_gives_published_ids(qwen_real_tok):
    for text, ids in PUBLISHED.items():
        assert qwen_real_tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert qwen_real_tok.decode(ids) == text
    assert qwen_real_tok.convert_tokens_to_ids(["<tool_call>", "</think>"]) == [151657, 151668]


@pytest.fixture(
    params=[
        (template, kind)
        for template in ("Qwen-Qwen3-0.6B", "Qwen-Qwen2.5-7B-Instruct")
        for kind in ("qwen", "bpe")
    ],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def real(bpe_tok, qwen_real_tok, request):
    template, kind = request.param
    tok = copy.deepcopy(qwen_real_tok if kind == "qwen" else bpe_tok)
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    tok.name_or_path = template
    return tok


def _replies(tok) -> tuple[str, str]:
    """The two assistant turns as the model samples them: Qwen3 in thinking mode opens each with
    its reasoning block (the canonical form its template writes)."""
    if "Qwen3" in tok.name_or_path:
        return (
            "<think>\nI should use the tool.\n</think>\n\n" + CALL,
            "<think>\nThe tool said 408.\n</think>\n\nThe answer is 408.",
        )
    return CALL, "The answer is 408."


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_observation_then_next_turn_equals_the_whole_rendering(real):
    tools = ToolEnvironment([calculator_tool()]).schemas
    first, last = _replies(real)
    user = {"role": "user", "content": QUESTION}
    observation = [{"role": "tool", "name": "calculator", "content": "408"}]
    # what a rollout holds: prompt, sampled turn (to <|im_end|>), observation, sampled turn
    ids = initial_prompt_ids(real, [user], tools)
    ids += _ids(real, first + "<|im_end|>")
    obs = observation_ids(real, observation, tools)  # Qwen3: raised before the fix
    assert real.decode(obs).endswith("<|im_start|>assistant\n")
    ids += obs + _ids(real, last + "<|im_end|>")
    conversation = [
        user,
        {"role": "assistant", "content": first},
        *observation,
        {"role": "assistant", "content": last},
    ]
    whole = real.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert ids == _ids(real, whole.removesuffix("\n"))
    # transcript_ids (what ToolSFTDataset trains on) agrees, its mask exactly the sampled turns
    t_ids, sampled = transcript_ids(real, conversation, tools)
    assert t_ids == ids
    masked = [i for i, s in zip(t_ids, sampled, strict=True) if s]
    assert masked == _ids(real, first + "<|im_end|>") + _ids(real, last + "<|im_end|>")


def test_a_call_quoted_in_qwen3_reasoning_is_not_run(bpe_tok):
    tok = copy.deepcopy(bpe_tok)
    tok.chat_template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    text = "<think>\nShould I write " + CALL + "? No, 408 is easy.\n</think>\n\nThe answer is 408."
    assert parse_tool_calls(text) == []
    assert ToolEnvironment([calculator_tool()]).step(text).done


EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(params=["qwen", "bpe"])
def qwen3_no_think(bpe_tok, qwen_real_tok, request):
    """Qwen3's template in no-think mode, bound as ``model.chat_template_args`` binds it."""
    from lightrft.models.loading import bind_template_args

    tok = copy.deepcopy(qwen_real_tok if request.param == "qwen" else bpe_tok)
    tok.chat_template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    tok.name_or_path = "Qwen-Qwen3-0.6B"
    return bind_template_args(tok, {"enable_thinking": False}, key="model.chat_template_args")


def test_qwen3_no_think_trajectory_is_what_the_model_saw(qwen3_no_think):
    """No-think mode: every generation prompt (the first and each one after an observation)
    opens with Qwen3's empty reasoning block, and the model samples the answer after it. The
    trajectory is append-only, so it keeps that block before every sampled turn; a re-rendering
    of the finished conversation drops it from the turns before the last (the template keeps
    a turn's block only while it is last or holds reasoning). So the trajectory equals the
    whole rendering with the block restored before each earlier turn, and nothing else differs;
    the mask is exactly the sampled turns."""
    tok = qwen3_no_think
    tools = ToolEnvironment([calculator_tool()]).schemas
    user = {"role": "user", "content": QUESTION}
    observation = [{"role": "tool", "name": "calculator", "content": "408"}]
    first, last = CALL, "The answer is 408."
    prompt = initial_prompt_ids(tok, [user], tools)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    obs = observation_ids(tok, observation, tools)
    assert tok.decode(obs).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    ids = prompt + _ids(tok, first + "<|im_end|>") + obs + _ids(tok, last + "<|im_end|>")
    conversation = [
        user,
        {"role": "assistant", "content": first},
        *observation,
        {"role": "assistant", "content": last},
    ]
    whole = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    head = "<|im_start|>assistant\n"
    assert whole.count(head + EMPTY_THINK) == 1  # the last turn's only
    restored = whole.replace(head + first, head + EMPTY_THINK + first, 1)
    assert ids == _ids(tok, restored.removesuffix("\n"))
    assert ids != _ids(tok, whole.removesuffix("\n"))
    t_ids, sampled = transcript_ids(tok, conversation, tools)
    assert t_ids == ids
    masked = [i for i, s in zip(t_ids, sampled, strict=True) if s]
    assert masked == _ids(tok, first + "<|im_end|>") + _ids(tok, last + "<|im_end|>")
