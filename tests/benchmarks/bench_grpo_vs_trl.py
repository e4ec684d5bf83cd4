"""GRPO end to end, ours vs TRL's ``GRPOTrainer`` (opt-in; needs ``trl``, kept out of the system
Python: see docs/performance.md and ``tests/benchmarks/make_trl_venv.sh``)::

    tests/benchmarks/make_trl_venv.sh /tmp/trl-venv
    /tmp/trl-venv/bin/python -m pytest tests/benchmarks/bench_grpo_vs_trl.py \\
        -m benchmark_suite --benchmark-enable -s

One GRPO configuration, both sides on the same CPU in one run: the same tiny local model
(``lightrft.tasks.make_tiny_model``), the same chat prompts (2-digit additions under a system
prompt), group size, completion length, sampling (T=1, no top-p / top-k), token-mean loss
(TRL ``loss_type="dapo"``, ours ``agg: token_mean``), no KL (so no reference model), fp32, no
activation checkpointing, micro-batches of 16 with one optimizer step per generation batch, and
the same number of steps. Ours runs ``recipes/grpo.py`` through the real CLI; TRL runs
``GRPOTrainer`` with ``use_vllm=False`` (HF ``generate``). Each side runs in its own process (its
peak RSS is its own); rounds alternate ours / TRL so load from other processes hits both alike.

Reported: end-to-end tokens/s per step (prompt + completion tokens of the step / the step's wall
time; the first step is a warm-up and excluded), the ratio ours / TRL, our per-phase seconds from
``metrics.jsonl``, and peak RSS of each process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightrft.rewards import Sample

pytestmark = pytest.mark.benchmark_suite

STEPS = int(os.environ.get("BENCH_GRPO_STEPS", "6"))  # the first is a warm-up
ROUNDS = int(os.environ.get("BENCH_GRPO_ROUNDS", "2"))  # ours, TRL, ours, TRL, ...
# Intra-op threads of each side. 1 by default: on a shared 2-core machine a 2-thread op waits for
# its second thread to be scheduled (measured: a [64, 256] x [256, 256] matmul took 5 ms with 2
# threads under load, 0.25 ms with 1), which would time the scheduler rather than either trainer.
THREADS = int(os.environ.get("BENCH_GRPO_THREADS", "1"))
PROMPTS, GROUP, MAX_TOKENS, MICRO = 8, 8, 128, 16
LR, SEED = 1e-6, 0
SYSTEM = "Add the two numbers. Reply with the sum only, as digits."
MODEL = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "max_positions": 512}
# Our recipe's default (padded micro-batches). Packed rows are slower here: with SDPA the
# block-diagonal mask makes attention quadratic in the packed row length (see docs/performance.md).
PACKING = os.environ.get("BENCH_GRPO_PACKING", "0") == "1"
# "char": the tests' 112-token character vocabulary (the LM head is negligible); "bpe": a 32,768-token
# byte-level BPE trained here (realistic_vocab.py), so the LM head weighs as in real models.
VOCAB = os.environ.get("BENCH_GRPO_VOCAB", "char")
PHASES = ("rollout", "scoring", "old_logprobs", "reference", "training", "weight_sync")


# ---------------------------------------------------------------------------------- assets


def make_assets(root: Path) -> tuple[Path, Path]:
    """The tiny model and a JSONL of chat prompts with reference answers."""
    from lightrft.tasks import arith_records, make_tiny_model

    model = make_tiny_model(root / "model", seed=SEED, **MODEL)
    if VOCAB == "bpe":
        model = _with_bpe_vocab(model)
    elif VOCAB != "char":
        raise ValueError(f"BENCH_GRPO_VOCAB must be 'char' or 'bpe', got {VOCAB!r}")
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for r in arith_records(512, digits=2, seed=SEED):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": r["prompt"]},
            ]
            f.write(json.dumps({"prompt": messages, "answer": r["answer"], "label": "arith"}))
            f.write("\n")
    return model, prompts


def _with_bpe_vocab(model: Path) -> Path:
    """The same architecture with a 32k BPE tokenizer and a matching (random) embedding / head."""
    import torch
    from realistic_vocab import gsm8k_texts, train_bpe  # this folder (sys.path[0] of the worker)
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_bpe(gsm8k_texts())
    cfg = AutoConfig.from_pretrained(model)
    cfg.vocab_size = len(tokenizer)
    cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    cfg.bos_token_id = None
    torch.manual_seed(SEED)
    out = model.parent / "model_bpe"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------- workers


def run_ours(model: Path, prompts: Path, out: Path) -> dict:
    """``lightrft run grpo`` in-process; returns the per-step rows of its metrics.jsonl."""
    import yaml

    from lightrft import cli
    from lightrft.training import read_metrics

    cfg = {
        "output_dir": str(out / "run"),
        "seed": SEED,
        "device": "cpu",
        "model": {"path": str(model), "dtype": "float32"},
        "dataset": {"_component_": "lightrft.data.PromptDataset", "path": str(prompts)},
        "reward": {
            "_component_": "lightrft.rewards.CombinedReward",
            "functions": {"accuracy": {"_component_": "lightrft.rewards.MathVerifier"}},
        },
        "engine": {"max_num_seqs": PROMPTS * GROUP},
        "rollout": {
            "prompts_per_step": PROMPTS,
            "n": GROUP,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
        },
        "algorithm": {
            "advantage": {"estimator": "grpo"},
            "policy_loss": {
                "objective": "ppo",
                "clip_low": 0.2,
                "clip_high": 0.2,
                "agg": "token_mean",
            },
        },
        "train": {"ppo_epochs": 1, "micro_batch_size": MICRO, "packing": PACKING},
        "max_steps": STEPS,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": LR, "weight_decay": 0.0},
        "clip_grad_norm": 1.0,
        "log_every": 1,
        "metrics": {"tensorboard": False},
    }
    path = out / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    assert cli.main(["run", "grpo", "--config", str(path)]) == 0
    rows = [r for r in read_metrics(out / "run") if "time/step" in r]
    steps = []
    for r in rows:
        tokens = r["perf/tokens_per_s"] * r["time/step"]
        steps.append(
            {
                "seconds": r["time/step"],
                "tokens": tokens,
                "completion_tokens": r["rollout/response_length/mean"] * r["rollout/samples"],
                "phases": {p: r.get(f"time/{p}", 0.0) for p in PHASES},
            }
        )
    return {"steps": steps}


def run_trl(model: Path, prompts: Path, out: Path) -> dict:
    """TRL's ``GRPOTrainer`` on the same model and prompts; per-step seconds from callbacks."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightrft.models import load_tokenizer
    from lightrft.rewards import MathVerifier

    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    verifier = MathVerifier()

    def accuracy(prompts, completions, answer, **kwargs):  # the same verifier as ours
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return verifier(Sample.batch(prompts, texts, references=answer))

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(out / "run"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=SEED,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO,  # one optimizer step per batch
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        loss_type="dapo",  # token mean over the whole batch, like our agg=token_mean
        scale_rewards="group",
        beta=0.0,  # no KL, no reference model (as ours without an algorithm.kl section)
        epsilon=0.2,
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=STEPS,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_vllm=False,
        dataloader_num_workers=0,
    )
    policy = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    clock = Clock()
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=accuracy,
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(model),
        callbacks=[clock],
    )
    # TRL's rollout: time every call of its generation function (HF `generate` here).
    generate, calls = trainer._generate_single_turn, []

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = generate(*a, **k)
        calls.append((t0, time.perf_counter() - t0))
        return out

    trainer._generate_single_turn = timed_generate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "num_tokens" in h]
    seen = [h["num_tokens"] for h in logs]  # cumulative prompt + completion tokens
    tokens = [b - a for a, b in zip([0.0, *seen[:-1]], seen, strict=True)]
    steps = [
        {
            "seconds": e - b,
            "tokens": t,
            "completion_tokens": h["completions/mean_length"] * PROMPTS * GROUP,
            "phases": {"generation": sum(d for t0, d in calls if b <= t0 < e)},
        }
        for b, e, t, h in zip(clock.begin, clock.end, tokens, logs, strict=True)
    ]
    return {"steps": steps}


