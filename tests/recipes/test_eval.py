"""The eval recipe through the CLI on a tiny model: outputs, 1 vs 2 processes, and an
``environment:`` (multi-turn episodes with a calculator) with its refusals."""

import copy
import json
from pathlib import Path

import pytest
import yaml
from _dist import build_recipe, run_distributed
from test_grpo_environment import ENV

from lightrft import cli
from lightrft.environments import ErrorKind


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("eval_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=4, n_test=6, digits=1)
    return root


@pytest.fixture(scope="module")
def tool_model(assets) -> Path:
    """A tiny model whose chat template renders tools (Qwen2.5's Hermes format), with room
    for the tools' system block and a few turns."""
    from transformers import AutoTokenizer

    from lightrft.tasks import make_tiny_model
    from lightrft.tasks.tiny import TOOL_CHAT_TEMPLATE

    path = make_tiny_model(
        assets / "tools", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=1024
    )
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def _config(tmp: Path, assets: Path, out: str, top: dict | None = None, **sampling) -> Path:
    """The eval config; ``top``: top-level keys to add or replace (model, environment, ...)."""
    cfg = {
        "output_dir": str(tmp / out),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(assets / "model")},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(assets / "data" / "test.jsonl"),
        },
        "reward": {
            "_component_": "lightrft.rewards.CombinedReward",
            "functions": {"accuracy": {"_component_": "lightrft.rewards.GSM8KVerifier"}},
        },
        "sampling": {"n": 1, "temperature": 0.0, "max_tokens": 4, **sampling},
        **(top or {}),
    }
    path = tmp / f"{out}.yaml"
    path.write_text("# lightrft run eval --config eval.yaml\n" + yaml.safe_dump(cfg))
    return path


def test_eval_writes_samples_summary_and_table(tmp_path, assets, capsys):
    cfg = _config(tmp_path, assets, "out", n=4, temperature=1.0)
    assert cli.main(["run", "eval", "--config", str(cfg), "ks=[1,2,4]"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["prompts"] == 6 and summary["samples_per_prompt"] == 4
    for key in ("pass@1", "pass@2", "pass@4", "maj@4", "mean@4", "reward", "response_length"):
        assert 0 <= summary[key] <= (4 if key == "response_length" else 1), key
    assert summary["pass@1"] <= summary["pass@2"] <= summary["pass@4"]
    rows = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    assert all(len(r["samples"]) == len(r["answers"]) == len(r["rewards"]) == 4 for r in rows)
    assert "pass@4" in capsys.readouterr().out


def test_config_errors_before_loading(tmp_path, assets, capsys):
    cfg = _config(tmp_path, assets, "bad", n=2)  # n > 1 with greedy decoding
    assert cli.main(["run", "eval", "--config", str(cfg)]) == 2
    cfg = _config(tmp_path, assets, "bad2")
    assert cli.main(["run", "eval", "--config", str(cfg), "ks=[2]"]) == 2
    capsys.readouterr()
    assert cli.main(["run", "eval", "--config", str(cfg), "engine.backend=sglang"]) == 2
    assert "engine.backend=sglang runs on CUDA GPUs only" in capsys.readouterr().err


def _two_rank_eval(rank: int, world_size: int, cfg_path: str) -> None:

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("eval", cfg)
    recipe.setup(cfg)
    recipe.run()  # no cleanup(): the harness destroys the process group


def test_one_and_two_processes_give_the_same_summary(tmp_path, assets):
    one = _config(tmp_path, assets, "one")
    assert cli.main(["run", "eval", "--config", str(one)]) == 0
    two = _config(tmp_path, assets, "two")
    run_distributed(_two_rank_eval, str(two), world_size=2)
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s1 == s2
    r1 = (tmp_path / "one" / "samples.jsonl").read_text()
    assert r1 == (tmp_path / "two" / "samples.jsonl").read_text()


def test_eval_with_an_environment_scores_final_answers_and_reports_env_metrics(
    tmp_path, assets, tool_model
):
    """Each sample is an episode of the calculator environment GRPO's tests play (a fixed
    calculator call for the model's first turn, then one more turn): the final answers are
    scored and voted on, the summary has the env/* metrics, the records every turn."""
    top = {
        "model": {"path": str(tool_model)},
        "environment": copy.deepcopy(ENV),
        "max_prompts": 4,
        "ks": [1, 2],
    }
    cfg = _config(tmp_path, assets, "env", top, n=2, temperature=1.0, max_tokens=200)
    assert cli.main(["run", "eval", "--config", str(cfg)]) == 0
    summary = json.loads((tmp_path / "env" / "summary.json").read_text())
    assert summary["prompts"] == 4 and summary["samples_per_prompt"] == 2
    for key in ("pass@1", "pass@2", "maj@2", "mean@2", "env/tool_use_frac", "env/truncated"):
        assert 0 <= summary[key] <= 1, key
    # A first turn that stops (a random model mostly does within 200 tokens) gets "408".
    assert summary["env/tool_calls"] > 0 and summary["env/tool_use_frac"] > 0
    assert summary["env/turns"] > 1 and 0 < summary["env/observation_token_frac"] < 1
    assert all(summary[f"env/errors/{kind}"] == 0 for kind in ErrorKind)
    rows = [json.loads(x) for x in (tmp_path / "env" / "samples.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(4))
    played = 0
    for row in rows:
        assert len(row["episodes"]) == len(row["samples"]) == 2
        for sample, episode in zip(row["samples"], row["episodes"], strict=True):
            assert sample == episode["final_text"]  # what was scored: the last turn only
            assert "<tool_response>" not in sample
            assert episode["messages"][-1]["role"] == "user"
            if episode["stats"]["tool_calls"]:
                played += 1
                first = episode["turns"][0]
                assert first["tool_calls"] == 1 and first["errors"] == {}
                assert first["observation"] == [
                    {"role": "tool", "name": "calculator", "content": "408"}
                ]
                assert first["observation_ids"] and first["token_ids"]
    assert played == round(summary["env/tool_use_frac"] * 8)


@pytest.mark.parametrize(
    "top, msg",
    [
        ({}, "environment.tools"),  # the 64-position model's template renders no tools
        ({"environment.max_turns": 0}, "environment.max_turns"),
    ],
)
def test_an_environment_is_refused_before_any_model_loads(tmp_path, assets, capsys, top, msg):
    env = copy.deepcopy(ENV)
    env.update({k.split(".", 1)[1]: v for k, v in top.items()})
    cfg = _config(tmp_path, assets, "refused", {"environment": env})
    assert cli.main(["run", "eval", "--config", str(cfg)]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
