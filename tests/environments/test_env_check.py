"""check_environment: the environment: section's rules that need the checkpoint, shared by the
GRPO and eval recipes (their CLI refusals are in tests/recipes)."""

import json

import pytest

from lightrft.environments import check_environment

TOOLS = {
    "_component_": "lightrft.environments.ToolEnvironment",
    "tools": [{"_component_": "lightrft.environments.calculator_tool"}],
}


def _checkpoint(path, tok, **config):
    """A checkpoint directory as far as the check reads it: config.json and the tokenizer."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    tok.save_pretrained(path)
    return str(path)


def test_a_text_model_whose_template_renders_tools_passes(tmp_path, qwen_tok):
    check_environment(TOOLS, _checkpoint(tmp_path / "m", qwen_tok))


def test_tools_need_a_template_with_tool_support(tmp_path, chatml_tok):
    path = _checkpoint(tmp_path / "m", chatml_tok)
    with pytest.raises(ValueError, match=r"^environment\.tools: .*tool"):
        check_environment(TOOLS, path)
    # Without tools there is nothing for the template to render: an environment of user turns.
    check_environment({"_component_": "my.Env"}, path)


@pytest.mark.parametrize("tower", ["vision_config", "audio_config"])
def test_a_multimodal_model_is_refused(tmp_path, qwen_tok, tower):
    path = _checkpoint(tmp_path / "m", qwen_tok, **{tower: {}})
    with pytest.raises(ValueError, match=r"^environment: multi-turn rollouts take a text model"):
        check_environment({"_component_": "my.Env"}, path)


def test_nothing_to_check_without_a_section_or_a_local_checkpoint(tmp_path, chatml_tok):
    check_environment(None, _checkpoint(tmp_path / "m", chatml_tok))
    # A hub id, or a directory a prepare step writes: the recipes check again in setup.
    check_environment(TOOLS, str(tmp_path / "not-yet"))


def test_the_cli_writes_a_tiny_tool_model_that_passes(tmp_path, capsys):
    """`lightrft tiny-model --chat-template tools` is how a user makes a model to try tools on."""
    from lightrft import cli
    from lightrft.tasks.tiny import CHAT_TEMPLATES

    assert set(cli.CHAT_TEMPLATE_NAMES) == set(CHAT_TEMPLATES)  # the CLI's list is current
    out = tmp_path / "m"
    assert cli.main(["tiny-model", "--out", str(out), "--chat-template", "compact_tools"]) == 0
    check_environment(TOOLS, str(out))
    assert cli.main(["tiny-model", "--out", str(tmp_path / "plain"), "--layers", "1"]) == 0
    with pytest.raises(ValueError, match=r"^environment\.tools: .*tool"):
        check_environment(TOOLS, str(tmp_path / "plain"))
