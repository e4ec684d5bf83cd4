"""Shapes, providers, timing and a peak-memory probe for the log-prob kernel benchmarks.

Used by the pytest-benchmark suite ``kernels/bench_logprobs.py`` and runnable on its own for the
side-by-side comparison written in docs/kernels.md::

    OMP_NUM_THREADS=2 python -m lightrft.kernels.benchmarking compare --tokens 4096 --repeats 3

Peak memory, two figures per call:

- ``transient``: from the torch profiler's allocator events (``profile_memory=True``), the bytes
  allocated during the call minus the returned gradients still alive, at the worst moment. This
  is exact for torch tensors on CPU and CUDA alike; Python tracers (tracemalloc) do not see
  torch's allocations, and CPU torch keeps no allocator statistics.
- ``peak_above_inputs``: the whole footprint's peak above the moment before the call, returned
  gradients and non-torch buffers (BLAS workspaces) included. CPU: the process's resident-set
  high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``); tensors of this size are
  mmap'ed and unmapped by the allocator, so the resident set follows the live tensors. CUDA: the
  caching allocator's peak.

On CPU each measurement runs in a fresh subprocess that builds the inputs, warms the provider up
on a tiny shape and runs once.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .logprobs import fused_linear_logprobs, liger_available

# (vocab, hidden) of the LM heads of real models.
CONFIGS: dict[str, tuple[int, int]] = {
    "qwen2.5-0.5b": (151936, 896),
    "qwen2.5-7b": (152064, 3584),
    "llama-3-8b": (128256, 4096),
}
MODES = ("forward", "backward", "fwd+bwd")
PROVIDERS = ("naive", "lightrft", "lightrft-hint", "liger-chunked", "liger", "matmul")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Inputs:
    hidden: Tensor  # [N, H], requires grad
    weight: Tensor  # [V, H], requires grad
    targets: Tensor  # [N]
    grad: Tensor  # [N] upstream gradient of the log-probs
    grad_logits: Tensor | None = None  # [N, V], only for the matmul floor

    def zero_grad(self) -> None:
        self.hidden.grad = None
        self.weight.grad = None


def make_inputs(
    n: int,
    vocab: int,
    hidden: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    floor: bool = False,
) -> Inputs:
    """Random inputs at the scale of a trained LM head; built in place so no temporary peaks."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(n, hidden, generator=gen).to(device=device, dtype=dtype)
    w = torch.empty(vocab, hidden, dtype=dtype, device=device)
    w.copy_(torch.randn(vocab, hidden, generator=gen).mul_(hidden**-0.5))
    targets = torch.randint(0, vocab, (n,), generator=gen).to(device)
    grad = torch.randn(n, generator=gen).to(device)
    gz = torch.empty(n, vocab, dtype=dtype, device=device).normal_() if floor else None
    return Inputs(h.requires_grad_(), w.requires_grad_(), targets, grad, gz)


def _liger_chunked():
    # Liger's pure-torch selective log-prob inside its chunked PPO/GRPO losses (private API of
    # liger-kernel 0.8.x): the closest existing provider that runs on CPU.
    from liger_kernel.chunked_loss.fused_linear_ppo import (
        _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE,
        _ChunkedSelectiveLogProbFunction,
    )

    return _ChunkedSelectiveLogProbFunction, _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE


def provider_available(name: str, device: str | torch.device) -> bool:
    """Whether ``name`` can run on ``device`` in this environment."""
    if name not in PROVIDERS:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {name!r}")
    if name == "liger":
        return liger_available(torch.empty(0, device=device))
    if name == "liger-chunked":
        try:
            _liger_chunked()
        except Exception:
            return False
    return True


