"""pytest-benchmark suite: fused linear log-probs vs the naive path, on real LM-head shapes.

Opt-in (skipped in the default test run)::

    OMP_NUM_THREADS=2 pytest kernels/bench_logprobs.py -m benchmark_suite --benchmark-enable \
        -k "qwen2.5-0.5b and fwd+bwd"

Environment: ``LIGHTRFT_BENCH_TOKENS`` (default 4096 on CUDA, 1024 on CPU),
``LIGHTRFT_BENCH_DTYPE`` (default bfloat16 on CUDA, float32 on CPU), ``LIGHTRFT_BENCH_ROUNDS``
(default 3). Each benchmark records its peak transient memory (MiB above the inputs and the
returned gradients, see ``lightrft.kernels.benchmarking``) in ``extra_info``; on CPU that costs
one more run in a fresh subprocess. Without ``--benchmark-enable`` (the project's default
``--benchmark-disable``) each case runs once, unmeasured.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightrft.kernels.benchmarking import (
    CONFIGS,
    DTYPES,
    MODES,
    PROVIDERS,
    make_inputs,
    peak_memory_mib,
    prepared,
    provider_available,
    sync,
)

pytestmark = pytest.mark.benchmark_suite

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOKENS = int(os.environ.get("LIGHTRFT_BENCH_TOKENS", 4096 if DEVICE == "cuda" else 1024))
DTYPE = os.environ.get("LIGHTRFT_BENCH_DTYPE", "bfloat16" if DEVICE == "cuda" else "float32")
ROUNDS = int(os.environ.get("LIGHTRFT_BENCH_ROUNDS", 3))

_cache: dict[tuple, object] = {}


@pytest.fixture(autouse=True)
def _opt_in(request):
    if "benchmark_suite" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("benchmark suite: run with -m benchmark_suite")


def _inputs(config: str):
    """One set of inputs alive at a time (an 8B LM head is 2 GiB in fp32)."""
    key = (config, TOKENS, DTYPE, DEVICE)
    if key not in _cache:
        _cache.clear()
        vocab, hidden = CONFIGS[config]
        _cache[key] = make_inputs(
            TOKENS, vocab, hidden, dtype=DTYPES[DTYPE], device=DEVICE, floor=True
        )
    return _cache[key]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_logprobs(benchmark, config, provider, mode):
    if not provider_available(provider, DEVICE):
        pytest.skip(f"{provider} does not run on {DEVICE} here")
    inp = _inputs(config)
    vocab, hidden = CONFIGS[config]
    benchmark.group = f"{config} N={TOKENS} {DTYPE} {mode}"
    benchmark.extra_info.update(
        tokens=TOKENS, vocab=vocab, hidden=hidden, dtype=DTYPE, device=DEVICE, mode=mode
    )

    def setup():  # not measured: clears the gradients, makes the forward of a backward
        return (prepared(provider, mode, inp),), {}

    def target(call):
        call()
        sync(torch.device(DEVICE))

    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, iterations=1)
    inp.zero_grad()
    if benchmark.enabled:
        mem = peak_memory_mib(provider, mode, TOKENS, vocab, hidden, DTYPE, DEVICE)
        benchmark.extra_info["peak_transient_mib"] = round(mem["transient"], 1)
        benchmark.extra_info["peak_above_inputs_mib"] = round(mem["peak_above_inputs"], 1)
