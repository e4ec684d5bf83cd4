"""Tokenizers for the environment tests: the tiny character-level tokenizer with a chat template
that behaves like Qwen2.5-Instruct's tool-calling template (``lightrft.tasks.tiny``'s)."""

import pytest

from lightrft.tasks.tiny import TOOL_CHAT_TEMPLATE as QWEN25_TOOL_TEMPLATE


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


@pytest.fixture(scope="session")
def qwen_real_tok():
    """Qwen's real tokenizer (vocabulary, merges, added tokens; ``qwen_tokenizer.py``), no chat
    template set."""
    from qwen_tokenizer import qwen_tokenizer

    return qwen_tokenizer()
