"""GRPO training-pass time by micro-batch layout, on a realistic spread of lengths.

    python tests/benchmarks/micro_batches.py [--samples 32] [--rounds 3] [--hidden 256] [--layers 2]

Times the forward + backward of one GRPO training batch (``lightrft.data.plan_micro_batches``
as the recipe plans it, the recipe's ``_padded`` / ``_packed`` layouts and fused log-prob
forward) under four layouts: padded or packed rows, split by a row count (``train.micro_batch_size``) or by a token budget
(``train.micro_batch_tokens``, set to the row count x the mean length, so a micro-batch holds
about as many real tokens either way). Prompt lengths are GSM8K's questions at ~4 characters a
token (``../shared/data/gsm8k`` when present, else a matching lognormal); response lengths are
lognormal around 200 tokens with a tail to 1,024, the spread of a 0.5B model's GSM8K rollouts.
The model is a random Qwen2 with a 32,768-token vocabulary. Layouts alternate round by round;
prints the median time of each, its ratio to padded rows, and the tokens the model processed
(padding included).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import statistics
import time
from pathlib import Path

import torch

from lightrft.cli import recipes_dir
from lightrft.data import plan_micro_batches as plan
from lightrft.models.forward import causal_lm_token_logprobs

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"


def lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    if GSM8K.is_file():
        questions = [json.loads(x)["question"] for x in GSM8K.read_text().splitlines()[:2000]]
        prompts = [max(8, len(rng.choice(questions)) // 4 + 30) for _ in range(n)]  # + a template
    else:
        prompts = [int(min(400, max(16, rng.lognormvariate(4.4, 0.35)))) for _ in range(n)]
    responses = [int(min(1024, max(16, rng.lognormvariate(5.3, 0.55)))) for _ in range(n)]
    return prompts, responses


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8, help="train.micro_batch_size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    recipe = runpy.run_path(str(recipes_dir() / "grpo.py"))
    padded, packed = recipe["_padded"], recipe["_packed"]
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(cfg)
    p_len, r_len = lengths(args.samples)
    rng = random.Random(1)
    prompts = [[rng.randrange(args.vocab) for _ in range(n)] for n in p_len]
    responses = [[rng.randrange(args.vocab) for _ in range(n)] for n in r_len]
    total = [p + r for p, r in zip(p_len, r_len, strict=True)]
    order = sorted(range(args.samples), key=lambda i: total[i])  # as the recipe sorts
    budget = args.rows * round(statistics.mean(total))
    layouts = {
        "padded, rows": (False, None),
        "packed, rows": (True, None),
        "padded, token budget": (False, budget),
        "packed, token budget": (True, budget),
    }

    def run(packing: bool, max_tokens: int | None) -> tuple[float, int, int]:
        seen = 0
        micro = plan(
            order, total, args.rows if max_tokens is None else 10**9, max_tokens, packing=packing
        )
        start = time.perf_counter()
        for idx in micro:
            mb = (packed if packing else padded)(
                [prompts[i] for i in idx], [responses[i] for i in idx], 0
            )
            seen += mb["input_ids"].numel()
            lp = causal_lm_token_logprobs(
                model,
                mb["input_ids"],
                targets=mb["targets"],
                attention_mask=mb["attention_mask"],
                position_ids=mb["position_ids"],
            )
            lp.sum().backward()
        return time.perf_counter() - start, seen, len(micro)

    run(True, budget)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in layouts}
    info: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        names = list(layouts) if r % 2 == 0 else list(reversed(layouts))
        for name in names:
            t, seen, count = run(*layouts[name])
            times[name].append(t)
            info[name] = (seen, count)
    real = sum(total)
    print(
        f"{args.samples} samples, {real} real tokens (prompt mean {statistics.mean(p_len):.0f}, "
        f"response mean {statistics.mean(r_len):.0f}, max {max(r_len)}); rows={args.rows}, "
        f"token budget={budget}; hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
        f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )
    base = statistics.median(times["padded, rows"])
    print(
        f"{'layout':22s} {'median s':>9s} {'vs padded rows':>15s} {'tokens run':>11s} {'micro-batches':>14s}"
    )
    for name in layouts:
        med = statistics.median(times[name])
        seen, count = info[name]
        print(f"{name:22s} {med:9.2f} {med / base:14.2f}x {seen:11d} {count:14d}")


if __name__ == "__main__":
    main()
