"""``model.chat_template_args``: the template's own variables, bound to every render of the
tokenizer (Qwen3's ``enable_thinking``), refused by name where they would do nothing or would
override what the library sets."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from lightrft.data.templates import encode_prompt
from lightrft.models.loading import bind_template_args, load_tokenizer
from lightrft.tasks.tiny import char_tokenizer

TEMPLATES = Path(__file__).parents[1] / "environments" / "templates"
KEY = "model.chat_template_args"


@pytest.fixture
def qwen3_tok():
    tok = char_tokenizer()
    tok.chat_template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    tok.name_or_path = "qwen3-template"
    return tok


def test_every_render_passes_the_arguments(qwen3_tok):
    think = encode_prompt(qwen3_tok, "2+2?")[0]
    bound = bind_template_args(copy.deepcopy(qwen3_tok), {"enable_thinking": False}, key=KEY)
    no_think = encode_prompt(bound, "2+2?")[0]
    assert think.endswith("<|im_start|>assistant\n")
    assert no_think == think + "<think>\n\n</think>\n\n"
    # an explicit argument at a call still wins over the bound one
    again = bound.apply_chat_template(
        [{"role": "user", "content": "2+2?"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=True,
    )
    assert again == think


def test_a_variable_the_template_never_reads_is_refused():
    tok = char_tokenizer()  # plain ChatML: no thinking mode
    tok.name_or_path = "tiny-chatml"
    with pytest.raises(
        ValueError, match=r"model.chat_template_args.enable_thinking: .*never reads"
    ):
        bind_template_args(tok, {"enable_thinking": False}, key=KEY)


@pytest.mark.parametrize("name", ["add_generation_prompt", "tools", "tokenize"])
def test_what_the_library_sets_is_refused(qwen3_tok, name):
    with pytest.raises(ValueError, match=rf"model.chat_template_args.{name}: the library sets"):
        bind_template_args(qwen3_tok, {name: True}, key=KEY)


def test_load_tokenizer_binds_and_the_saved_tokenizer_stays_stock(qwen3_tok, tmp_path):
    qwen3_tok.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok", template_args={"enable_thinking": False})
    assert encode_prompt(tok, "hi")[0].endswith("<think>\n\n</think>\n\n")
    tok.save_pretrained(tmp_path / "again")
    assert encode_prompt(load_tokenizer(tmp_path / "again"), "hi")[0].endswith("assistant\n")
