"""Strict config checking: unknown keys, wrong types and bad components name their place."""

from typing import Literal

import pytest
from omegaconf import OmegaConf

from lightrft.config import Component, ConfigError, check, instantiate, load

SCHEMA = {
    "output_dir": str,
    "seed": int | None,
    "steps": int,
    "optimizer": Component,
    "model": {"path": str, "dtype": Literal["float32", "bfloat16"] | None},
    "prepare": list[Component] | None,
    "extra": dict | None,
}

YAML = """\
# lightrft run sft --config this.yaml
output_dir: /tmp/out
seed: 1
steps: 3
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-3
  weight_decay: 0.0
model:
  path: some/dir
  dtype: float32
"""


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(YAML)
    return p


def errors_of(path, overrides=(), schema=SCHEMA) -> str:
    cfg, src = load(path, list(overrides))
    with pytest.raises(ConfigError) as e:
        check(cfg, schema, src)
    return str(e.value)


def test_valid_config_passes_and_overrides_apply(cfg_file):
    cfg, src = load(cfg_file, ["steps=7", "optimizer.lr=0.5", "~seed"])
    check(cfg, SCHEMA, src)
    assert cfg.steps == 7 and cfg.optimizer.lr == 0.5 and "seed" not in cfg
    assert isinstance(cfg.optimizer.lr, float)


def test_an_override_into_a_list_reads_its_value_as_any_other(tmp_path):
    """`prepare.0.lr=1e-5` is a float as `optimizer.lr=1e-5` is (it was read by a second YAML
    loader, which takes `1e-5` for a string)."""
    p = tmp_path / "c.yaml"
    p.write_text(YAML + "prepare:\n  - _component_: torch.optim.SGD\n    lr: 0.1\n")
    cfg, _ = load(p, ["prepare.0.lr=1e-5", "optimizer.lr=1e-5", "prepare.0.momentum=None"])
    assert cfg.prepare[0].lr == cfg.optimizer.lr == 1e-5 and cfg.prepare[0].momentum is None


@pytest.mark.parametrize("null", ["null", "None", "~"])
def test_null_override_empties_a_whole_section(cfg_file, null):
    """`eval_dataset=null` means no such section (torchtune's merge alone would set only its
    `_component_` to null, and the run then failed to import 'None')."""
    cfg, src = load(cfg_file, [f"optimizer={null}", f"extra={null}"])
    assert cfg.optimizer is None and cfg.extra is None
    cfg, _ = load(cfg_file, ["optimizer=torch.optim.SGD"])  # a component path still swaps it
    assert cfg.optimizer._component_ == "torch.optim.SGD" and cfg.optimizer.lr == 1e-3


def test_unknown_top_level_key_in_yaml_names_file_line_and_suggestion(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(YAML + "stpes: 4\n")
    msg = errors_of(p)
    assert f"{p}:12: unknown key 'stpes'" in msg
    assert "did you mean 'steps'" in msg


def test_unknown_nested_key_and_component_argument(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        YAML.replace("  dtype: float32", "  dtyp: float32").replace(
            "  weight_decay: 0.0", "  betass: [0.9, 0.95]"
        )
    )
    msg = errors_of(p)
    assert f"{p}:11: unknown key 'model.dtyp'" in msg and "'dtype'" in msg
    assert f"{p}:8: unknown key 'optimizer.betass'" in msg and "'betas'" in msg


def test_typo_in_override_is_named(cfg_file):
    msg = errors_of(cfg_file, ["optimizer.lrr=0.1"])
    assert "override 'optimizer.lrr=0.1'" in msg and "did you mean 'lr'" in msg


def test_wrong_type_override_fails(cfg_file):
    msg = errors_of(cfg_file, ["optimizer.lr=abc"])
    assert "override 'optimizer.lr=abc'" in msg and "'optimizer.lr' expects float" in msg
    msg = errors_of(cfg_file, ["steps=many"])
    assert "'steps' expects int, got 'many'" in msg


def test_literal_choice_and_missing_required_key(cfg_file):
    msg = errors_of(cfg_file, ["model.dtype=float64", "~steps"])
    assert "'model.dtype' expects" in msg and "float64" in msg
    assert "missing required key 'steps'" in msg


def test_component_that_does_not_import_is_reported(cfg_file):
    msg = errors_of(cfg_file, ["optimizer._component_=torch.optim.AdamWW"])
    assert "optimizer._component_: torch.optim.AdamWW' cannot be imported" in msg


def test_list_of_components_checked(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        YAML + "prepare:\n  - _component_: lightrft.tasks.tiny.make_tiny_model\n"
        "    out_dir: x\n    layerz: 2\n"
    )
    msg = errors_of(p)
    assert f"{p}:15: unknown key 'prepare.0.layerz'" in msg and "'layers'" in msg


def test_all_problems_reported_at_once(cfg_file):
    msg = errors_of(cfg_file, ["stepz=1", "optimizer.lr=abc"])
    assert msg.count("\n") >= 2


def test_bad_override_syntax_and_missing_file(cfg_file, tmp_path):
    with pytest.raises(ConfigError, match="must be key=value"):
        load(cfg_file, ["steps"])
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.yaml")


def test_instantiate_builds_component(cfg_file):
    import torch

    cfg, _ = load(cfg_file)
    opt = instantiate(cfg.optimizer, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 1e-3


def test_section_with_only_optional_keys_may_be_absent_or_null():
    schema = {"out": str, "metrics": {"tensorboard": bool | None}, "model": {"path": str}}
    check(OmegaConf.create({"out": "x", "model": {"path": "p"}}), schema)
    check(OmegaConf.create({"out": "x", "metrics": None, "model": {"path": "p"}}), schema)
    with pytest.raises(ConfigError, match="missing required key 'model'"):
        check(OmegaConf.create({"out": "x"}), schema)
    with pytest.raises(ConfigError, match="unknown key 'metrics.tensorbord'"):
        check(
            OmegaConf.create({"out": "x", "metrics": {"tensorbord": True}, "model": {"path": "p"}}),
            schema,
        )


def test_removing_a_component_section_and_a_missing_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("a: 1\nev:\n  _component_: builtins.dict\n  x: 2\nlst: [1, 2, 3]\n")
    cfg, _ = load(p, ["~ev", "~lst.1", "a=3"])
    assert "ev" not in cfg and list(cfg.lst) == [1, 3] and cfg.a == 3
    with pytest.raises(ConfigError, match="has no key 'ev.y'"):
        load(p, ["~ev.y"])
    cfg, _ = load(p, ["lst.0=7", "ev.x=5"])
    assert list(cfg.lst) == [7, 2, 3] and cfg.ev.x == 5
    with pytest.raises(ConfigError, match="lst.5"):
        load(p, ["lst.5=1"])


def test_choice_errors_list_the_choices_and_dtype_aliases_are_accepted(capsys):
    """A choice key names its allowed values; the dtype aliases the loader accepts (fp32, bf16,
    fp16) are accepted by the schema too (one table: lightrft.models.loading.DTYPES)."""
    from lightrft import cli

    assert cli.main(["validate", "tiny/arith_grpo", "device=gpu"]) == 2
    assert "'device' expects one of 'cpu', 'cuda', got 'gpu'" in capsys.readouterr().err
    assert cli.main(["validate", "tiny/arith_grpo", "model.dtype=fp32", "engine.dtype=bf16"]) == 0
    assert cli.main(["validate", "tiny/arith_sft", "model.dtype=fp16"]) == 0
