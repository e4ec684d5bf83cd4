"""The one-command GPU benchmark suite: one Markdown table of the figures that matter on a GPU.

    python tests/benchmarks/gpu_suite.py --out gpu_suite.md     # one GPU, under 10 minutes
    python tests/benchmarks/gpu_suite.py --tiny                 # CPU: tiny shapes, seconds

Rows (random weights at real shapes; nothing is downloaded):

- ``train``: one actor training step (token log-probs through the fused kernel, backward, AdamW)
  of a Qwen2.5-0.5B- and a 1.5B-shaped model under FSDP2 (a one-process group) with bf16 compute
  and ``torch.compile``d decoder blocks; tokens/s, model TFLOP/s and MFU against the chip's dense
  bf16 peak. FLOPs per token: ``6 * N + 6 * layers * seq * hidden`` (``N``: the parameters that
  multiply, the tied LM head counted once; the second term: causal attention, forward+backward).
- ``logprobs``: the fused log-prob kernels against the naive ``log_softmax(h @ W.T)`` at the
  151,936 vocabulary (Qwen2.5-0.5B's LM head), forward+backward, side by side round-robin.
- ``decode``: the native engine's and vLLM's sampling tokens/s on the same prompts (0.5B shape).
- ``sync``: ``sync_weights`` from the FSDP2 model into the native engine and into vLLM, per shape.
- ``vlm grpo step``: the GRPO recipe end to end on a small Qwen2-VL (counting boards), two steps;
  the second step's time.
- ``offload``: the same FSDP2 training step of the 0.5B shape loaded from disk as the recipes
  load it (``load_parallel``), with and without ``offload: params`` (FSDP2's
  ``CPUOffloadPolicy``: shards, gradients and AdamW state in host memory, the step on the
  CPU), clipped as the recipes clip; then a weight sync into the native engine. The peak device
  memory of the steps, the step time and the host's resident memory after them.

Every row records the CUDA caching allocator's peak (``torch.cuda.max_memory_allocated``, reset
before the row). A row that cannot run here (no CUDA, vLLM not installed) is written with the
reason instead of a figure. ``--tiny`` swaps in tiny shapes so that the whole suite runs on a
CPU in seconds: the test of this file (tests/benchmarks/test_gpu_suite.py) runs it so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# Dense bf16 peaks (TFLOP/s, no sparsity) of the SXM parts, by the name CUDA reports.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}

QWEN_VOCAB = 151936
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864),
    "qwen2.5-1.5b": dict(layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960),
}
TINY_SHAPES: dict[str, dict] = {
    "tiny-a": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128),
    "tiny-b": dict(layers=3, hidden=96, heads=4, kv_heads=2, intermediate=192),
}


@dataclass
class Settings:
    """What the rows run at: the real shapes on a GPU, tiny ones under ``--tiny``."""

    device: torch.device
    shapes: dict[str, dict]
    vocab: int
    train_batch: tuple[int, int]  # [micro batch, sequence length]
    train_steps: int  # timed steps, after 2 warm-up steps (compilation)
    compile: bool
    kernel_head: tuple[int, int]  # (vocab, hidden) of the LM head
    kernel_tokens: int
    kernel_repeats: int
    decode_prompts: int
    decode_samples: int
    decode_tokens: int
    vlm: dict  # make_tiny_model sizes of the VLM

    @classmethod
    def make(cls, tiny: bool, device: torch.device) -> Settings:
        if tiny:
            return cls(
                device,
                TINY_SHAPES,
                4096,
                (2, 64),
                2,
                False,
                (4096, 64),
                64,
                2,
                4,
                2,
                8,
                dict(layers=2, hidden=64, heads=4, kv_heads=2),
            )
        return cls(
            device,
            SHAPES,
            QWEN_VOCAB,
            (4, 2048),
            5,
            True,
            (QWEN_VOCAB, 896),
            8192,
            10,
            64,
            8,
            256,
            dict(layers=4, hidden=512, heads=8, kv_heads=4),
        )


@dataclass
class Row:
    name: str
    figures: dict[str, str] = field(default_factory=dict)
    peak_gib: float | None = None
    skipped: str | None = None  # the reason, for a row that could not run here


class Skip(Exception):
    """A row that cannot run in this environment; the message is the reason."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def peak_tflops(device: torch.device) -> float | None:
    """The chip's dense bf16 peak, or None where it is not known (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul per token: all but the input embedding, whose rows
    are only looked up; a tied LM head is the embedding matrix and is counted once as the head."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return total if emb is head else total - emb.numel()


def train_flops_per_token(n_matmul: int, layers: int, seq: int, hidden: int) -> float:
    """Forward+backward FLOPs per token: ``6 N`` for the weights, plus causal attention's
    ``QK^T`` and ``AV`` (``2 * 2 * seq * hidden`` per token forward, halved by the causal mask,
    times 3 for forward+backward) per layer."""
    return 6.0 * n_matmul + 6.0 * layers * seq * hidden


def _build_lm(shape: dict, vocab: int, device: torch.device, dtype: torch.dtype):
    """A random-init Qwen2 causal LM of ``shape`` (tied embeddings, as Qwen2.5 0.5B and 1.5B)
    built directly on ``device``, plus the tiny character tokenizer (its ids are all < vocab)."""
    from transformers import AutoModelForCausalLM

    from lightrft.tasks.tiny import char_tokenizer, tiny_config

    tok = char_tokenizer()
    cfg = tiny_config(
        vocab,
        **shape,
        max_positions=4096,
        tie_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model, tok


def _one_process_group(device: torch.device) -> None:
    """FSDP2 needs a process group: a one-process one (nccl on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------- rows


def train_and_sync_rows(s: Settings, name: str, shape: dict) -> list[Row]:
    """The training row of one shape, then the sync rows from the same FSDP2 model."""
    from lightrft.engine import NativeEngine, sync_weights
    from lightrft.models import parallelize
    from lightrft.models.forward import causal_lm_token_logprobs
    from lightrft.models.parallel import default_param_dtype

    dev = s.device
    _one_process_group(dev)
    _reset_peak(dev)
    model, tok = _build_lm(shape, s.vocab, dev, torch.float32)  # fp32 master weights
    n_matmul = matmul_params(model)
    compute = default_param_dtype(dev)  # what parallelize casts to: bf16 on CUDA, fp32 on CPU
    model = parallelize(model, compile=s.compile, shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    b, seq = s.train_batch
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(len(tok), s.vocab, (b, seq), generator=gen).to(dev)

    def step() -> None:
        logp = causal_lm_token_logprobs(model, ids)  # [b, seq - 1], the fused kernel's path
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = _timed(step, dev)  # compiles
    step()
    times = [_timed(step, dev) for _ in range(s.train_steps)]
    sec = statistics.median(times)
    tokens = b * seq
    tflops = train_flops_per_token(n_matmul, shape["layers"], seq, shape["hidden"]) * tokens
    tflops /= sec * 1e12
    peak = peak_tflops(dev)
    rows = [
        Row(
            f"train {name} (FSDP2, {str(compute).removeprefix('torch.')}, compile={s.compile})",
            {
                "tokens/s": f"{tokens / sec:,.0f}",
                "model TFLOP/s": f"{tflops:.3g}",
                "MFU": f"{tflops / peak:.1%}" if peak else "n/a (no known bf16 peak here)",
                "step": f"{sec * 1e3:.0f} ms median of {len(times)} ([{b}, {seq}] tokens; "
                f"first step {first:.1f} s)",
                "params": f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M",
            },
            _peak_gib(dev),
        )
    ]
    # Weight sync into an engine holding its own bf16 (CUDA) or fp32 (CPU) copy.
    _reset_peak(dev)
    engine_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    copy, _ = _build_lm(shape, s.vocab, dev, engine_dtype)
    engine = NativeEngine(copy, tok, dtype=engine_dtype, device=dev, max_num_seqs=8)
    sync_weights(model, engine)  # builds and caches the plan
    times = [_timed(lambda: sync_weights(model, engine), dev) for _ in range(3)]
    size_gib = sum(p.numel() for p in copy.parameters()) * copy.dtype.itemsize / 2**30
    rows.append(
        Row(
            f"sync {name}: FSDP2 -> native engine",
            {
                "time": f"{statistics.median(times) * 1e3:.0f} ms median of 3",
                "bytes": f"{size_gib:.2f} GiB ({str(engine_dtype).removeprefix('torch.')})",
            },
            _peak_gib(dev),
        )
    )
    rows.append(_vllm_sync_row(s, name, model, tok))
    return rows  # the model, optimizer and engines go with this frame


def _vllm_sync_row(s: Settings, name: str, model, tok) -> Row:
    row = Row(f"sync {name}: FSDP2 -> vLLM")
    try:
        engine, _ = _vllm_engine(s, model.config, tok)
    except Skip as e:
        row.skipped = str(e)
        return row
    from lightrft.engine import sync_weights

    _reset_peak(s.device)
    sync_weights(model, engine)
    times = [_timed(lambda: sync_weights(model, engine), s.device) for _ in range(3)]
    row.figures["time"] = f"{statistics.median(times) * 1e3:.0f} ms median of 3"
    row.peak_gib = _peak_gib(s.device)
    return row


def _vllm_engine(s: Settings, config, tok):
    """A VLLMEngine on a saved copy of ``config`` (random weights), or Skip with the reason."""
    if s.device.type != "cuda":
        raise Skip("vLLM needs CUDA")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise Skip(f"vllm is not installed ({e}); pip install -e '.[vllm]'") from None
    from transformers import AutoModelForCausalLM

    from lightrft.engine import VLLMEngine

    # vLLM loads from a directory: save random bf16 weights of the same config once.
    path = Path(tempfile.mkdtemp(prefix="gpu_suite_vllm_"))
    m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    m.save_pretrained(path)
    tok.save_pretrained(path)
    del m
    return VLLMEngine(str(path), gpu_memory_utilization=0.35, max_num_seqs=512), path


def kernel_row(s: Settings) -> Row:
    from lightrft.kernels.benchmarking import compare, provider_available

    dev = str(s.device)
    providers = ("naive", "matmul", "lightrft", "liger")
    missing = [p for p in providers if not provider_available(p, dev)]
    _reset_peak(s.device)
    cuda = s.device.type == "cuda"
    res = compare(
        s.kernel_head,
        s.kernel_tokens,
        providers=providers,
        repeats=s.kernel_repeats,
        dtype="bfloat16" if cuda else "float32",
        device=dev,
        memory=cuda,  # on CPU each probe is a fresh subprocess: docs/kernels.md has those
    )
    figures = {
        p: f"{r['median_s'] * 1e3:.2f} ms ({r.get('vs_naive', 1.0):.2f}x naive's time"
        + (f", {r['transient_mib']:.0f} MiB transient)" if cuda else ")")
        for p, r in res.items()
    }
    for p in missing:
        figures[p] = "skipped: " + (
            "Liger's Triton kernel needs CUDA" if p == "liger" else "not available here"
        )
    vocab, hidden = s.kernel_head
    return Row(
        f"logprobs fwd+bwd, {s.kernel_tokens} tokens x {vocab:,} vocab x {hidden} hidden",
        figures,
        None,  # per provider above: compare() probes each one's transient peak on its own
    )


def decode_rows(s: Settings) -> list[Row]:
    from lightrft.engine import NativeEngine, Request, SamplingParams

    dev = s.device
    name, shape = next(iter(s.shapes.items()))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    _reset_peak(dev)
    model, tok = _build_lm(shape, s.vocab, dev, dtype)
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": f"What is {a} + {3 * a}?"}],
                add_generation_prompt=True,
                tokenize=True,
            )["input_ids"]
        )
        for a in range(s.decode_prompts)
    ]
    # ignore_eos: every row decodes max_tokens (random weights would stop at random places).
    sp = SamplingParams(
        n=s.decode_samples, temperature=1.0, max_tokens=s.decode_tokens, ignore_eos=True, seed=0
    )
    requests = [Request(p) for p in prompts]
    label = (
        f"decode {name}: {s.decode_prompts} prompts x {s.decode_samples} samples x "
        f"{s.decode_tokens} tokens"
    )

    def rate(engine) -> tuple[float, list[float]]:
        engine.generate(requests, sp)  # warm-up
        rates = []
        for _ in range(2):
            t0 = time.perf_counter()
            outs = engine.generate(requests, sp)
            rates.append(sum(len(c.token_ids) for c in outs) / (time.perf_counter() - t0))
        return statistics.median(rates), rates

    rows = []
    # On CUDA also with compile=True (the MLPs compiled; built second, since it compiles the
    # shared model's modules in place).
    for compiled in (False, True) if dev.type == "cuda" else (False,):
        _reset_peak(dev)
        native = NativeEngine(
            model,
            tok,
            dtype=dtype,
            device=dev,
            compile=compiled,
            max_num_seqs=s.decode_prompts * s.decode_samples,
        )
        med, rates = rate(native)
        figures = {"tokens/s": f"{med:,.0f}", "rounds": ", ".join(f"{r:,.0f}" for r in rates)}
        rows.append(Row(f"{label}, native engine (compile={compiled})", figures, _peak_gib(dev)))
        del native
        gc.collect()
    row = Row(f"{label}, vLLM")
    try:
        _reset_peak(dev)
        engine, _ = _vllm_engine(s, model.config, tok)
        med, rates = rate(engine)
        row.figures = {
            "tokens/s": f"{med:,.0f}",
            "rounds": ", ".join(f"{r:,.0f}" for r in rates),
            "memory": "vLLM's own pool (gpu_memory_utilization=0.35)",
        }
    except Skip as e:
        row.skipped = str(e)
    rows.append(row)
    del model
    return rows


