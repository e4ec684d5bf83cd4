"""Run the README's CPU demo chains (text, vision, audio, both RLHF chains, the tool-use chain with
its no-tool control, DPO, distillation, and the text demo's asynchronous and partial-rollout runs)
and keep their metric rows, to prove that a refactor
changes no number: every ``train/*``, ``reward/*``, ``eval/*`` (and ``critic/*``, ``data/*``)
value of every logged row, per run, compared exactly.

    python tests/benchmarks/demo_rows.py run  --out /tmp/before.json [--quick]
    python tests/benchmarks/demo_rows.py diff /tmp/before.json /tmp/after.json

and to check the README's learning figures over seeds (every command gets ``seed=N``):

    python tests/benchmarks/demo_rows.py run --seed 1 --out /tmp/seed1.json
    python tests/benchmarks/demo_rows.py figures /tmp/seed0.json /tmp/seed1.json /tmp/seed2.json

``run`` executes the chains in a scratch directory through the real CLI (the README's commands;
``--quick`` cuts the data and steps as tests/test_demos.py does, for a minutes-long check).
Times, throughputs (``train/tokens_per_s``...) and memory are left out: they are not behaviour.
Bitwise equality holds on one machine (CPU kernels sum in different orders on others), so
compare runs made on the same machine.
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

# The five chains, grouped by the SFT model they start from (one SFT run serves two chains).
CHAINS = {
    "text": [
        ("sft", "tiny/add_sft"),
        ("grpo", "tiny/add_grpo"),
        ("reward_model", "tiny/rlhf_rm"),
        ("grpo", "tiny/rlhf_grpo"),
        # DPO and distillation (the GRPO model above is the teacher) from the same SFT
        # model; then the text GRPO demo asynchronous (docs/grpo.md's command) and with partial
        # rollouts, each into its own directory.
        ("dpo", "tiny/add_dpo"),
        ("grpo", "tiny/add_distill"),
        (
            "--nproc_per_node 2 grpo",
            "tiny/add_grpo",
            "rollout.asynchronous=true",
            "algorithm.old_logprobs=engine",
            "output_dir=outputs/tiny/add_grpo_async",
        ),
        (
            "grpo",
            "tiny/add_grpo",
            "rollout.partial.token_budget={budget}",
            "algorithm.shaping.dynamic_sampling=null",
            "algorithm.old_logprobs=engine",
            "output_dir=outputs/tiny/add_grpo_partial",
        ),
    ],
    "vision": [
        ("sft", "tiny/vision_sft"),
        ("grpo", "tiny/vision_grpo"),
        ("reward_model", "tiny/vision_rm"),
        ("grpo", "tiny/vision_rlhf_grpo"),
    ],
    "audio": [("sft", "tiny/audio_sft"), ("grpo", "tiny/audio_grpo")],
    # The tool-use demo, then its control: the same GRPO from the same SFT model without the
    # calculator (single-turn rollouts), into its own directory.
    "tool": [
        ("sft", "tiny/tool_sft"),
        ("grpo", "tiny/tool_grpo"),
        ("grpo", "tiny/tool_grpo", "environment=null", "output_dir=outputs/tiny/tool_grpo_notool"),
    ],
}
SECONDS = "_seconds"  # wall time per command, kept beside the runs and left out of `diff`
KEPT = ("train/", "reward/", "eval/", "critic/", "data/", "rollout/", "env/")
# Cut-down overrides (tests/test_demos.py's), per recipe; the media SFT data cut for media configs.
TRAIN = ["max_steps=3", "eval_every=3", "lr_scheduler.warmup_steps=0"]
QUICK = {
    "sft": TRAIN,
    "reward_model": TRAIN,
    "dpo": TRAIN,
    "grpo": [
        "max_steps=2",
        "eval.every=1",
        "rollout.prompts_per_step=4",
        "rollout.n=4",
        "lr_scheduler.warmup_steps=0",
    ],
}
TEXT_DATA = ["prepare.1.n_train=64", "prepare.1.n_test=8"]
MEDIA_DATA = ["prepare.1.n_train=16", "prepare.1.n_test=4", "prepare.1.n_rl=8", "batch_size=8"]


def _rows(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [
        {
            k: v
            for k, v in r.items()
            # not throughput, not the tools' wall times
            if k == "step"
            or (k.startswith(KEPT) and not k.endswith("_per_s") and "tool_seconds" not in k)
        }
        for r in rows
    ]


def run(out: str, quick: bool, chains: list[str], seed: int | None = None) -> None:
    result: dict[str, list[dict]] = {}
    seconds: dict[str, float] = {}
    for chain in chains:
        with tempfile.TemporaryDirectory() as tmp:
            for launch, config, *overrides in CHAINS[chain]:
                *flags, recipe = launch.split()
                # a partial-rollout budget that cuts the quick runs' 16 rows as the demo's 256
                overrides = [o.format(budget=40 if quick else 1000) for o in overrides]
                extra = ["metrics.tensorboard=false", *overrides]
                if seed is not None:
                    extra.append(f"seed={seed}")
                if quick:
                    extra += QUICK[recipe]
                    if recipe == "sft":
                        extra += (
                            MEDIA_DATA if "vision" in config or "audio" in config else TEXT_DATA
                        )
                    if recipe == "reward_model" and "vision" in config:
                        extra += ["batch_size=8"]
                    if recipe == "sft" and chain == "tool":
                        extra += ["prepare.1.n_sft=64"]
                cmd = [sys.executable, "-m", "lightrft", "run", *flags, recipe, "--config", config]
                cmd += extra
                print(f"[{chain}] {' '.join(cmd[2:])}", flush=True)
                start = time.monotonic()
                subprocess.run(cmd, cwd=tmp, check=True, env=os.environ.copy())
                out_dir = next(
                    (o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")),
                    f"outputs/{config}",
                )
                name = f"{chain}:{config}" + "".join(f" {o}" for o in [*flags, *overrides])
                seconds[name] = round(time.monotonic() - start, 1)
                result[name] = _rows(Path(tmp) / out_dir / "metrics.jsonl")
            Path(out).write_text(json.dumps({**result, SECONDS: seconds}, indent=1, sort_keys=True))
    print(f"wrote {out}")


def diff(a: str, b: str) -> int:
    def load(path: str) -> dict[str, list[dict]]:  # files written before a key was left out
        runs = json.loads(Path(path).read_text())
        keep = lambda r: (  # noqa: E731
            {k: v for k, v in r.items() if not k.endswith("_per_s")} if isinstance(r, dict) else r
        )
        return {name: [keep(r) for r in rows] for name, rows in runs.items()}

    left, right = load(a), load(b)
    left.pop(SECONDS, None), right.pop(SECONDS, None)
    bad = 0
    for run_name in sorted(set(left) | set(right)):
        x, y = left.get(run_name), right.get(run_name)
        if x is None or y is None:
            print(f"{run_name}: only in {'right' if x is None else 'left'}")
            bad += 1
            continue
        values = sum(len(r) - 1 for r in x)
        if x == y:
            print(f"{run_name}: identical ({len(x)} rows, {values} values)")
            continue
        bad += 1
        for i, (r, s) in enumerate(zip(x, y, strict=False)):
            for k in sorted(set(r) | set(s)):
                if r.get(k) != s.get(k):
                    print(
                        f"{run_name}: row {i} (step {r.get('step')}) {k}: {r.get(k)} != {s.get(k)}"
                    )
                    break
        if len(x) != len(y):
            print(f"{run_name}: {len(x)} rows != {len(y)} rows")
    print("identical" if not bad else f"{bad} run(s) differ")
    return 1 if bad else 0


def _first_last(rows: list[dict], key: str) -> tuple[float, float] | None:
    values = [r[key] for r in rows if key in r]
    return (values[0], values[-1]) if values else None


def figures(paths: list[str]) -> None:
    """The README's figures per run file (one per seed): held-out accuracy start -> end of each
    GRPO run, the reward model's held-out pair accuracy start -> end, each command's wall time."""
    for path in paths:
        runs = json.loads(Path(path).read_text())
        seconds = runs.pop(SECONDS, {})
        print(path)
        for name, rows in runs.items():
            if name.endswith("_sft"):
                print(f"  {name}: {seconds.get(name, 0):.0f} s")
                continue
            acc = _first_last(rows, "eval/accuracy")
            if acc is None:
                continue
            gain = 100 * (acc[1] - acc[0])
            print(
                f"  {name}: eval/accuracy {acc[0]:.3f} -> {acc[1]:.3f} ({gain:+.1f} points), "
                f"{seconds.get(name, 0):.0f} s"
            )
            for what, prefix in (("held-out", "eval/env/"), ("rollouts", "env/")):
                tool = _first_last(rows, prefix + "tool_use_frac")
                if tool is None:
                    continue
                errors = [
                    f"{k.removeprefix(prefix + 'errors/')} {a:.3f} -> {b:.3f}"
                    for k in sorted({k for r in rows for k in r})
                    if k.startswith(prefix + "errors/")
                    for a, b in [_first_last(rows, k)]
                    if a or b
                ]
                print(
                    f"    {what} tool use {tool[0]:.3f} -> {tool[1]:.3f}; errors per episode: "
                    f"{', '.join(errors) or 'none'}"
                )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--quick", action="store_true")
    r.add_argument("--chains", default=",".join(CHAINS))
    r.add_argument("--seed", type=int, default=None, help="seed=N on every command")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    f = sub.add_parser("figures")
    f.add_argument("runs", nargs="+")
    args = p.parse_args()
    if args.cmd == "run":
        run(args.out, args.quick, args.chains.split(","), args.seed)
        return 0
    if args.cmd == "figures":
        figures(args.runs)
        return 0
    return diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
