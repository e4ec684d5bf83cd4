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


class Counting:
    """The engine, counting its decoding steps (``engine.stats.steps``) over the calls of a
    step: a measure of a step's generation that machine load does not move."""

    def __init__(self, engine) -> None:
        self.engine, self.steps = engine, 0

    def generate(self, *args, **kwargs):
        out = self.engine.generate(*args, **kwargs)
        self.steps += self.engine.stats.steps
        return out

    def take(self) -> int:
        steps, self.steps = self.steps, 0
        return steps

    def __getattr__(self, name):
        return getattr(self.engine, name)


def run_baseline(engine, requests, params, args) -> tuple[dict, dict]:
    from lightrft.engine import Request

    times, out, decode = [], {}, []
    counting = Counting(engine)
    for s in range(args.steps):
        idx = range(s * args.prompts, (s + 1) * args.prompts)
        t0 = time.perf_counter()
        got = counting.generate(
            [Request(requests[i]["prompt"]) for i in idx], [params[i] for i in idx]
        )
        times.append(time.perf_counter() - t0)
        decode.append(counting.take())
        for c in got:
            out[(idx[c.request_index], c.sample_index)] = digest(c.token_ids)
    return {"seconds": times, "decode_steps": decode, "steady": [True] * len(times)}, out


def run_partial(colocated, requests, params, args, budget) -> tuple[dict, dict]:
    from lightrft.rollout.partial import PartialRollouts

    partial = PartialRollouts(budget)
    queue = list(range(len(requests)))
    times, out, carried, decode, steady, reprefilled = [], {}, [], [], [], 0
    counting = Counting(colocated.engine)
    colocated.engine = counting
    while queue or partial.groups:
        # Steady: the step is topped up to --prompts groups, as in training (the last steps
        # only drain what is left, which a run that goes on never does).
        steady.append(len(queue) >= args.prompts - len(partial.groups))
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
        done, stats = partial.step(colocated, version=len(times))
        times.append(time.perf_counter() - t0)
        decode.append(counting.take())
        carried.append(stats["rollout/carried_tokens"])
        for g in done:
            for s in g.samples:
                out[(g.key[0], s.sample_index)] = digest(s.token_ids)
    colocated.engine = counting.engine
    info = {"seconds": times, "decode_steps": decode, "steady": steady}
    return {**info, "carried_tokens": carried, "reprefilled_tokens": reprefilled}, out


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
        base, base_out = run_baseline(engine, requests, params, args)
        part, part_out = run_partial(colocated, requests, params, args, budget)
        equal = sum(base_out[k] == part_out.get(k) for k in base_out)
        result["rounds"].append(
            {"baseline": base, "budget": part, "equal_samples": equal, "samples": len(base_out)}
        )
        print(
            f"  baseline: longest step {max(base['seconds']):.2f} s | budget: longest step "
            f"{max(part['seconds']):.2f} s | samples equal {equal}/{len(base_out)}",
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
        "| round | side | steps (steady) | decode steps per step, max / median (steady) | "
        "longest step, s (steady) | total s | tok/s | re-prefilled tokens | samples equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in enumerate(result["rounds"]):
        for side in ("baseline", "budget"):
            x = r[side]
            times, dec = x["seconds"], x["decode_steps"]
            st = [i for i, f in enumerate(x["steady"]) if f]
            lines.append(
                f"| {k} | {side} | {len(times)} ({len(st)}) | {max(dec)} / "
                f"{statistics.median(dec):.0f} ({max(dec[i] for i in st)} / "
                f"{statistics.median(dec[i] for i in st):.0f}) | {max(times):.2f} "
                f"({max(times[i] for i in st):.2f}) | {sum(times):.1f} | "
                f"{result['tokens'] / sum(times):.0f} | {x.get('reprefilled_tokens', 0)} | "
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
