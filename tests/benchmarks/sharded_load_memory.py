"""Peak RSS per rank of actor + reference: one plain process vs 2 gloo ranks (load_parallel).

    python tests/benchmarks/sharded_load_memory.py        # make the model once, run both, print
    python tests/benchmarks/sharded_load_memory.py 24     # the same with 24 layers
    python tests/benchmarks/sharded_load_memory.py single 8   # one mode only (its own process)
    python tests/benchmarks/sharded_load_memory.py sharded 8
    python tests/benchmarks/sharded_load_memory.py sharded_root_head 8   # the reference's LM
                                                  # head in the root group (frozen after sharding)

The model is a random Qwen2 written locally (hidden 1024, 8 layers by default, 16 heads,
intermediate 2816, vocab 32000, untied head; fp32 safetensors). Each mode loads the actor and the reference
with ``lightrft.models.sharded.load_parallel`` (the recipes' call), runs one forward through
each and reports its peak RSS (``ru_maxrss``) in a fresh interpreter.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import torch

LAYERS = 8
SIZES = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    intermediate_size=2816,
    vocab_size=32000,
    tie_word_embeddings=False,
)


def model_path(layers: int) -> Path:
    return Path(f"/tmp/lightrft_sharded_load_model_{layers}")


def make(layers: int) -> tuple[int, int]:
    """Write the model once; (parameters, bytes of its safetensors)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = model_path(layers)
    if not (path / "model.safetensors").is_file():
        cfg = Qwen2Config(**SIZES, num_hidden_layers=layers, max_position_embeddings=2048)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(path, safe_serialization=True)
        del model
    from safetensors import safe_open

    n = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            n += _numel(f.get_slice(k).get_shape())
    return n, (path / "model.safetensors").stat().st_size


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def load_both(path: Path, head_group: bool = True) -> tuple[float, float]:
    """Actor (trainable) + reference (frozen), one forward each; this process's peak RSS and
    its RSS afterwards (MiB). ``head_group``: the reference is frozen before sharding, as the
    GRPO recipe does, so its LM head is an FSDP2 group of its own; False freezes it after
    sharding (the head stays in the root group, gathered for the whole forward)."""
    from lightrft.models.sharded import load_parallel

    ids = torch.randint(0, SIZES["vocab_size"], (2, 64))  # [B, T]
    actor = load_parallel(path)
    with torch.no_grad():
        actor(input_ids=ids)
    if head_group:
        ref = load_parallel(path, prepare=lambda model: model.requires_grad_(False))
    else:
        ref = load_parallel(path).requires_grad_(False)
    with torch.no_grad():
        ref(input_ids=ids)
    return peak_mib(), resident_mib()


def _rank_main(
    rank: int, world: int, port: int, out: str, path: Path, head_group: bool = True
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        peak, now = load_both(path, head_group)
        Path(f"{out}.{rank}").write_text(f"{peak:.1f},{now:.1f}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def sharded(path: Path, world: int = 2, head_group: bool = True) -> list[str]:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(prefix="lightrft_rss_")
    mp.spawn(_rank_main, args=(world, port, out, path, head_group), nprocs=world, join=True)
    peaks = [Path(f"{out}.{r}").read_text() for r in range(world)]
    for r in range(world):
        os.unlink(f"{out}.{r}")
    return peaks


def _run(mode: str, layers: int) -> str:
    res = subprocess.run(
        [sys.executable, __file__, mode, str(layers)], capture_output=True, text=True, check=True
    )
    return res.stdout.strip().splitlines()[-1]


def main() -> None:
    args = sys.argv[1:]
    mode = args.pop(0) if args and not args[0].isdigit() else "all"
    layers = int(args[0]) if args else LAYERS
    if mode == "single":
        torch.set_num_threads(1)
        print("{:.1f},{:.1f}".format(*load_both(model_path(layers))))
    elif mode in ("sharded", "sharded_root_head"):
        print(" ".join(sharded(model_path(layers), head_group=mode == "sharded")))
    else:
        n, size = make(layers)
        single, single_now = (float(x) for x in _run("single", layers).split(","))
        ranks = [[float(x) for x in r.split(",")] for r in _run("sharded", layers).split()]
        peaks, nows = [r[0] for r in ranks], [r[1] for r in ranks]
        old = [[float(x) for x in r.split(",")] for r in _run("sharded_root_head", layers).split()]
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"model: {layers} layers, {n / 1e6:.1f}M parameters, "
            f"{size / 2**20:.0f} MiB fp32 safetensors"
        )
        print(f"actor + reference, peak RSS: 1 process {single:.0f} MiB")
        print(f"2 gloo ranks (load_parallel): {', '.join(f'{p:.0f}' for p in peaks)} MiB per rank")
        print(f"ratio (worst rank / single): {max(peaks) / single:.2f}; load average {load}")
        print(
            f"  the same, reference frozen after sharding (its LM head in the root group): "
            f"{', '.join(f'{r[0]:.0f}' for r in old)} MiB per rank, ratio "
            f"{max(r[0] for r in old) / single:.2f}"
        )
        print(
            f"resident after: 1 process {single_now:.0f} MiB, ranks "
            f"{', '.join(f'{p:.0f}' for p in nows)} MiB (ratio {max(nows) / single_now:.2f})"
        )


if __name__ == "__main__":
    main()