def vlm_grpo_row(s: Settings, work: Path) -> Row:
    """Two steps of the GRPO recipe on a small Qwen2-VL through the real CLI, in-process."""
    import yaml

    from lightrft import cli
    from lightrft.training import read_metrics

    prompts = {
        "_component_": "lightrft.data.PromptDataset",
        "media": {"image": {"max_pixels": 56 * 56}},
    }
    data = work / "vlm_data"
    cfg = {
        "output_dir": str(work / "vlm_out"),
        "seed": 0,
        "device": s.device.type,
        "prepare": [
            {
                "_component_": "lightrft.tasks.ensure_tiny_model",
                "out_dir": str(work / "vlm"),
                "arch": "qwen2_vl",
                **s.vlm,
            },
            {
                "_component_": "lightrft.tasks.ensure_shapes_dataset",
                "out_dir": str(data),
                "n_train": 64,
                "n_test": 8,
                "grid": 2,
                "max_count": 3,
            },
        ],
        "model": {"path": str(work / "vlm")},
        "dataset": {**prompts, "path": str(data / "train.jsonl")},
        "reward": {"_component_": "lightrft.rewards.ExactMatch"},
        "rollout": {"prompts_per_step": 16, "n": 8, "max_tokens": 8},
        "algorithm": {"advantage": {"estimator": "grpo"}, "old_logprobs": "engine"},
        "train": {"micro_batch_size": 64, "ppo_epochs": 1},
        "max_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
        "metrics": {"tensorboard": False},
    }
    path = work / "vlm_grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    _reset_peak(s.device)
    if cli.main(["run", "grpo", "--config", str(path)]) != 0:
        raise RuntimeError(f"the VLM GRPO run failed; config {path}")
    rows = [r for r in read_metrics(work / "vlm_out") if "time/step" in r]
    last = rows[-1]
    figures = {
        "step": f"{last['time/step'] * 1e3:.0f} ms (step {last['step']}; rollout "
        f"{last['time/rollout'] * 1e3:.0f} ms, training {last['time/training'] * 1e3:.0f} ms)",
        "samples": "16 boards x 8 samples",
        "train/approx_kl": f"{last['train/approx_kl']:.1e} (trainer vs engine log-probs)",
    }
    peak = last.get("memory/peak_allocated_gib")
    return Row(f"vlm grpo step (Qwen2-VL {s.vlm['layers']}x{s.vlm['hidden']})", figures, peak)


