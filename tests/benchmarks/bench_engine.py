"""Engine benchmarks (opt-in): the native engine vs ``model.generate``, continuous batching vs
the wave engine it replaced, weight sync vs all-gather.

    pytest tests/benchmarks/bench_engine.py -m benchmark_suite --benchmark-enable -s

Both comparisons interleave their two sides round by round, so that load from other processes
on a shared machine hits both alike; the printed tables give per-side medians and the median of
the per-round ratios, and the peak torch memory allocated during one (untimed) call of each
side. Results go to ``benchmark.extra_info`` as well. ``LIGHTRFT_BENCH_ROUNDS`` (default 5) sets
the number of rounds; the generate rounds print their rates to stderr as they come. The
continuous-batching comparison is ``continuous_batching.py`` (its docstring gives the method; run
it as a script for other sizes, e.g. on a GPU); ``LIGHTRFT_BENCH_WORKDIR`` caches its tokenizer
(a BPE trained in about a minute), model and requests between runs.
"""

import json
import os
import statistics
import sys
import time

import pytest
import torch

from lightrft.kernels.benchmarking import peak_allocated_mib

pytestmark = pytest.mark.benchmark_suite

ROUNDS = int(os.environ.get("LIGHTRFT_BENCH_ROUNDS", 5))
PROMPTS, SAMPLES, NEW_TOKENS = 64, 8, 128


@pytest.fixture(scope="module")
def bench_model_dir(tmp_path_factory):
    from lightrft.tasks import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("bench") / "m", layers=4, hidden=256, heads=4, kv_heads=2
    )


def _table(title: str, rows: list[tuple[str, str, str]]) -> str:
    lines = [f"\n{title}", "| | median | per-round |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def test_native_engine_vs_hf_generate(benchmark, bench_model_dir):
    from lightrft.engine import NativeEngine, Request, SamplingParams
    from lightrft.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(bench_model_dir)
    hf = load_causal_lm(bench_model_dir).eval()
    engine = NativeEngine(bench_model_dir, max_num_seqs=PROMPTS * SAMPLES)
    questions = [f"What is {a} + {2 * a + 7}? Answer briefly." for a in range(PROMPTS)]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in questions
    ]
    batch = tok.pad([{"input_ids": p} for p in prompts], return_tensors="pt", padding=True)
    eos = tok.eos_token_id
    rates: dict[str, list[float]] = {"native": [], "hf": []}

    def native() -> int:
        sp = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS)
        outs = engine.generate([Request(p) for p in prompts], sp)
        assert len(outs) == PROMPTS * SAMPLES
        return sum(len(c.token_ids) for c in outs)

    @torch.no_grad()
    def hf_generate() -> int:
        out = hf.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=SAMPLES,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=tok.pad_token_id,
            eos_token_id=eos,
        )
        resp = out[:, batch["input_ids"].shape[1] :]  # [P*S, <=T]
        is_eos = resp == eos
        # Tokens up to and including the first EOS (the rest is padding).
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, resp.shape[1])
        return int(first.sum())

    def one_round() -> None:
        for name, fn in (("native", native), ("hf", hf_generate)):
            t0 = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - t0))
            print(f"  {name:7s} {rates[name][-1]:8.0f} tok/s", file=sys.stderr, flush=True)

    native()  # warm-up: allocate the KV pool, fault in the weights
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    ratios = [a / b for a, b in zip(rates["native"], rates["hf"], strict=True)]
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Peak torch memory allocated during one call (untimed, under the profiler). The engine's KV
    # pool outlives a call: free it first so that the measured call allocates it as HF does its
    # cache. Weights (both sides hold one copy) are not counted.
    engine.sleep(1)
    engine.wake_up(["kv_cache"])
    peak = {"native": peak_allocated_mib(native), "hf": peak_allocated_mib(hf_generate)}
    benchmark.extra_info.update(
        tokens_per_s=med, ratio_median=statistics.median(ratios), ratios=ratios, peak_mib=peak
    )
    print(
        _table(
            f"generate: {PROMPTS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, T=1",
            [(k, f"{med[k]:.0f} tok/s", ", ".join(f"{r:.0f}" for r in rates[k])) for k in rates]
            + [
                (
                    "native / hf",
                    f"{statistics.median(ratios):.2f}x",
                    ", ".join(f"{r:.2f}" for r in ratios),
                )
            ]
            + [(f"peak allocated, {k}", f"{peak[k]:.0f} MiB", "one call") for k in peak],
        )
    )