def _worker(side: str, model: str, prompts: str, out: str) -> None:
    import torch

    torch.set_num_threads(THREADS)
    fn = {"ours": run_ours, "trl": run_trl}[side]
    result = fn(Path(model), Path(prompts), Path(out))
    (Path(out) / "result.json").write_text(json.dumps(result))


def run_side(side: str, model: Path, prompts: Path, out: Path) -> dict:
    """One side in a fresh process; adds its wall time and peak RSS (GiB, from wait4)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(THREADS),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, __file__, side, str(model), str(prompts), str(out)],
        env=env,
        stdout=open(out / "log.txt", "w"),
        stderr=subprocess.STDOUT,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = (out / "log.txt").read_text()[-4000:]
        raise RuntimeError(f"{side} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads((out / "result.json").read_text())
    result["process_seconds"] = time.perf_counter() - t0
    result["peak_rss_gib"] = usage.ru_maxrss * 1024 / 2**30  # Linux: KiB
    return result


# ---------------------------------------------------------------------------------- report


def summarize(results: dict[str, list[dict]]) -> dict:
    """Per side: tokens/s of every measured step (warm-up excluded) over all rounds."""
    out: dict = {}
    for side, runs in results.items():
        steps = [s for r in runs for s in r["steps"][1:]]
        rates = [s["tokens"] / s["seconds"] for s in steps]
        out[side] = {
            "tokens_per_s_median": statistics.median(rates),
            "step_seconds_median": statistics.median(s["seconds"] for s in steps),
            "tokens_per_step_mean": statistics.fmean(s["tokens"] for s in steps),
            "completion_tokens_per_step_mean": statistics.fmean(
                s["completion_tokens"] for s in steps
            ),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in runs),
            "process_seconds": [round(r["process_seconds"], 1) for r in runs],
            "measured_steps": len(steps),
        }
        out[side]["phases_median"] = {
            p: statistics.median(s["phases"][p] for s in steps) for p in steps[0]["phases"]
        }
    # Per round: ours / TRL of the median tokens/s of that round's measured steps.
    per_round = []
    for a, b in zip(results["ours"], results["trl"], strict=True):
        ra = statistics.median(s["tokens"] / s["seconds"] for s in a["steps"][1:])
        rb = statistics.median(s["tokens"] / s["seconds"] for s in b["steps"][1:])
        per_round.append(ra / rb)
    out["ratio"] = out["ours"]["tokens_per_s_median"] / out["trl"]["tokens_per_s_median"]
    out["ratio_per_round"] = per_round
    return out


def table(s: dict) -> str:
    o, t = s["ours"], s["trl"]
    lines = [
        f"\nGRPO step ({VOCAB} vocabulary), {PROMPTS} prompts x {GROUP} samples, <= {MAX_TOKENS} new tokens, "
        f"micro-batch {MICRO}, {STEPS} steps x {ROUNDS} rounds (first step of each excluded), "
        f"{THREADS} thread(s) per side",
        "| | LightRFT | TRL GRPOTrainer |",
        "|---|---|---|",
        f"| tokens/s per step (median) | {o['tokens_per_s_median']:.0f} | "
        f"{t['tokens_per_s_median']:.0f} |",
        f"| seconds per step (median) | {o['step_seconds_median']:.2f} | "
        f"{t['step_seconds_median']:.2f} |",
        f"| tokens per step (prompt + completion, mean) | {o['tokens_per_step_mean']:.0f} | "
        f"{t['tokens_per_step_mean']:.0f} |",
        f"| completion tokens per step (mean) | {o['completion_tokens_per_step_mean']:.0f} | "
        f"{t['completion_tokens_per_step_mean']:.0f} |",
        f"| peak RSS of the process | {o['peak_rss_gib']:.2f} GiB | {t['peak_rss_gib']:.2f} GiB |",
        f"| process wall time per round (s) | {o['process_seconds']} | {t['process_seconds']} |",
        f"| **ratio ours / TRL, tokens/s** | **{s['ratio']:.2f}x** | per round: "
        + ", ".join(f"{r:.2f}" for r in s["ratio_per_round"])
        + " |",
        "",
        "Our phases (median seconds per step): "
        + ", ".join(f"{k} {v:.3f}" for k, v in o["phases_median"].items()),
        "TRL (median seconds per step): "
        + ", ".join(f"{k} {v:.3f}" for k, v in t["phases_median"].items())
        + f", everything else {t['step_seconds_median'] - t['phases_median']['generation']:.3f}",
    ]
    return "\n".join(lines)


def test_grpo_vs_trl(benchmark, tmp_path_factory):
    pytest.importorskip(
        "trl",
        reason="TRL is not installed in this Python: run the benchmark from the venv made by "
        "tests/benchmarks/make_trl_venv.sh (never install trl into the system Python)",
    )
    root = tmp_path_factory.mktemp("grpo_vs_trl")
    model, prompts = make_assets(root)
    results: dict[str, list[dict]] = {"ours": [], "trl": []}

    def rounds() -> None:
        for i in range(ROUNDS):
            for side in ("ours", "trl"):
                results[side].append(run_side(side, model, prompts, root / f"{side}{i}"))

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    summary = summarize(results)
    benchmark.extra_info.update(summary)
    (root / "summary.json").write_text(json.dumps({"summary": summary, "raw": results}, indent=1))
    print(table(summary))
    print(f"raw results: {root / 'summary.json'}")
    for side in ("ours", "trl"):
        assert summary[side]["measured_steps"] == ROUNDS * (STEPS - 1)
        assert summary[side]["tokens_per_s_median"] > 0


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
