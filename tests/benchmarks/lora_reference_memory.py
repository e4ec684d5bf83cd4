"""RSS a KL reference costs: a second frozen model vs the LoRA actor with adapters off.

    python tests/benchmarks/lora_reference_memory.py make   # an 8-layer, hidden-512 model
    python tests/benchmarks/lora_reference_memory.py copy   # actor + a second reference model
    python tests/benchmarks/lora_reference_memory.py lora   # LoRA actor, reference = adapters off

Each mode runs in its own process; the actor runs one forward first so its weights are
resident, then the reference is built and runs one forward.
"""

import gc
import resource
import sys

import psutil
import torch

from lightrft.models import load_causal_lm
from lightrft.models.lora import adapters_disabled, apply_lora
from lightrft.sections import LoraConfig
from lightrft.tasks import make_tiny_model

PATH = "/tmp/lightrft_lora_memory_model"


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main(mode: str) -> None:
    if mode == "make":
        make_tiny_model(PATH, layers=8, hidden=512, heads=8, kv_heads=8)
        return
    import peft  # noqa: F401  (imported in both modes so the baseline is the same)

    ids = torch.randint(3, 90, (2, 64))  # [B, T]
    actor = load_causal_lm(PATH)
    n = sum(p.numel() for p in actor.parameters())
    with torch.no_grad():
        actor(input_ids=ids)
    gc.collect()
    before = rss_mib()
    if mode == "copy":
        ref = load_causal_lm(PATH).eval().requires_grad_(False)
        with torch.no_grad():
            ref(input_ids=ids)
    else:
        actor = apply_lora(actor, LoraConfig.read({"rank": 16, "alpha": 32}))
        with torch.no_grad(), adapters_disabled(actor):
            actor(input_ids=ids)
    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{mode}: {n / 1e6:.1f}M params; the reference adds {rss_mib() - before:.0f} MiB RSS; "
        f"peak RSS {peak:.0f} MiB"
    )


if __name__ == "__main__":
    main(sys.argv[1])