def forward_fn(name: str, inp: Inputs) -> Callable[[], Tensor]:
    """A closure computing the provider's log-probs [N] (the floor: the logits [N, V])."""
    h, w, t = inp.hidden, inp.weight, inp.targets
    if name == "naive":
        return lambda: torch.log_softmax((h @ w.t()).float(), -1).gather(-1, t[:, None]).squeeze(1)
    if name == "lightrft":
        return lambda: fused_linear_logprobs(h, w, t, backend="torch")
    if name == "lightrft-hint":
        # The upstream gradient is known in the forward (a weighted sum of the log-probs): the
        # gradients are computed there and the backward returns them.
        g = inp.grad.float()
        return lambda: fused_linear_logprobs(
            h, w, t, backend="torch", grad_hint=lambda rows, logp, entropy: (g[rows], None)
        )
    if name == "liger":
        return lambda: fused_linear_logprobs(h, w, t, backend="liger")
    if name == "liger-chunked":
        fn, vocab_chunk = _liger_chunked()
        return lambda: fn.apply(h, w, t, None, 1.0, vocab_chunk)
    if name == "matmul":
        return lambda: h @ w.t()
    raise ValueError(f"provider must be one of {PROVIDERS}, got {name!r}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepared(name: str, mode: str, inp: Inputs) -> Callable[[], Tensor]:
    """The measured part of one ``mode`` call, ready to run: the backward of a forward made here
    for ``backward``, else a forward and, for ``fwd+bwd``, its backward. Gradients are cleared
    first. The call returns the output, which the caller keeps alive until it has measured."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fwd = forward_fn(name, inp)
    grad = inp.grad_logits if name == "matmul" else inp.grad  # the floor's: the logits' [N, V]
    assert grad is not None, "make_inputs(floor=True) for the matmul floor"
    inp.zero_grad()
    gc.collect()
    made = fwd() if mode == "backward" else None
    sync(inp.hidden.device)

    def call() -> Tensor:
        out = made if made is not None else fwd()
        if mode != "forward":
            out.backward(grad.to(out.dtype))
        return out

    return call


def run_once(name: str, mode: str, inp: Inputs) -> float:
    """Seconds for one ``mode`` call (``backward`` times only the backward of a fresh forward)."""
    call = prepared(name, mode, inp)
    start = time.perf_counter()
    _out = call()  # kept alive until measured
    sync(inp.hidden.device)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Peak transient memory


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _allocations(fn: Callable[[], object], device: torch.device) -> list[tuple[int, int, int, int]]:
    """(time, address, bytes (+alloc / -free), bytes allocated since the start) of the torch
    allocator events on ``device`` during ``fn()``, in time order (from the profiler's)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        _out = fn()  # kept alive until measured
        sync(device)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.tag == _EventType.Allocation:
            f = ev.extra_fields
            if f.device.type == device.type:
                events.append((ev.start_time_ns, f.ptr, f.alloc_size))
    # The allocator's own ``total_allocated`` is a process-wide counter on CPU that keeps
    # tensors from earlier profiling sessions freed while no profiler ran: sum the events instead.
    events.sort()
    totals = itertools.accumulate(size for _, _, size in events)
    return [(*event, total) for event, total in zip(events, totals, strict=True)]


def transient_peak_bytes(events: list[tuple[int, int, int, int]], grad_ptrs: set[int]) -> int:
    """Peak over time of (bytes allocated since the start) minus (returned gradients alive).

    A returned gradient is the last allocation at the address of a final ``.grad``; it counts
    as alive from that allocation on.
    """
    last = {ptr: i for i, (_, ptr, size, _) in enumerate(events) if size > 0 and ptr in grad_ptrs}
    starts, peak, grads_alive = set(last.values()), 0, 0
    for i, (_, _, size, total) in enumerate(events):
        grads_alive += size if i in starts else 0
        peak = max(peak, total - grads_alive)
    return peak


def peak_allocated_mib(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """Peak of the torch memory allocated during ``fn()`` above the moment it starts, in MiB
    (from the profiler's allocator events; memory freed during the call counts down). For
    benchmarks outside the kernels too, e.g. the engine's in tests/benchmarks."""
    return transient_peak_bytes(_allocations(fn, torch.device(device)), set()) / 2**20


def _probe_in_process(name: str, mode: str, inp: Inputs) -> dict[str, float]:
    """Peak memory of one call in this process, in MiB.

    ``transient``: torch allocations made during the call, minus the returned gradients, at its
    worst moment (from the profiler's allocation events). ``peak_above_inputs``: the peak of the
    whole footprint above the moment before the call, returned gradients and non-torch buffers
    (BLAS workspaces) included: resident set on CPU, the caching allocator on CUDA.
    """
    call = prepared(name, mode, inp)
    dev = inp.hidden.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) / 2**20
    else:
        base = _status_mib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set size (Linux >= 4.0)
    events = _allocations(call, dev)
    peak = (
        torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else _status_mib("VmHWM")
    )
    grads = {t.grad.data_ptr() for t in (inp.hidden, inp.weight) if t.grad is not None}
    transient = transient_peak_bytes(events, grads)
    return {"transient": transient / 2**20, "peak_above_inputs": peak - base}


def peak_memory_mib(
    name: str, mode: str, n: int, vocab: int, hidden: int, dtype: str = "float32", device="cpu"
) -> dict[str, float]:
    """Peak memory (MiB) of one call: ``transient`` and ``peak_above_inputs`` (see
    ``_probe_in_process``). On CPU in a fresh subprocess, so that nothing cached from earlier
    calls hides an allocation."""
    if torch.device(device).type == "cuda":
        return _probe(name, mode, n, vocab, hidden, dtype, device)
    cmd = [sys.executable, "-m", "lightrft.kernels.benchmarking", "_probe", name, mode]
    cmd += [str(n), str(vocab), str(hidden), dtype]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ.copy())
    if res.returncode != 0:
        raise RuntimeError(f"memory probe {cmd} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _probe(name, mode, n, vocab, hidden, dtype: str, device="cpu") -> dict[str, float]:
    """:func:`_probe_in_process` of one call on inputs made here, after a warm-up."""
    _warm_up(name, device, DTYPES[dtype])
    sizes = int(n), int(vocab), int(hidden)
    inp = make_inputs(*sizes, dtype=DTYPES[dtype], device=device, floor=name == "matmul")
    return _probe_in_process(name, mode, inp)


def _warm_up(name: str, device, dtype: torch.dtype) -> None:
    """Load libraries and initialise thread pools on a tiny shape, outside the measurement (whose
    ``prepared`` collects what is left of it)."""
    small = make_inputs(64, 512, 32, dtype=dtype, device=device, floor=name == "matmul")
    run_once(name, "fwd+bwd", small)


# ----------------------------------------------------------------------------------------------
# Side-by-side comparison (the table in docs/kernels.md)


def compare(
    config: str | tuple[int, int],
    n: int,
    *,
    providers: tuple[str, ...] = ("naive", "matmul", "lightrft", "lightrft-hint", "liger-chunked"),
    mode: str = "fwd+bwd",
    repeats: int = 3,
    dtype: str = "float32",
    device: str = "cpu",
    memory: bool = True,
) -> dict[str, dict[str, float]]:
    """Time the providers round-robin (so load from other processes hits all alike) and probe
    their peak memory. Returns ``{provider: {min_s, median_s, vs_naive, vs_matmul,
    transient_mib, peak_above_inputs_mib}}``; ``vs_*`` are medians of the per-round time ratios.
    ``config``: a key of :data:`CONFIGS` or a ``(vocab, hidden)`` pair."""
    vocab, hidden = CONFIGS[config] if isinstance(config, str) else config
    providers = tuple(p for p in providers if provider_available(p, device))
    inp = make_inputs(
        n, vocab, hidden, dtype=DTYPES[dtype], device=device, floor="matmul" in providers
    )
    for p in providers:
        _warm_up(p, device, DTYPES[dtype])
    times: dict[str, list[float]] = {p: [] for p in providers}
    for _ in range(repeats):
        for p in providers:
            times[p].append(run_once(p, mode, inp))
            print(f"  {p:14s} {times[p][-1]:8.2f} s", file=sys.stderr, flush=True)
    del inp
    gc.collect()
    out = {}
    for p in providers:
        row = {"min_s": min(times[p]), "median_s": statistics.median(times[p])}
        # Ratios within a round share the machine's load at that moment: report their median.
        for ref, key in (("naive", "vs_naive"), ("matmul", "vs_matmul")):
            if ref in times:
                row[key] = statistics.median(
                    a / b for a, b in zip(times[p], times[ref], strict=True)
                )
        if memory:
            mem = peak_memory_mib(p, mode, n, vocab, hidden, dtype, device)
            row.update({f"{key}_mib": mib for key, mib in mem.items()})
        out[p] = row
    return out


def format_table(results: dict[str, dict[str, float]]) -> str:
    """Markdown table: times, per-round time ratios to naive and to the matmul floor, memory."""
    lines = [
        "| provider | min time (s) | median time (s) | time / naive | time / matmul floor "
        "| peak transient (MiB) | memory / naive |",
        "|---|---|---|---|---|---|---|",
    ]
    naive_mem = results.get("naive", {}).get("transient_mib")

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for p, r in results.items():
        mem = r.get("transient_mib")
        mem_ratio = mem / naive_mem if mem is not None and naive_mem else None
        lines.append(
            f"| {p} | {r['min_s']:.2f} | {r['median_s']:.2f} | {fmt(r.get('vs_naive'), '.2f')} "
            f"| {fmt(r.get('vs_matmul'), '.2f')} | {fmt(mem, '.0f')} | {fmt(mem_ratio, '.3f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_probe":
        print(json.dumps(_probe(*argv[1:])))
        return
    ap = argparse.ArgumentParser(prog="python -m lightrft.kernels.benchmarking")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="time and memory of the providers side by side")
    c.add_argument("--config", default="qwen2.5-0.5b", choices=sorted(CONFIGS))
    c.add_argument("--tokens", type=int, default=4096)
    c.add_argument("--mode", default="fwd+bwd", choices=MODES)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    c.add_argument("--providers", default="naive,matmul,lightrft,lightrft-hint,liger-chunked,liger")
    c.add_argument("--no-memory", action="store_true")
    a = ap.parse_args(argv)
    res = compare(
        a.config,
        a.tokens,
        providers=tuple(a.providers.split(",")),
        mode=a.mode,
        repeats=a.repeats,
        dtype=a.dtype,
        device=a.device,
        memory=not a.no_memory,
    )
    print(json.dumps(res, indent=1))
    print(format_table(res))


if __name__ == "__main__":
    main()
