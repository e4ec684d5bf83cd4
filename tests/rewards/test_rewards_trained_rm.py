"""A reward model trained by recipes/reward_model.py, used as a reward: several at once in a
CombinedReward (routing, weights, per-head scores, CPU offload) and served over HTTP."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from lightrft import cli
from lightrft.rewards import CombinedReward, RemoteReward, RewardModel, Sample

PROMPTS = ["apple river?", "stone lamp?", "north tiger?", "seven cloud?"]
RESPONSES = ["river apple yes", "lamp stone no", "tiger north yes", "cloud seven maybe"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two short reward-model runs: a two-head (helpful, cost) attention-pooled model and a
    one-head last-token one; returns their export directories."""
    tmp = tmp_path_factory.mktemp("trained_rm")
    recs = [
        {
            "prompt": f"q{i}?",
            "chosen": f"a{i} yes",
            "rejected": f"a{i} no",
            "head": ["helpful", "cost"][i % 2],
            "chosen_safe": True,
            "rejected_safe": False,
        }
        for i in range(32)
    ]
    (tmp / "multi.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp / "single.jsonl").write_text(
        "".join(
            json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in recs
        )
    )
    out = {}
    for name, model in (
        ("multi", {"heads": ["helpful", "cost"], "cost_heads": ["cost"], "pooling": "attention"}),
        ("single", {}),
    ):
        cfg = {
            "output_dir": str(tmp / name),
            "prepare": [
                {
                    "_component_": "lightrft.tasks.ensure_tiny_model",
                    "out_dir": str(tmp / "model"),
                    "layers": 1,
                    "hidden": 32,
                    "heads": 2,
                    "kv_heads": 1,
                }
            ],
            "model": {"path": str(tmp / "model"), **model},
            "dataset": {
                "_component_": "lightrft.data.PreferenceDataset",
                "path": str(tmp / f"{name}.jsonl"),
            },
            "eval_dataset": {
                "_component_": "lightrft.data.PreferenceDataset",
                "path": str(tmp / f"{name}.jsonl"),
            },
            "batch_size": 8,
            "epochs": 1,
            "max_steps": 2,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
            "metrics": {"tensorboard": False},
        }
        path = tmp / f"{name}.yaml"
        path.write_text("# lightrft run reward_model --config x\n" + yaml.safe_dump(cfg))
        assert cli.main(["run", "reward_model", "--config", str(path)]) == 0
        out[name] = tmp / name / "final"
    return out


def test_several_reward_models_in_one_combined_reward(trained):
    multi = RewardModel(str(trained["multi"]), score_head="helpful", offload=True)
    cost = RewardModel(str(trained["multi"]), score_head="cost")
    single = RewardModel(str(trained["single"]), micro_batch_size=2)
    combined = CombinedReward(
        {"helpful": multi, "cost": cost, "single": single},
        weights={"helpful": 1.0, "cost": -0.5, "single": 2.0},
        routes={"chat": ["helpful", "cost"], "*": ["single"]},
    )
    labels = ["chat", "chat", "other", "chat"]
    out = combined(Sample.batch(PROMPTS, RESPONSES, labels=labels))
    chat = [0, 1, 3]
    want_h = multi(Sample.batch([PROMPTS[i] for i in chat], [RESPONSES[i] for i in chat]))
    want_c = cost(Sample.batch([PROMPTS[i] for i in chat], [RESPONSES[i] for i in chat]))
    want_s = single(Sample.batch([PROMPTS[2]], [RESPONSES[2]]))
    assert torch.allclose(out.total[chat], want_h - 0.5 * want_c, atol=1e-6)
    assert torch.allclose(out.total[2:3], 2.0 * want_s, atol=1e-6)
    # Every head of a multi-head model is logged under its function's name.
    assert torch.allclose(out.heads["helpful/cost"][chat], want_c, atol=1e-6)
    assert torch.equal(out.heads["helpful/helpful"], out.parts["helpful"])
    m = out.metrics()
    assert "reward/helpful/cost/mean" in m and "reward/single/mean" in m
    assert "reward/single/reward/mean" not in m  # one head: nothing extra
    # Offloaded between calls: the weights rest on the CPU, and scores do not change.
    assert next(multi.net.parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="score_head='harmless' is not a head"):
        RewardModel(str(trained["multi"]), score_head="harmless")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_moves_to_the_gpu_only_to_score(trained):
    plain = RewardModel(str(trained["multi"]), device="cuda")
    offloaded = RewardModel(str(trained["multi"]), device="cuda", offload=True)
    assert next(offloaded.net.parameters()).device.type == "cpu"
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    scores = offloaded(Sample.batch(PROMPTS, RESPONSES))
    assert next(offloaded.net.parameters()).device.type == "cpu"
    assert torch.cuda.memory_allocated() <= before
    assert torch.allclose(scores, plain(Sample.batch(PROMPTS, RESPONSES)), atol=1e-5)


def test_a_served_trained_model_gives_the_in_process_rewards(trained):
    kwargs = {"path": str(trained["multi"]), "score_head": "cost"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lightrft.rewards.server",
            "--port",
            "0",
            "--component",
            "lightrft.rewards.RewardModel",
            "--kwargs",
            json.dumps(kwargs),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert "on http://127.0.0.1:" in line, line
        remote = RemoteReward(line.split()[-1] + "/get_reward", timeout=60, max_retries=0)
        served = torch.as_tensor(
            remote(Sample.batch(PROMPTS, RESPONSES, references=[None] * 4, labels=[None] * 4))
        )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    local = RewardModel(**kwargs)(Sample.batch(PROMPTS, RESPONSES))
    assert torch.equal(served.float(), local), (served, local)
