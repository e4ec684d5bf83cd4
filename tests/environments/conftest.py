"""Tokenizers for the environment tests: the tiny character-level tokenizer with a chat template
that behaves like Qwen2.5-Instruct's tool-calling template (written for these tests)."""

import pytest

# Qwen2.5-Instruct's tool behaviour: with tools, a system turn lists each tool's JSON schema in
# <tools></tools> and explains the <tool_call> format; an assistant's tool_calls render as
# <tool_call> blocks; consecutive tool messages share one user turn, each in <tool_response>.
QWEN25_TOOL_TEMPLATE = r"""
{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- default_system }}{%- endif %}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@pytest.fixture
def qwen_tok():
    """A character-level tokenizer (every character one token, ChatML markers special) with the
    Qwen2.5-style tool template: tokenisation is stable, so whole-conversation ids compare."""
    from lightrft.tasks.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = QWEN25_TOOL_TEMPLATE
    tok.name_or_path = "tiny-qwen2.5-tools"
    return tok


@pytest.fixture
def chatml_tok():
    """The tiny tokenizer with its plain ChatML template: no tool support."""
    from lightrft.tasks.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.name_or_path = "tiny-chatml"
    return tok


@pytest.fixture(scope="session")
def bpe_tok():
    """A byte-level BPE tokenizer (Qwen's kind: merges, ``Ċ`` for newline) trained here on the
    template's own text, with the Qwen2.5-style tool template: tokens span several characters,
    so a wrong split at a turn boundary would show."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lightrft.tasks.tiny import SPECIAL_TOKENS

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        QWEN25_TOOL_TEMPLATE,
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>',
        "<tool_response>\n408\n</tool_response>\nThe answer is 408.",
    ]
    core.train_from_iterator(corpus * 20, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = QWEN25_TOOL_TEMPLATE
    tok.name_or_path = "tiny-bpe-qwen2.5-tools"
    return tok
