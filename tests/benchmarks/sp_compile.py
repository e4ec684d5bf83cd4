"""Ulysses SP step time, eager vs ``model.compile`` (each block one graph), side by side.

    OMP_NUM_THREADS=1 python tests/benchmarks/sp_compile.py            # T=1024 tokens per row
    T=2048 STEPS=16 OMP_NUM_THREADS=1 python tests/benchmarks/sp_compile.py

SP 2 on 2 gloo processes; a random Qwen2 (hidden 256, 4 layers, 8/2 heads, intermediate 768,
vocab 512, fp32); 2 padded rows of ``T`` tokens. Both models (FSDP2 via ``parallelize``, one
eager, one compiled) live in the same two processes and their steps alternate, so both see the
same machine load. A step: the SFT loss through ``causal_lm_cross_entropy(...,
sequence_parallel=)``, backward. The first ``WARM`` steps (inductor's build) are not timed.
Prints each model's median and minimum step over ``STEPS``, dynamo's graph breaks and graphs,
and ``/proc/loadavg``.
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T, STEPS = int(os.environ.get("T", 1024)), int(os.environ.get("STEPS", 16))
B, WARM = 2, 2


def _model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).float()


def _worker(rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch._dynamo.utils import counters

    from lightrft.models.forward import causal_lm_cross_entropy
    from lightrft.models.parallel import build_mesh, parallelize
    from lightrft.models.ulysses import Ulysses, enable, sp_groups

    group, sp_rank = sp_groups(2)
    sp = Ulysses(group, 2, sp_rank)
    ids = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(1))
    targets = ids[:, 1:].clone()
    models = {}
    for name, compile in (("eager", False), ("compiled", True)):
        model = _model()
        enable(model)
        parallelize(model, mesh=build_mesh(None, None, "cpu"), compile=compile)
        models[name] = model
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(WARM + STEPS):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            loss = causal_lm_cross_entropy(
                model, ids, targets=targets, num_tokens=float(targets.numel()), sequence_parallel=sp
            )
            loss.backward()
            model.zero_grad(set_to_none=True)
            dist.barrier()
            seconds = time.perf_counter() - start
            if step >= WARM:
                times[name].append(seconds)
            elif rank == 0:
                print(f"warm-up step {step}, {name}: {seconds:.2f} s", flush=True)
    if rank == 0:
        for name, steps in times.items():
            steps = sorted(steps)
            print(
                f"{name}: median {steps[len(steps) // 2]:.3f} s, min {steps[0]:.3f} s "
                f"({len(steps)} steps, B={B}, T={T})"
            )
        breaks = sum(counters["graph_break"].values())
        print(f"graph breaks: {breaks}, graphs: {counters['stats']['unique_graphs']}")
        with open("/proc/loadavg") as f:
            print("loadavg:", f.read().strip())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests._dist import free_port

    mp.spawn(_worker, args=(str(free_port()),), nprocs=2)
