"""Where a GRPO step's time goes, against what the hardware allows: per phase, the time, the matmul
FLOPs it must do, and the fraction of the bare-matmul floor measured in the same run at the
same shapes.

    python tests/benchmarks/phases.py [--hidden 896] [--layers 2] [--prompts 4] [--n 4] [--max-tokens 32]

The model is a random Qwen2 (hidden 896 and the head/KV layout of Qwen2.5-0.5B, fewer layers so
a CPU step takes seconds) with a byte-level BPE tokenizer trained here on GSM8K and the Python
standard library's sources (vocabulary 32,768, so the LM head weighs as in a real model), and the prompts are GSM8K questions
(``../shared/data/gsm8k``). The phases run through the library, as the GRPO recipe runs them:

- rollout prefill and decode: ``NativeEngine.generate`` (``n`` samples per prompt, prompt
  prefilled once per group, exactly ``max_tokens`` new tokens: ``ignore_eos``); prefill is a
  one-token generate, decode the rest;
- reference / old log-probs: ``causal_lm_token_logprobs`` without grad, micro-batches of rows;
- training: the same with grad and a backward (``lp.sum()``);
- optimizer: ``torch.optim.AdamW`` step;
- weight sync: ``sync_weights(model, engine)``.

The floor of a phase is the time of its linear layers alone, every ``nn.Linear`` of the model
(the LM head included) as a bare ``F.linear`` on random inputs of the phase's row count (its
backward too, for training), each run right after its phase, round after round (the fastest
round of each counts). "of floor" = floor time /
phase time; attention, norms, sampling and Python make up the rest. The optimizer and weight
sync do no matmuls: they show time and bytes moved. Run on an idle machine for figures; the
load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from realistic_vocab import gsm8k_texts, train_bpe  # this folder (a script's sys.path[0])
from torch import nn

from lightrft.engine import NativeEngine, Request, SamplingParams
from lightrft.engine.sync import sync_weights
from lightrft.models.forward import causal_lm_token_logprobs


def make_model(out: Path, tokenizer, args) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]


def matmul_flops(shapes: list[tuple[int, int]], rows: int) -> float:
    return 2.0 * rows * sum(i * o for i, o in shapes)


def linear_floor(shapes: list[tuple[int, int]], rows: int, *, backward: bool) -> float:
    """Seconds for the model's linear layers alone on ``rows`` input rows (forward, or forward
    and both backward matmuls), with inputs and weights made beforehand."""
    tensors = [(torch.randn(rows, i), torch.randn(o, i), torch.randn(rows, o)) for i, o in shapes]

    def run() -> None:
        for x, w, g in tensors:
            F.linear(x, w)
            if backward:
                g @ w  # grad of the input
                g.t() @ x  # grad of the weight

    run()  # warm-up
    return timed(run)


def padded_rows(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    records = gsm8k_texts()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lightrft-phases-"))
    tokenizer = train_bpe(records, args.vocab)
    path = make_model(work / "model", tokenizer, args)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = NativeEngine(str(path), tokenizer, max_model_len=1024, seed=0)
    prompts = [tokenizer(r["question"])["input_ids"] for r in records[: args.prompts]]
    shapes = linear_shapes(model)
    rows = args.prompts * args.n
    prompt_tokens = sum(len(p) for p in prompts)

    # ---- rollout: prefill (one new token) and the whole generate; decode = the difference
    def generate(max_tokens: int):
        params = SamplingParams(
            n=args.n,
            temperature=1.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            seed=0,
            detokenize=False,
        )
        return engine.generate([Request(p) for p in prompts], params)

    generate(args.max_tokens)  # warm-up
    outs = generate(args.max_tokens)
    seqs = [prompts[k // args.n] + list(o.token_ids) for k, o in enumerate(outs)]
    decode_steps = args.max_tokens - 1

    # ---- log-probs (no grad) and training (grad + backward), micro-batches of rows
    micro = [seqs[i : i + args.micro_batch] for i in range(0, len(seqs), args.micro_batch)]
    batches = [padded_rows(m, tokenizer.pad_token_id) for m in micro]
    run_tokens = sum(ids.numel() for ids, _ in batches)

    def logprobs(grad: bool) -> None:
        for ids, mask in batches:
            with torch.set_grad_enabled(grad):
                lp = causal_lm_token_logprobs(model, ids, attention_mask=mask)
            if grad:
                lp.sum().backward()

    logprobs(True)  # warm-up (and gradients for the optimizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    opt.step()
    sync_weights(model, engine)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    # The floors: the same linear shapes, bare. Each phase and its floor run back to back, round
    # after round, so a change in the machine's load hits both; the fastest round counts.
    floors = {
        "prefill": lambda: linear_floor(shapes, prompt_tokens, backward=False),
        "decode": lambda: decode_steps * linear_floor(shapes, rows, backward=False),
        "ref": lambda: linear_floor(shapes, run_tokens, backward=False),
        "train": lambda: linear_floor(shapes, run_tokens, backward=True),
    }
    phases = {
        "prefill": lambda: timed(lambda: generate(1)),
        "generate": lambda: timed(lambda: generate(args.max_tokens)),
        "ref": lambda: timed(lambda: logprobs(False)),
        "train": lambda: timed(lambda: logprobs(True)),
        "opt": lambda: timed(opt.step),
        "sync": lambda: timed(lambda: sync_weights(model, engine)),
    }
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, fn in [*phases.items(), *((f"floor_{k}", f) for k, f in floors.items())]:
            best[name] = min(best.get(name, float("inf")), fn())
    t_prefill, t_decode = best["prefill"], best["generate"] - best["prefill"]
    t_ref, t_train, t_opt, t_sync = best["ref"], best["train"], best["opt"], best["sync"]
    f_prefill, f_decode = best["floor_prefill"], best["floor_decode"]
    f_ref, f_train = best["floor_ref"], best["floor_train"]

    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} (BPE trained here: "
        f"{len(tokenizer)} tokens), {params / 1e6:.0f}M parameters; {args.prompts} GSM8K prompts "
        f"x {args.n} samples x {args.max_tokens} new tokens; prompt tokens {prompt_tokens}, "
        f"trainer tokens (padded) {run_tokens}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'phase':24s} {'time s':>8s} {'GFLOP':>8s} {'GFLOP/s':>8s} {'floor s':>8s} {'of floor':>9s}"
    )
    table = [
        ("rollout prefill", t_prefill, matmul_flops(shapes, prompt_tokens), f_prefill),
        ("rollout decode", t_decode, decode_steps * matmul_flops(shapes, rows), f_decode),
        ("ref / old log-probs", t_ref, matmul_flops(shapes, run_tokens), f_ref),
        ("training fwd+bwd", t_train, 3 * matmul_flops(shapes, run_tokens), f_train),
    ]
    for name, t, flops, floor in table:
        print(
            f"{name:24s} {t:8.3f} {flops / 1e9:8.1f} {flops / 1e9 / t:8.1f} {floor:8.3f} "
            f"{floor / t:8.0%}"
        )
    for name, t in (("optimizer (AdamW)", t_opt), ("weight sync", t_sync)):
        print(f"{name:24s} {t:8.3f} {'-':>8s} {n_bytes / 2**30 / t:7.2f} GiB/s of parameters")
    total = t_prefill + t_decode + t_ref + t_train + t_opt + t_sync
    print(
        f"{'step (sum)':24s} {total:8.3f}; matmul floor of the step "
        f"{statistics.fsum([f_prefill, f_decode, f_ref, f_train]) / total:.0%}"
    )


if __name__ == "__main__":
    main()