def _resident_gib() -> float:
    """This process's resident memory now (``/proc/self/statm``), GiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def offload_rows(s: Settings, work: Path) -> list[Row]:
    """Training steps of the first shape with ``offload: none`` and ``offload: params``."""
    from lightrft.engine import NativeEngine, sync_weights
    from lightrft.models.sharded import load_parallel
    from lightrft.training.checkpoint import Checkpointer
    from lightrft.training.optim import optimizer_step

    dev = s.device
    name, shape = next(iter(s.shapes.items()))
    _one_process_group(dev)
    path = work / "offload_model"
    model, tok = _build_lm(shape, s.vocab, torch.device("cpu"), torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    # A short batch, so that the model states (what offload moves) rather than the
    # activations make the peak.
    b, seq = s.train_batch if dev.type != "cuda" else (1, 1024)
    ids = torch.randint(len(tok), s.vocab, (b, seq), generator=torch.Generator().manual_seed(0))
    rows = []
    for offload in (False, True):
        _reset_peak(dev)
        model = load_parallel(path, device=dev, offload=offload)  # fp32 master weights
        # Offloaded shards step on the CPU (AdamW's foreach path); on the device, fused.
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-5, fused=dev.type == "cuda" and not offload
        )
        x = ids.to(dev)

        losses = []

        def step(model=model, opt=opt, x=x, losses=losses) -> None:
            from lightrft.models.forward import causal_lm_token_logprobs

            loss = -causal_lm_token_logprobs(model, x).mean()
            loss.backward()
            optimizer_step(model, opt, 1.0)
            losses.append(loss.item())

        step()
        times = [_timed(step, dev) for _ in range(max(2, s.train_steps // 2))]
        peak = _peak_gib(dev)
        held = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        rss = _resident_gib()
        # A checkpoint of the (offloaded) shards and AdamW state, loaded back into them.
        ckpt = Checkpointer(work / f"offload_ckpt_{offload}", keep_last=1)
        t_save = _timed(lambda m=model, o=opt, c=ckpt: c.save(1, models=m, optimizers=o), dev)
        t_load = _timed(
            lambda m=model, o=opt, c=ckpt: c.load_latest(models=m, optimizers=o, restore_rng=False),
            dev,
        )
        engine = NativeEngine(
            path,
            dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
            device=dev,
            max_num_seqs=8,
        )
        sync = _timed(lambda m=model, e=engine: sync_weights(m, e), dev)
        rows.append(
            Row(
                f"offload {name}: offload={'params' if offload else 'none'} (FSDP2, AdamW)",
                {
                    "step": f"{statistics.median(times) * 1e3:.0f} ms median of {len(times)} "
                    f"([{b}, {seq}] tokens)",
                    "host resident": f"{rss:.2f} GiB after the steps",
                    "device allocated": "-" if held is None else f"{held:.2f} GiB after the steps",
                    "sync": f"{sync * 1e3:.0f} ms into the native engine",
                    "checkpoint": f"save {t_save:.1f} s, load {t_load:.1f} s",
                    "losses": ", ".join(f"{v:.4f}" for v in losses),
                },
                peak,
            )
        )
        # FSDP2 modules sit in reference cycles: drop every reference (the step's defaults
        # too) and collect now, or this model's weights would count in the next row's peak.
        del model, opt, engine, step, x
        gc.collect()
    return rows


# ------------------------------------------------------------------------------------- the table


def format_table(rows: list[Row], header: str) -> str:
    lines = [header, "", "| row | figures | peak allocated |", "|---|---|---|"]
    for r in rows:
        figs = (
            f"skipped: {r.skipped}"
            if r.skipped
            else "; ".join(f"{k}: {v}" for k, v in r.figures.items())
        )
        peak = "-" if r.peak_gib is None else f"{r.peak_gib:.2f} GiB"
        lines.append(f"| {r.name} | {figs} | {peak} |")
    return "\n".join(lines) + "\n"


def environment_line(device: torch.device) -> str:
    import platform

    import transformers

    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})"
    return (
        f"{where}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}"
    )


def run(tiny: bool, only: set[str] | None = None) -> tuple[list[Row], str]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    s = Settings.make(tiny, device)
    rows: list[Row] = []

    def attempt(key: str, fn: Callable[[], list[Row] | Row]) -> None:
        if only and key not in only:
            return
        t0 = time.perf_counter()
        try:
            out = fn()
        except Skip as e:
            out = Row(key, skipped=str(e))
        except Exception as e:  # one failing row must not hide the others' figures
            out = Row(key, skipped=f"FAILED: {type(e).__name__}: {str(e)[:300]}")
            import traceback

            traceback.print_exc()
        new = out if isinstance(out, list) else [out]
        rows.extend(new)
        print(format_table(new, f"({key}: {time.perf_counter() - t0:.0f} s)"), flush=True)

    for name, shape in s.shapes.items():
        attempt("train", lambda n=name, sh=shape: train_and_sync_rows(s, n, sh))
    attempt("logprobs", lambda: kernel_row(s))
    attempt("decode", lambda: decode_rows(s))
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as work:
        attempt("vlm", lambda: vlm_grpo_row(s, Path(work)))
        attempt("offload", lambda: offload_rows(s, Path(work)))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return rows, environment_line(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: the suite's test)")
    ap.add_argument(
        "--only",
        nargs="*",
        choices=["train", "logprobs", "decode", "vlm", "offload"],
        help="run only these rows",
    )
    ap.add_argument("--out", type=Path, help="write the Markdown table (and .json beside it)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows, env = run(args.tiny, set(args.only) if args.only else None)
    table = format_table(rows, f"{env}; suite wall time {time.perf_counter() - t0:.0f} s")
    print("\n" + table)
    if args.out:
        args.out.write_text(table)
        args.out.with_suffix(".json").write_text(
            json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=1)
        )
    failed = [r.name for r in rows if r.skipped and r.skipped.startswith("FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
