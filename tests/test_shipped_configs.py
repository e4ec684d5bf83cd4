"""Every shipped config (configs/**/*.yaml) validates against its recipe, in-process, through the
real `lightrft validate` (keys, types and `_component_` signatures; no model is loaded)."""

from __future__ import annotations

import pytest
import yaml

from lightrft import cli

CONFIGS = cli.list_configs()


def test_configs_are_shipped():
    assert any(name.startswith("qwen2_5/") for name in CONFIGS), sorted(CONFIGS)
    assert len(CONFIGS) >= 5, sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config_validates(name, capsys):
    rc = cli.main(["validate", name])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "valid config for recipe" in out.out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config_opens_with_its_own_launch_command(name):
    path = CONFIGS[name]
    first = path.read_text().splitlines()[0]
    recipe = cli.recipe_of_config(path)
    assert recipe in cli.list_recipes(), (name, first)
    # The launch line names this very config, so copying it from the file runs the file.
    assert first.split("--config", 1)[1].split()[0] == name, first


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if n.startswith("qwen2_5/")))
def test_qwen_engine_matches_the_file_name(name):
    engine = yaml.safe_load(CONFIGS[name].read_text()).get("engine") or {}
    assert engine.get("backend", "native") == ("vllm" if name.endswith("_vllm") else "native")