def test_continuous_batching_vs_waves(benchmark, tmp_path):
    """The engine at this checkout against the wave engine (``continuous_batching.BASE``) on
    GSM8K's long-tailed solution lengths, each in its own process, rounds alternating."""
    import argparse

    import continuous_batching as cb

    args = argparse.Namespace(
        base=os.environ.get("LIGHTRFT_BENCH_BASE", cb.BASE),
        base_src=None,
        workdir=os.environ.get("LIGHTRFT_BENCH_WORKDIR", str(tmp_path)),
        prompts=16,
        n=4,
        scale=1,
        max_num_seqs=16,
        rounds=ROUNDS,
        device=None,
        dtype="float32",
        peak=True,
        control=False,
    )
    result = benchmark.pedantic(lambda: cb.compare(args), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    assert result["identical_samples"] == result["rows"]  # fp32 on the CPU: token for token
    assert result["continuous_stats"]["admitted_while_decoding"] > 0


# Weight-sync models: the generate benchmark's (15.2 MiB fp32) and a larger one (240 MiB fp32).
SYNC_MODELS = {
    "15MiB": dict(layers=4, hidden=256, heads=4, kv_heads=2),
    "240MiB": dict(layers=4, hidden=1024, heads=8, kv_heads=4, intermediate=4096),
}


class _LoadOnly:
    """The engine seen through ``load_weights`` only (no ``weight_buffers``): the copying path."""

    def __init__(self, engine):
        self.engine, self.dtype = engine, engine.dtype

    def load_weights(self, weights):
        self.engine.load_weights(weights)

    def reset_prefix_cache(self):
        return self.engine.reset_prefix_cache()


def _sync_rounds(rank: int, world_size: int, model_dir: str, out_file: str) -> None:
    import torch.distributed as dist

    from lightrft.engine import NativeEngine, sync_weights
    from lightrft.models import load_causal_lm, parallelize

    model = parallelize(load_causal_lm(model_dir))
    engine = NativeEngine(model_dir)
    via_load = _LoadOnly(engine)
    numel = sum(p.numel() for p in model.parameters())
    shard = torch.randn(-(-numel // world_size))
    gathered = torch.empty(world_size * shard.numel())
    sides = {
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
        "sync_weights": lambda: sync_weights(model, engine),
        "sync_weights via load_weights": lambda: sync_weights(model, via_load),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # both sides end when the slowest rank is done
        times[name].append(time.perf_counter() - t0)

    # Peak torch memory allocated during one call on rank 0: the first sync (it builds the plan
    # and allocates the pack and gather buffers that later syncs reuse), a later sync, and the
    # all_gather (into its preallocated output buffer, whose size is listed too).
    peak = {"sync_weights, first": peak_allocated_mib(sides["sync_weights"])}
    sides["all_gather"]()  # warm-up
    sides["sync_weights via load_weights"]()
    peak["sync_weights, later"] = peak_allocated_mib(sides["sync_weights"])
    peak["sync_weights via load_weights, later"] = peak_allocated_mib(
        sides["sync_weights via load_weights"]
    )
    peak["all_gather"] = peak_allocated_mib(sides["all_gather"])
    peak["(all_gather output buffer)"] = gathered.nbytes / 2**20
    for _ in range(4 * ROUNDS):
        for name, fn in sides.items():
            timed(name, fn)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"times": times, "bytes": numel * 4, "peak_mib": peak}, f)


@pytest.mark.parametrize("size", list(SYNC_MODELS))
def test_weight_sync_vs_all_gather(benchmark, tmp_path, size):
    from _dist import run_distributed

    from lightrft.tasks import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", **SYNC_MODELS[size])
    out_file = tmp_path / "sync.json"
    benchmark.pedantic(
        lambda: run_distributed(_sync_rounds, str(model_dir), str(out_file)),
        rounds=1,
        iterations=1,
    )
    result = json.loads(out_file.read_text())
    times = result["times"]
    base = times["all_gather"]
    ratios = {
        k: [s / g for s, g in zip(v, base, strict=True)] for k, v in times.items() if v is not base
    }
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    peak = result["peak_mib"]
    benchmark.extra_info.update(
        ms=med,
        ratio_median={k: statistics.median(v) for k, v in ratios.items()},
        bytes=result["bytes"],
        peak_mib=peak,
    )
    print(
        _table(
            f"weight sync, 2 gloo processes, {result['bytes'] / 2**20:.1f} MiB fp32, "
            f"load average {os.getloadavg()[0]:.1f} at the end",
            [(k, f"{med[k]:.1f} ms", ", ".join(f"{x * 1e3:.0f}" for x in times[k])) for k in times]
            + [
                (
                    f"{k} / all_gather",
                    f"{statistics.median(r):.2f}x",
                    ", ".join(f"{x:.2f}" for x in r),
                )
                for k, r in ratios.items()
            ]
            + [(f"peak allocated, {k}", f"{v:.1f} MiB", "rank 0") for k, v in peak.items()],
        )
    )
