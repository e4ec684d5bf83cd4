"""The eval recipe through the CLI on a tiny model: outputs, and 1 vs 2 processes."""

import json
from pathlib import Path

import pytest
import yaml
from _dist import build_recipe, run_distributed

from lightrft import cli


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("eval_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=4, n_test=6, digits=1)
    return root


def _config(tmp: Path, assets: Path, out: str, **sampling) -> Path:
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


def test_config_errors_before_loading(tmp_path, assets):
    cfg = _config(tmp_path, assets, "bad", n=2)  # n > 1 with greedy decoding
    assert cli.main(["run", "eval", "--config", str(cfg)]) == 2
    cfg = _config(tmp_path, assets, "bad2")
    assert cli.main(["run", "eval", "--config", str(cfg), "ks=[2]"]) == 2


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
