"""Held-out accuracy of the generative judge that ``configs/tiny/judge_sft.yaml`` trains, used
through ``lightrft.rewards.GenerativeReward`` exactly as a GRPO config would use it.

    lightrft run sft --config tiny/judge_sft        # writes outputs/tiny/judge_sft/final
    python tests/benchmarks/judge_eval.py [--judge outputs/tiny/judge_sft/final] [--n 500]

For each held-out problem of ``outputs/tiny/arith/test.jsonl``: the correct answer judged
against a near miss (``lightrft.tasks.arith.near_miss_text``, off by 1, 2 or 10 or two digits
swapped; the training pairs' kind, new draws), and the near miss judged against the correct
answer, each in both presentation orders (``both_orders``). Prints the mean reward of correct
answers (1 = always preferred), of near misses (0 = never), the pairwise accuracy (the correct
answer's reward above the near miss's), the parse failures, and the same without
``both_orders`` (position bias shows there).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from lightrft.rewards import GenerativeReward
from lightrft.tasks.arith import ARITH_JUDGE_TEMPLATE, near_miss_text


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--judge", default="outputs/tiny/judge_sft/final")
    ap.add_argument("--data", default="outputs/tiny/arith/test.jsonl")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=2, help="the verdict's budget")
    ap.add_argument("--reversed", action="store_true", help="answers spelled reversed (tiny/add)")
    args = ap.parse_args()
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()]
    rows = rows[: args.n]
    rng = random.Random(1234)
    prompts = [r["prompt"] for r in rows]
    right = [r["answer"] for r in rows]
    wrong = [near_miss_text(a, rng, reversed_order=args.reversed) for a in right]
    for both in (True, False):
        judge = GenerativeReward(
            judge=args.judge,
            mode="choice",
            template=ARITH_JUDGE_TEMPLATE,
            chat_template=False,
            both_orders=both,
            fallback=0.5,
            max_tokens=args.max_tokens,
        )
        good = torch.as_tensor(judge(prompts, right, wrong))
        bad = torch.as_tensor(judge(prompts, wrong, right))
        acc = (good > bad).float().mean().item()
        print(
            f"both_orders={both}: {len(rows)} problems; reward of the correct answer "
            f"{good.mean():.3f}, of the near miss {bad.mean():.3f}; pairwise accuracy {acc:.3f}; "
            f"parse failures {judge.parse_failures}",
            flush=True,
        )


if __name__ == "__main__":
    main()
