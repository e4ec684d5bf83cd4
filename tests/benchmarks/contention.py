"""How much a LightRFT run slows down when another process keeps the CPU busy.

    python tests/benchmarks/contention.py [--steps 40] [--spinners 1] [--workdir DIR]

Runs the README demo's GRPO step (configs/tiny/add_grpo, from a 20-step SFT warm start made here)
alone and beside ``--spinners`` CPU-bound processes (``while True: pass``), once with LightRFT's
default OpenMP wait policy (PASSIVE, set by the ``lightrft`` command) and once with
``OMP_WAIT_POLICY=ACTIVE`` (libgomp's spinning, the behaviour before that default), and prints the
median ``time/step`` of each and the slowdown ratio. Settings alternate so drift hits both alike.
Not part of the test suite: it takes a few minutes and needs an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {"default (PASSIVE)": {}, "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}}


def _lightrft(args: list[str], cwd: Path, extra_env: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra_env)
    subprocess.run(
        [sys.executable, "-m", "lightrft", *args],
        cwd=cwd,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _median_step_time(metrics: Path, skip: int) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["time/step"] for r in rows if "time/step" in r]
    return statistics.median(times[skip:])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--spinners", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lightrft-contention-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "outputs/tiny/add_sft/final").exists():
        _lightrft(
            [
                "run",
                "sft",
                "--config",
                "tiny/add_sft",
                "max_steps=20",
                "~eval_dataset",
                "lr_scheduler.warmup_steps=0",
                "save_every=1000",
            ],
            work,
            {},
        )
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[tuple[str, int], float] = {}
    for spinners in (0, args.spinners):
        for name, env in SETTINGS.items():
            procs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(spinners)
            ]
            try:
                out = work / f"run-{spinners}-{len(results)}"
                _lightrft(
                    [
                        "run",
                        "grpo",
                        "--config",
                        "tiny/add_grpo",
                        f"max_steps={args.steps}",
                        "log_every=1",
                        "~eval",
                        "~eval_dataset",
                        f"output_dir={out}",
                        "save_every=100000",
                        "lr_scheduler.warmup_steps=0",
                        "overwrite=true",
                        # every step trains: the 20-step warm start is rarely right, and
                        # dynamic sampling would skip the update on most steps
                        "~algorithm.shaping",
                    ],
                    work,
                    env,
                )
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            results[(name, spinners)] = _median_step_time(out / "metrics.jsonl", skip=3)
            print(
                f"{name:24s} spinners={spinners}: {results[(name, spinners)] * 1e3:7.1f} ms/step",
                flush=True,
            )
    print("\nsetting                   alone (ms)  beside (ms)  slowdown")
    for name in SETTINGS:
        alone, busy = results[(name, 0)], results[(name, args.spinners)]
        print(f"{name:24s}  {alone * 1e3:10.1f}  {busy * 1e3:11.1f}  {busy / alone:7.2f}x")


if __name__ == "__main__":
    main()
