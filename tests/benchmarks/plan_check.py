"""Check ``lightrft plan``'s formulas against what real FSDP2 runs over gloo hold, per rank.

    MALLOC_MMAP_THRESHOLD_=1048576 python tests/benchmarks/plan_check.py          # 1, 2, 4 ranks
    MALLOC_MMAP_THRESHOLD_=1048576 python tests/benchmarks/plan_check.py 2        # one world size
    MALLOC_MMAP_THRESHOLD_=1048576 python tests/benchmarks/plan_check.py sp       # SP rows, 4 and 2
    python tests/benchmarks/plan_check.py sp --measured /tmp/lightrft_plan_check_sp_N.json

A random Qwen2 (hidden 1024, 10 layers, 16/4 heads, intermediate 2816, vocab 16384, untied head:
146M parameters, fp32) is written locally once, then each world size loads it with the recipes'
call (``lightrft.models.sharded.load_parallel``: FSDP2 over a gloo group, one unit per block) and
measures on every rank, exactly:

* the bytes of the local parameter, gradient and AdamW-state shards (after one clipped step);
* the bytes saved for backward by one micro-batch (one unpadded row of ``TOKENS`` tokens), with
  and without activation checkpointing, counted by ``torch.autograd.graph.saved_tensors_hooks``
  and deduplicated by storage; the gathered weights the linear layers save (whole parameters'
  shapes) are FSDP2's units, not activations, and are left out;
* the native engine's KV-cache pool after a ``generate`` (rank 0);
* as a cross-check, the rank's peak RSS over the training step above its RSS before (sampled
  every 2 ms; ``MALLOC_MMAP_THRESHOLD_`` makes freed buffers go back to the OS) against the
  planner's sum of the step's new terms.

CPU runs compute in fp32 (FSDP2's bf16 compute is the GPU's), so the planner is asked with
``device="cpu"``. Each printed row is measured / predicted.

``sp`` (``PLAN_CHECK_SP_MODEL=large``, ``PLAN_CHECK_SP_TOKENS``, ``PLAN_CHECK_SP_DEGREES``:
the 146M model, a shorter row, some degrees only; see below): Ulysses sequence parallelism (``lightrft.models.ulysses``) at SP 1, 2 and 4 on 4 gloo
processes and SP 1 and 2 on 2, one row of 16,384 tokens (one sample) per SP group, through the
recipes' log-prob funnel (``causal_lm_token_logprobs(..., sequence_parallel=)``: the rank's
slice, log-probs gathered over the group), on a smaller random Qwen2 (``SP_SIZES``: 6.0M
parameters, 8/4 heads; the 146M model would hold ~13 GB of activations per rank at 16k
tokens). Per rank: the bytes saved for backward with and without activation checkpointing (as
above), the peak RSS over the first training step, and the wall time of a second step (forward,
backward, AdamW; no hooks). The measurements are saved to a JSON file first, then printed
against the planner (``activation_bytes`` / ``logprob_bytes`` with ``sequence_parallel=N``)
with each term's ratio to SP 1 at the same world size.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from lightrft.training.plan import (  # noqa: E402
    EngineSetup,
    ModelShape,
    TrainedSetup,
    activation_bytes,
    gathered_bytes,
    logprob_bytes,
    model_state_terms,
)

MODEL_DIR = Path("/tmp/lightrft_plan_check_model")
SIZES = dict(
    hidden_size=1024,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
    vocab_size=16384,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TOKENS = 512  # one row; no parameter dimension equals it
TOLERANCE = 0.15


@dataclass
class RankResult:
    rank: int
    params: int
    grads: int
    optim: int
    acts: int
    acts_ckpt: int
    step_rss_delta: int
    kv_pool: int = 0
    kv_rows: int = 0
    kv_slots: int = 0


def make_model() -> Path:
    if (MODEL_DIR / "config.json").is_file():
        return MODEL_DIR
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    model.save_pretrained(MODEL_DIR)
    return MODEL_DIR


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest RSS seen while the block runs, sampled on a thread."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = _rss()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes saved for backward by one forward (unique storages), without whole weights."""
    weight_shapes = set()
    for p in model.parameters():
        shape = tuple(p.shape)  # a DTensor reports its global shape
        weight_shapes |= {shape, shape[::-1]}
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) not in weight_shapes and not hasattr(t, "to_local"):
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), st)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
    return sum(st.nbytes() for st in seen.values()), out


