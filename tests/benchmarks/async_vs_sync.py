"""Asynchronous (one-step-off) against synchronous GRPO on the README's text demo, side by side
(issue 27 item 3): wall time and held-out greedy accuracy of each, one thread per process.

    python tests/benchmarks/async_vs_sync.py [--seed 0] [--quick] [--out async_vs_sync.json]
        [--grpo KEY=VALUE ...]   # a variant: overrides for both GRPO runs

In a scratch directory, through the real CLI: ``lightrft run sft --config tiny/add_sft`` once,
then from its model

- sync:  ``lightrft run grpo --config tiny/add_grpo`` (one process: rollout, then training);
- async: ``lightrft run --nproc_per_node 2 grpo --config tiny/add_grpo rollout.asynchronous=true
  algorithm.old_logprobs=engine`` (one process trains, the other generates the next step's
  samples meanwhile; the ratio's denominator is the generating policy's log-prob).

Every process runs with ``OMP_NUM_THREADS=1``. Prints each run's wall time, the async/sync ratio,
the held-out accuracy at every eval step of both runs, and the load average before and after
(the machine may be shared: compare numbers from one invocation only). ``--quick`` cuts the data
and steps for a minutes-long smoke check (its accuracies mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ASYNC = ["rollout.asynchronous=true", "algorithm.old_logprobs=engine"]
QUICK_SFT = ["prepare.1.n_train=64", "prepare.1.n_test=8", "max_steps=3", "eval_every=3"]
QUICK_SFT += ["lr_scheduler.warmup_steps=0"]
QUICK_GRPO = ["max_steps=4", "eval.every=2", "rollout.prompts_per_step=4", "rollout.n=4"]
QUICK_GRPO += ["lr_scheduler.warmup_steps=0"]


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _lightrft(args: list[str], cwd: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lightrft", *args]
    print("$ " + " ".join(cmd[2:]), flush=True)
    start = time.monotonic()
    subprocess.run(cmd, cwd=cwd, check=True, env=env)
    return time.monotonic() - start


def _evals(path: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def _lags(path: Path) -> list[float]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r["rollout/policy_lag"] for r in rows if "rollout/policy_lag" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="cut data and steps (a smoke check)")
    p.add_argument("--out", help="write the numbers as JSON here")
    p.add_argument(
        "--grpo",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for both GRPO runs (a variant of the demo; repeatable)",
    )
    a = p.parse_args()
    common = ["metrics.tensorboard=false", f"seed={a.seed}"]
    grpo = ["grpo", "--config", "tiny/add_grpo", *common, *(QUICK_GRPO if a.quick else [])]
    grpo += a.grpo
    with tempfile.TemporaryDirectory() as tmp:
        load_before = _load()
        sft = _lightrft(
            ["run", "sft", "--config", "tiny/add_sft", *common] + (QUICK_SFT if a.quick else []),
            tmp,
        )
        runs = {
            "sync": ["run", *grpo, "output_dir=outputs/tiny/add_grpo_sync"],
            "async": [
                "run", "--nproc_per_node", "2", *grpo, *ASYNC,
                "output_dir=outputs/tiny/add_grpo_async",
            ],
        }  # fmt: skip
        seconds = {name: _lightrft(args, tmp) for name, args in runs.items()}
        load_after = _load()
        evals = {n: _evals(Path(tmp) / f"outputs/tiny/add_grpo_{n}/metrics.jsonl") for n in runs}
        lags = _lags(Path(tmp) / "outputs/tiny/add_grpo_async/metrics.jsonl")
    ratio = seconds["async"] / seconds["sync"]
    final = {n: e[-1][1] for n, e in evals.items()}
    print(f"\nload average (1, 5, 15 min): before {load_before}, after {load_after}")
    print(f"sft: {sft:.0f} s")
    print("step  sync acc  async acc")
    for (step, s), (_, x) in zip(evals["sync"], evals["async"], strict=True):
        print(f"{step:4d}  {100 * s:7.1f}%  {100 * x:8.1f}%")
    print(f"wall time: sync {seconds['sync']:.0f} s, async {seconds['async']:.0f} s ({ratio:.2f}x)")
    gap = 100 * (final["async"] - final["sync"])
    print(f"final held-out accuracy: sync {100 * final['sync']:.1f}%, async "
          f"{100 * final['async']:.1f}% ({gap:+.1f} points); async policy lag max "
          f"{max(lags):.0f} over {len(lags)} logged steps")  # fmt: skip
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "seconds": seconds,
                    "ratio": ratio,
                    "evals": evals,
                    "load_before": load_before,
                    "load_after": load_after,
                    "seed": a.seed,
                    "quick": a.quick,
                    "grpo_overrides": a.grpo,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
