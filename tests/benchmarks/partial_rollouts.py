"""Partial rollouts: the longest step's generation time with and without a token budget, on
long-tailed lengths, and the text demo's accuracy curves side by side.

    python tests/benchmarks/partial_rollouts.py gen [--steps 6] [--prompts 8] [--n 4] [--scale 2]
        [--budget N] [--rounds 2] [--workdir DIR]
    python tests/benchmarks/partial_rollouts.py curve outputs/tiny/add_grpo outputs/tiny/add_grpo_partial

``gen`` (generation only, unchanged weights, so every sample is checked token for token):

- model, prompts and lengths: those of ``continuous_batching.py`` (a random 4-layer Qwen2 with the
  32,768-token BPE, GSM8K test questions, each request's ``max_tokens`` a GSM8K train solution's
  BPE length times ``--scale``, ``ignore_eos``): long-tailed, as reasoning lengths are;
- the baseline runs ``--steps`` GRPO-like steps of ``--prompts`` x ``--n`` rows, one
  ``generate`` each (a step waits for its longest row);
- the partial side runs the same groups through :class:`~lightrft.rollout.partial.PartialRollouts`
  with ``--budget`` tokens per step (default: the step's rows times the median length), topping
  up to ``--prompts`` groups per step, until every group has finished;
- reported: each side's per-step generation times, the longest and the median step, the total
  time and tokens/s over the same samples (the cost of re-prefilling carried tokens is in the
  total), the tokens re-prefilled, and how many samples equal the baseline's (all must).

``curve`` prints ``eval/accuracy`` per step of GRPO runs (their ``metrics.jsonl``) side by side;
docs/grpo.md gives the commands of the demo runs it compares.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def workload(args: argparse.Namespace):
    """The model directory and the requests (``prompt``, ``max_tokens``) of continuous_batching."""
    sys.path.insert(0, str(HERE))
    from continuous_batching import prepare

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lightrft-partial-"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec_args = argparse.Namespace(prompts=args.steps * args.prompts, n=args.n, scale=args.scale)
    model_dir, spec_file = prepare(workdir, spec_args)
    return model_dir, json.loads(spec_file.read_text())["requests"]


def digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def run_baseline(engine, requests, params, args) -> tuple[list[float], dict]:
    from lightrft.engine import Request

    times, out = [], {}
    for s in range(args.steps):
        idx = range(s * args.prompts, (s + 1) * args.prompts)
        t0 = time.perf_counter()
        got = engine.generate(
            [Request(requests[i]["prompt"]) for i in idx], [params[i] for i in idx]
        )
        times.append(time.perf_counter() - t0)
        for c in got:
            out[(idx[c.request_index], c.sample_index)] = digest(c.token_ids)
    return times, out


def run_partial(colocated, requests, params, args, budget) -> tuple[list[float], dict, dict]:
    from lightrft.rollout.partial import PartialRollouts

    partial = PartialRollouts(budget)
    queue = list(range(len(requests)))
    times, out, carried, reprefilled, steps = [], {}, [], 0, 0
    while queue or partial.groups:
        while queue and len(partial.groups) < args.prompts:
            i = queue.pop(0)
            partial.add({"prompt_ids": requests[i]["prompt"]}, params[i], key=(i,))
        reprefilled += sum(
            len(s.token_ids)
            for g in partial.groups
            if g.started
            for s in g.samples
            if not s.finished
        )
        t0 = time.perf_counter()
        done, stats = partial.step(colocated, version=steps)
        times.append(time.perf_counter() - t0)
        carried.append(stats.carried_tokens)
        steps += 1
        for g in done:
            for s in g.samples:
                out[(g.key[0], s.sample_index)] = digest(s.token_ids)
    return times, out, {"carried_tokens": carried, "reprefilled_tokens": reprefilled}


def gen(args: argparse.Namespace) -> dict:
    import torch

    from lightrft.engine import NativeEngine, Request, SamplingParams
    from lightrft.rollout.engine import ColocatedEngine

    torch.set_num_threads(args.threads)
    model_dir, requests = workload(args)
    rows = args.prompts * args.n
    lengths = [r["max_tokens"] for r in requests]
    budget = args.budget or rows * int(statistics.median(lengths))
    params = [
        SamplingParams(
            n=args.n, max_tokens=r["max_tokens"], ignore_eos=True, seed=1000 + i, detokenize=False
        )
        for i, r in enumerate(requests)
    ]
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    engine = NativeEngine(model_dir, max_model_len=longest, max_num_seqs=rows, dtype="float32")
    colocated = ColocatedEngine(engine, None, 0)
    engine.generate([Request(requests[0]["prompt"])], dataclasses.replace(params[0], max_tokens=8))
    tokens = sum(lengths) * args.n
    result: dict = {"budget": budget, "rows_per_step": rows, "tokens": tokens, "rounds": []}
    for _ in range(args.rounds):
        base_t, base_out = run_baseline(engine, requests, params, args)
        part_t, part_out, info = run_partial(colocated, requests, params, args, budget)
        equal = sum(base_out[k] == part_out.get(k) for k in base_out)
        result["rounds"].append(
            {
                "baseline_s": base_t,
                "partial_s": part_t,
                "equal_samples": equal,
                "samples": len(base_out),
                **info,
            }
        )
        print(
            f"  baseline: longest step {max(base_t):.2f} s, total {sum(base_t):.1f} s | partial: "
            f"longest step {max(part_t):.2f} s, total {sum(part_t):.1f} s | equal {equal}/{len(base_out)}",
            file=sys.stderr,
            flush=True,
        )
    print(table(result, lengths, args))
    return result


def table(result: dict, lengths: list[int], args: argparse.Namespace) -> str:
    q = sorted(lengths)
    pct = {p: q[int(p / 100 * (len(q) - 1))] for p in (50, 90, 100)}
    lines = [
        f"{args.steps} steps x {args.prompts} prompts x {args.n} samples; max_tokens p50/p90/max "
        f"{pct[50]}/{pct[90]}/{pct[100]}; token budget {result['budget']} per step",
        "",
        "| round | side | steps | longest step (s) | median step (s) | total (s) | tok/s | "
        "re-prefilled tokens | samples equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in enumerate(result["rounds"]):
        for side, times in (("baseline", r["baseline_s"]), ("budget", r["partial_s"])):
            extra = r["reprefilled_tokens"] if side == "budget" else 0
            lines.append(
                f"| {k} | {side} | {len(times)} | {max(times):.2f} | {statistics.median(times):.2f} | "
                f"{sum(times):.1f} | {result['tokens'] / sum(times):.0f} | {extra} | "
                f"{r['equal_samples']}/{r['samples']} |"
            )
    return "\n".join(lines)


def curve(args: argparse.Namespace) -> None:
    runs = {}
    for d in args.runs:
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines() if x]
        runs[d] = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    steps = sorted({s for acc in runs.values() for s in acc})
    print("| step | " + " | ".join(Path(d).name for d in runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    for s in steps:
        cells = [f"{runs[d][s]:.3f}" if s in runs[d] else "" for d in runs]
        print(f"| {s} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="the longest step's generation time, with and without a budget")
    g.add_argument("--steps", type=int, default=6)
    g.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    g.add_argument("--n", type=int, default=4)
    g.add_argument("--scale", type=int, default=2)
    g.add_argument("--budget", type=int, default=None, help="default: rows x median length")
    g.add_argument("--rounds", type=int, default=1)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--workdir", help="caches the tokenizer, model and requests")
    g.add_argument("--json", help="write the figures there too")
    c = sub.add_parser("curve", help="eval/accuracy of GRPO runs side by side")
    c.add_argument("runs", nargs="+")
    args = ap.parse_args()
    if args.cmd == "curve":
        curve(args)
        return
    result = gen(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