def worker(rank: int, world: int, path: str, queue) -> None:
    from lightrft.models.sharded import load_parallel

    ids = torch.randint(
        0, SIZES["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(1)
    )
    model = load_parallel(path, dtype="float32", device="cpu")
    params = sum(_local_bytes(p) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    with PeakRSS() as rss:
        acts, out = saved_bytes(model, ids)
        out.float().sum().backward()
        grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    optim = sum(_local_bytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    del out
    model_ck = load_parallel(path, dtype="float32", device="cpu", activation_checkpointing=True)
    acts_ckpt, out = saved_bytes(model_ck, ids)
    del out, model_ck
    result = RankResult(rank, params, grads, optim, acts, acts_ckpt, rss.peak - rss.start)
    if rank == 0 and world == 1:
        from lightrft.engine import SamplingParams
        from lightrft.engine.native import NativeEngine
        from lightrft.engine.protocol import Request

        plain = load_parallel(path, dtype="float32", device="cpu", shard=False)
        engine = NativeEngine(plain, tokenizer=None, dtype="float32", device="cpu", max_num_seqs=6)
        prompts = [[1 + i] * (12 + i) for i in range(4)]  # longest prompt 15 tokens
        engine.generate(
            [Request(p) for p in prompts], SamplingParams(n=2, max_tokens=9, temperature=1.0)
        )
        pool = engine._kv_pool  # the engine's one KV buffer (benchmark-only peek)
        result.kv_pool = pool.numel() * pool.element_size()
        result.kv_rows, result.kv_slots = 6, 15 + 9
    queue.put(result)


def check(world: int, path: Path) -> list[tuple[str, int, int]]:
    """(what, measured, predicted) rows, the measured value of every rank's worst ratio."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Manager().Queue()
    from tests._dist import run_distributed

    run_distributed(worker, str(path), queue, world_size=world)
    results = [queue.get() for _ in range(world)]
    shape = ModelShape.from_file(path / "config.json")
    t = TrainedSetup(master_bytes=4, compute_bytes=4, shard=world)
    terms = {x.name: x.device_bytes for x in model_state_terms(shape, t, "actor")}
    acts = activation_bytes(shape, TOKENS, 4, ckpt=False, repeat_kv=False)
    # Held from forward to backward: the forward's saved tensors (the block being recomputed in
    # backward adds one layer's set, the per-layer term the `acts` row checks).
    acts_ck = activation_bytes(shape, TOKENS, 4, ckpt=True, repeat_kv=False, recompute=False)
    # The step's new memory: gradients, AdamW state, activations, gathered units (the RSS
    # cross-check; a gloo run's communication buffers and allocator slack are not modelled).
    step = terms["actor gradients"] + terms["actor optimizer state"] + acts
    step += gathered_bytes(shape, t, trained=True) if world > 1 else 0
    rows: list[tuple[str, int, int]] = []

    def worst(attr: str, predicted: int) -> None:
        vals = [getattr(r, attr) for r in results]
        rows.append((attr, max(vals, key=lambda v: abs(v / predicted - 1)), predicted))

    worst("params", terms["actor parameters"])
    worst("grads", terms["actor gradients"])
    worst("optim", terms["actor optimizer state"])
    worst("acts", acts)
    worst("acts_ckpt", acts_ck)
    worst("step_rss_delta", step)
    kv = [r for r in results if r.kv_pool]
    if kv:
        e = EngineSetup("native", 4, kv[0].kv_rows, kv[0].kv_slots, 1)
        rows.append(("kv_cache", kv[0].kv_pool, e.rows * e.slots * shape.kv_bytes_per_token(4)))
    return rows


# ------------------------------------------------------------------ sequence parallelism

SP_MODEL_DIR = Path("/tmp/lightrft_plan_check_sp_model")
# The SP rows' model: the 146M one at 16k tokens holds ~13 GB of activations per rank at SP=1
# (4 ranks: ~52 GB, more than this machine's 23 GB) and takes minutes per step on 2 cores. This
# one (8/4 heads: SP 2 and 4 divide both) keeps a 16k-token row's step under a minute.
SP_SIZES = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=704,
    vocab_size=6000,  # no weight shape equals a [T / N, ...] activation
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
# PLAN_CHECK_SP_MODEL=large: the 146M model above instead (16/4 heads), for a shorter row
# (PLAN_CHECK_SP_TOKENS=3072: no [T / N] equals a weight dimension at SP 1, 2, 4).
if os.environ.get("PLAN_CHECK_SP_MODEL") == "large":
    SP_MODEL_DIR = Path("/tmp/lightrft_plan_check_sp_model_large")
    SP_SIZES = {**SIZES, "max_position_embeddings": 16384}
# One row, one sample: causal attention over all of it (PLAN_CHECK_SP_TOKENS: a quick run).
SP_TOKENS = int(os.environ.get("PLAN_CHECK_SP_TOKENS", 16384))
# PLAN_CHECK_SP_DEGREES=1,2: only these SP degrees (each that divides the world size).
SP_DEGREES = [int(n) for n in os.environ.get("PLAN_CHECK_SP_DEGREES", "1,2,4").split(",")]


@dataclass
class SPResult:
    rank: int
    acts: int
    acts_ckpt: int
    step_rss_delta: int
    step_s: float  # one training step (forward, backward, AdamW) without the hooks


def make_sp_model() -> Path:
    if (SP_MODEL_DIR / "config.json").is_file():
        return SP_MODEL_DIR
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SP_SIZES)).save_pretrained(SP_MODEL_DIR)
    return SP_MODEL_DIR


def _sp_forward(model, ids, sp) -> torch.Tensor:
    """The recipes' funnel: this rank's slice, log-probs gathered over the SP group."""
    from lightrft.models.forward import causal_lm_token_logprobs

    return causal_lm_token_logprobs(model, ids, sequence_parallel=sp)


def sp_saved_bytes(model, ids, sp) -> tuple[int, torch.Tensor]:
    weight_shapes = set()
    for p in model.parameters():
        shape = tuple(p.shape)
        weight_shapes |= {shape, shape[::-1]}
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) not in weight_shapes and not hasattr(t, "to_local"):
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), st)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _sp_forward(model, ids, sp)
    return sum(st.nbytes() for st in seen.values()), out


def sp_worker(rank: int, world: int, sp_size: int, path: str, tokens: int, queue) -> None:
    import torch.distributed as dist

    from lightrft.models.sharded import load_parallel
    from lightrft.models.ulysses import Ulysses, sp_groups

    sp = None
    if sp_size > 1:
        group, sp_rank = sp_groups(sp_size)
        sp = Ulysses(group, sp_size, sp_rank)
    # Every rank of an SP group gets the same row; the groups get different rows.
    gen = torch.Generator().manual_seed(1 + rank // sp_size)
    ids = torch.randint(0, SP_SIZES["vocab_size"], (1, tokens), generator=gen)
    model = load_parallel(path, dtype="float32", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    with PeakRSS() as rss:
        acts, out = sp_saved_bytes(model, ids, sp)
        out.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del out
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    _sp_forward(model, ids, sp).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - t0
    del model, opt
    gc.collect()
    model_ck = load_parallel(path, dtype="float32", device="cpu", activation_checkpointing=True)
    acts_ckpt, out = sp_saved_bytes(model_ck, ids, sp)
    del out, model_ck
    queue.put(SPResult(rank, acts, acts_ckpt, rss.peak - rss.start, step_s))


def measure_sp(world: int, sp_size: int, path: Path, tokens: int = SP_TOKENS) -> list[SPResult]:
    """Every rank's measurements at ``world`` processes in SP groups of ``sp_size``, one row of
    ``tokens`` per group (``tokens / sp_size`` must equal no weight dimension: see
    ``sp_saved_bytes``, which leaves out tensors of a weight's shape)."""
    import torch.multiprocessing as mp

    from tests._dist import run_distributed

    queue = mp.get_context("spawn").Manager().Queue()
    run_distributed(sp_worker, sp_size, str(path), tokens, queue, world_size=world)
    return sorted((queue.get() for _ in range(world)), key=lambda r: r.rank)


def main_sp(argv: list[str]) -> int:
    """``sp [WORLD ...]``: SP 1, 2, 4 (those dividing the world) per world size (default 4, 2);
    ``sp --measured FILE``: print a saved run against the planner again."""
    import json

    path = make_sp_model()
    if argv[:1] == ["--measured"]:
        runs = json.loads(Path(argv[1]).read_text())
    else:
        worlds = [int(a) for a in argv] or [4, 2]
        runs = []
        for world in worlds:
            for n in SP_DEGREES:
                if world % n:
                    continue
                t0 = time.perf_counter()
                results = measure_sp(world, n, path)
                runs.append(
                    dict(
                        world=world,
                        sp=n,
                        wall_s=time.perf_counter() - t0,
                        load=os.getloadavg(),
                        ranks=[r.__dict__ for r in results],
                    )
                )
                print(f"measured world {world} sp {n}: {runs[-1]}", flush=True)
        out = Path(f"/tmp/lightrft_plan_check_sp_{int(time.time())}.json")
        out.write_text(json.dumps(runs, indent=1))
        print(f"saved {out}")
    return print_sp(runs, path)


def sp_predicted(shape: ModelShape, world: int, n: int, tokens: int = SP_TOKENS) -> dict[str, int]:
    """The planner's per-rank terms for one SP row (fp32, one row of ``tokens`` tokens)."""
    t = TrainedSetup(master_bytes=4, compute_bytes=4, shard=world)
    terms = {x.name: x.device_bytes for x in model_state_terms(shape, t, "actor")}
    kw = dict(repeat_kv=False, sequence_parallel=n)
    acts = activation_bytes(shape, tokens, 4, ckpt=False, **kw)
    acts_ck = activation_bytes(shape, tokens, 4, ckpt=True, recompute=False, **kw)
    fused, _ = logprob_bytes(shape, tokens, 4, entropy=False, grad_hint=False, sequence_parallel=n)
    # The first step's new memory: gradients, AdamW state, activations, the log-prob
    # transient, gathered units (RSS cross-check only, as above).
    step = terms["actor gradients"] + terms["actor optimizer state"] + acts + fused
    step += gathered_bytes(shape, t, trained=True) if world > 1 else 0
    return dict(acts=acts, acts_ckpt=acts_ck, step_rss_delta=step)


def print_sp(runs: list[dict], path: Path) -> int:
    """One line per (world, SP degree, term): the worst rank's measured / predicted, and the
    measured value over SP=1's at the same world size; then the step times."""
    shape = ModelShape.from_file(path / "config.json")
    print(
        f"SP rows: {shape.params / 1e6:.1f}M-parameter Qwen2 ({shape.heads}/{shape.kv_heads} "
        f"heads), one row of {SP_TOKENS} tokens, fp32; {os.cpu_count()} CPUs"
    )
    print(
        f"{'world':>5}{'sp':>4}  {'term':<15}{'measured MiB':>13}{'planned MiB':>12}{'ratio':>7}"
        f"{'vs sp1':>8}"
    )
    bad, base = 0, {}
    for run in runs:
        world, n, ranks = run["world"], run["sp"], run["ranks"]
        predicted = sp_predicted(shape, world, n)
        for what, pred in predicted.items():
            vals = [r[what] for r in ranks]
            measured = max(vals, key=lambda v: abs(v / pred - 1))
            if n == 1:
                base[world, what] = max(vals)
            vs = max(vals) / base[world, what] if (world, what) in base else float("nan")
            ratio = measured / pred
            flag = "" if what == "step_rss_delta" or abs(ratio - 1) <= TOLERANCE else "  OVER 15%"
            bad += bool(flag)
            print(
                f"{world:>5}{n:>4}  {what:<15}{measured / 2**20:>13.1f}{pred / 2**20:>12.1f}"
                f"{ratio:>7.3f}{vs:>8.3f}{flag}"
            )
    print(f"{'world':>5}{'sp':>4}  {'step s (max rank)':>18}{'vs sp1':>8}  load average (1, 5, 15)")
    steps = {}
    for run in runs:
        world, n = run["world"], run["sp"]
        step = max(r["step_s"] for r in run["ranks"])
        steps.setdefault(world, step)
        load = ", ".join(f"{x:.2f}" for x in run["load"])
        print(f"{world:>5}{n:>4}  {step:>18.1f}{step / steps[world]:>8.3f}  {load}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["sp"]:
        return main_sp(argv[1:])
    worlds = [int(a) for a in argv] or [1, 2, 4]
    path = make_model()
    shape = ModelShape.from_file(path / "config.json")
    print(
        f"model: {shape.params / 1e6:.1f}M parameters; {TOKENS} tokens per micro-batch; "
        f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs"
    )
    bad = 0
    print(f"{'world':>5}  {'term':<16}{'measured MiB':>14}{'planned MiB':>13}{'ratio':>8}")
    for world in worlds:
        t0 = time.perf_counter()
        for what, measured, predicted in check(world, path):
            ratio = measured / predicted
            flag = "" if what == "step_rss_delta" or abs(ratio - 1) <= TOLERANCE else "  OVER 15%"
            bad += bool(flag)
            print(
                f"{world:>5}  {what:<16}{measured / 2**20:>14.1f}{predicted / 2**20:>13.1f}"
                f"{ratio:>8.3f}{flag}"
            )
        print(f"        ({time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.2f})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
