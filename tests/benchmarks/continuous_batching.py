"""Continuous batching against the wave engine it replaced: tokens/s on long-tailed lengths.

    python tests/benchmarks/continuous_batching.py [--base e03e45a] [--rounds 3] [--scale 4]
    pytest tests/benchmarks/bench_engine.py -m benchmark_suite --benchmark-enable -s -k continuous

Method:

- model: a random Qwen2 (4 layers, hidden 256, 2 KV heads) with the 32,768-token byte-level BPE
  of ``realistic_vocab.py`` (trained on GSM8K + Python sources), so the LM head weighs as in a
  real model;
- prompts: GSM8K test questions in the chat template, ``n`` samples each (temperature 1, seeded);
- lengths: each request's ``max_tokens`` is the BPE length of a GSM8K train solution drawn at
  random (seeded), times ``--scale`` (reasoning responses run several times longer than GSM8K's
  terse solutions), with ``ignore_eos`` so that every row stops exactly there: a random model
  does not emit EOS by itself. The ``n`` samples of a request share its length; across requests
  the mix is long-tailed, as GSM8K's solution lengths are;
- ``max_num_seqs`` holds a quarter of the rows, so the wave engine runs several waves;
- the two sides: the engine of this checkout and the one of ``--base`` (a ``git archive`` of
  that revision, or ``--base-src``, an unpacked tree), each in its own subprocess running this
  file's worker with ``PYTHONPATH`` at its tree; each loads the model and warms up once, then the
  rounds alternate old / new so that machine load hits both alike. Each round is one
  ``generate`` of the same requests with the same seeds; the token ids of every sample are
  hashed, and the table counts the samples equal on both sides in every round;
- peak memory: one more call per side after ``sleep(1)`` / ``wake_up`` (the KV pool is allocated
  during the call): CUDA ``max_memory_allocated`` above the weights on a GPU, the profiler's
  allocator events on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BASE = "e03e45a"  # the last commit of the wave engine


# ---------------------------------------------------------------- setup (parent process)
def prepare(workdir: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The model directory and the request file, cached in ``workdir``."""
    import torch
    from realistic_vocab import gsm8k_texts, train_bpe

    model_dir, spec_file = workdir / "model", workdir / f"requests-{_spec_key(args)}.json"
    tok_dir = workdir / "tokenizer"
    records = None
    if not (tok_dir / "tokenizer.json").is_file():
        records = gsm8k_texts()
        train_bpe(records).save_pretrained(tok_dir)
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        cfg = Qwen2Config(
            vocab_size=32768,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    if not spec_file.is_file():
        records = records or gsm8k_texts()
        solution = sorted(len(tok(r["answer"])["input_ids"]) for r in records)
        rng = random.Random(0)
        test = [json.loads(x) for x in (_gsm8k_dir() / "test.jsonl").read_text().splitlines()]
        reqs = []
        for k in range(args.prompts):
            msgs = [{"role": "user", "content": test[k]["question"]}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            reqs.append({"prompt": ids, "max_tokens": args.scale * rng.choice(solution)})
        pct = {q: solution[int(q / 100 * (len(solution) - 1))] for q in (50, 90, 99, 100)}
        spec = {"requests": reqs, "n": args.n, "solution_tokens_percentiles": pct}
        spec_file.write_text(json.dumps(spec))
    return model_dir, spec_file


def _gsm8k_dir() -> Path:
    from realistic_vocab import GSM8K

    return GSM8K.parent


def _spec_key(args: argparse.Namespace) -> str:
    return f"p{args.prompts}-n{args.n}-x{args.scale}"


def base_tree(rev: str, dest: Path) -> Path:
    """An unpacked ``git archive`` of ``rev`` (the library, its kernels, pyproject.toml)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "lightrft", "kernels", "pyproject.toml"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


class Side:
    """One engine in its own worker process, driven line by line over stdin / stdout."""

    def __init__(self, name: str, tree: Path, config: dict) -> None:
        path = os.pathsep.join(x for x in (str(tree), os.environ.get("PYTHONPATH")) if x)
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._read()  # the worker reports where its lightrft comes from
        if Path(self.info["lightrft"]).resolve().parents[1] != tree.resolve():
            raise SystemExit(f"{name}: imported lightrft from {self.info['lightrft']}, not {tree}")

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the worker died (exit code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def compare(args: argparse.Namespace) -> dict:
    """Run the rounds; the figures as a dict (also printed as a table)."""
    import torch

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lightrft-cb-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, spec_file = prepare(workdir, args)
    old_tree = Path(args.base_src) if args.base_src else base_tree(args.base, workdir / "base")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = json.loads(spec_file.read_text())
    rows = len(spec["requests"]) * spec["n"]
    config = {
        "model": str(model_dir),
        "spec": str(spec_file),
        "device": device,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs or rows // 4,
        "max_model_len": max(len(r["prompt"]) + r["max_tokens"] for r in spec["requests"]),
    }
    sides = {"waves (base)": Side("old", old_tree, config), "continuous": Side("new", ROOT, config)}
    rates: dict[str, list[float]] = {k: [] for k in sides}
    samples: dict[str, list[list[str]]] = {k: [] for k in sides}  # per round, per sample
    tokens = 0
    try:
        for side in sides.values():
            side.ask("run")  # warm-up
        for _ in range(args.rounds):
            for name, side in sides.items():
                res = side.ask("run")
                tokens = res["tokens"]
                rates[name].append(tokens / res["seconds"])
                samples[name].append(res["digests"])
                print(f"  {name:13s} {rates[name][-1]:9.0f} tok/s", file=sys.stderr, flush=True)
        steps = sides["continuous"].ask("stats")
        peak = {}
        if args.peak:
            peak = {name: side.ask("peak")["peak_mib"] for name, side in sides.items()}
        control = None
        if args.control:
            # The wave engine against itself with half the rows per wave: how many samples
            # the device's arithmetic alone changes when the batch layout changes.
            half = sides["waves (base)"].ask(f"layout {config['max_num_seqs'] // 2}")
            first = samples["waves (base)"][0]
            control = sum(a == b for a, b in zip(first, half["digests"], strict=True))
    finally:
        for side in sides.values():
            side.close()
    old, new = rates["waves (base)"], rates["continuous"]
    ratios = [b / a for a, b in zip(old, new, strict=True)]
    # Samples whose tokens equal the other side's in every round.
    rounds_of = list(zip(*samples["waves (base)"], *samples["continuous"], strict=True))
    same = sum(len(set(x)) == 1 for x in rounds_of)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": args.dtype,
        "rows": rows,
        "max_num_seqs": config["max_num_seqs"],
        "tokens_per_call": tokens,
        "solution_tokens_percentiles": spec["solution_tokens_percentiles"],
        "scale": args.scale,
        "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "rounds": rates,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "identical_samples": same,
        "identical_samples_waves_half_rows": control,
        "peak_mib": peak,
        "continuous_stats": steps,
        "load_average": os.getloadavg(),
    }
    lines = [
        f"\ncontinuous batching vs waves: {len(spec['requests'])} prompts x {spec['n']} samples, "
        f"max_num_seqs {config['max_num_seqs']}, {tokens} tokens per call "
        f"(GSM8K solution lengths x {args.scale}), {device} {args.dtype}",
        "| | median | per-round |",
        "|---|---|---|",
    ]
    lines += [
        f"| {k} | {statistics.median(v):.0f} tok/s | {', '.join(f'{x:.0f}' for x in v)} |"
        for k, v in rates.items()
    ]
    lines.append(
        f"| continuous / waves | {result['ratio_median']:.2f}x | "
        f"{', '.join(f'{r:.2f}' for r in ratios)} |"
    )
    lines += [f"| peak allocated, {k} | {v:.0f} MiB | one call |" for k, v in peak.items()]
    lines.append(f"| identical samples | {same} of {rows} | token for token, every round |")
    if control is not None:
        lines.append(
            f"| control: waves vs waves at max_num_seqs {config['max_num_seqs'] // 2} | "
            f"{control} of {rows} identical | one call |"
        )
    lines.append(f"| load average | {' '.join(f'{x:.2f}' for x in os.getloadavg())} | at the end |")
    print("\n".join(lines))
    return result


# ---------------------------------------------------------------- worker (child process)
def worker(config: dict) -> None:
    import torch

    import lightrft
    from lightrft.engine import NativeEngine, Request, SamplingParams

    print(json.dumps({"lightrft": lightrft.__file__}), flush=True)
    spec = json.loads(Path(config["spec"]).read_text())
    engine = NativeEngine(
        config["model"],
        dtype=config["dtype"],
        device=config["device"],
        max_num_seqs=config["max_num_seqs"],
        max_model_len=config["max_model_len"],
    )
    dev = torch.device(config["device"])
    reqs = [Request(r["prompt"]) for r in spec["requests"]]
    params = [
        SamplingParams(
            n=spec["n"],
            temperature=1.0,
            max_tokens=r["max_tokens"],
            ignore_eos=True,
            seed=k,
            detokenize=False,
        )
        for k, r in enumerate(spec["requests"])
    ]

    def run() -> tuple[int, list[str]]:
        outs = engine.generate(reqs, params)
        digests = [hashlib.sha256(str(c.token_ids).encode()).hexdigest()[:16] for c in outs]
        return sum(len(c.token_ids) for c in outs), digests

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "run":
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            n, digests = run()
            res = {"seconds": time.perf_counter() - t0, "tokens": n, "digests": digests}
        elif cmd == "peak":
            engine.sleep(1)
            engine.wake_up(["kv_cache"])
            if dev.type == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            else:
                from lightrft.kernels.benchmarking import peak_allocated_mib

                peak = peak_allocated_mib(run)
            res = {"peak_mib": peak}
        elif cmd.startswith("layout "):
            rows, engine.max_num_seqs = engine.max_num_seqs, int(cmd.split()[1])
            res = {"digests": run()[1]}
            engine.max_num_seqs = rows
        elif cmd == "stats":
            # The base commit's wave engine has no counters.
            stats = getattr(engine, "stats", None)
            res = {} if stats is None else dataclasses.asdict(stats)
        else:
            return
        print(json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--base", default=BASE, help="git revision of the wave engine")
    ap.add_argument("--base-src", help="an unpacked tree of the base revision instead")
    ap.add_argument("--workdir", help="caches the tokenizer, model and requests")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: a quarter of rows")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", help="write the figures there too")
    ap.add_argument("--no-peak", dest="peak", action="store_false", help="skip the memory call")
    ap.add_argument(
        "--control", action="store_true", help="also count the wave engine's own layout drift"
    )
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    result = compare(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
