"""Peak RSS per rank of two reward models used as RL rewards: 1 process (whole) vs 2 and 4 gloo
ranks (sharded with FSDP2, scored collectively).

    python tests/benchmarks/reward_model_memory.py            # make the models once, run 1, 2, 4
    python tests/benchmarks/reward_model_memory.py 128        # the same with a 128-token vocab
    python tests/benchmarks/reward_model_memory.py run 4 128  # one world size (its own processes)

The models are random Qwen2s written locally (hidden 768, 12 layers, 12 heads, intermediate
2048, vocab 32000 by default; fp32 safetensors): a one-head classifier (``last`` pooling, 110M
parameters) and a ``likelihood`` model (the causal LM with its untied LM head, 134M). The
samples are char-tokenized (ids < 128): with a 32000 vocab one process never touches most of
its (memory-mapped) input embedding, while a sharded rank holds its rows of it (vocabulary-
parallel: never gathered); a 128-token vocab (the layers' 85M parameters per model) measures
the sharding of the blocks alone. Each rank
loads both as :class:`lightrft.rewards.RewardModel` (as a GRPO config builds them), scores 16
samples of ~120 tokens with each in a :class:`~lightrft.rewards.CombinedReward` (rank r of 4
gets 16 + 4r samples: unequal counts), and reports, in a fresh interpreter:

- ``base``: its RSS before the reward models load (torch, the Qwen2 model code, the process
  group);
- ``loaded``: its RSS after they load, before they score, minus ``base`` (the shards);
- ``peak``: its peak RSS (``ru_maxrss``) after loading and scoring;
- ``models``: ``peak - base``, what the reward models cost the rank.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lightrft.rewards import Sample

VOCAB = 32000
SIZES = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    intermediate_size=2048,
    tie_word_embeddings=False,
    max_position_embeddings=1024,
)


def root(vocab: int) -> Path:
    return Path(f"/tmp/lightrft_rm_memory_{vocab}")


def make(vocab: int) -> dict[str, int]:
    """Write both models once (with a char-level tokenizer); parameters of each."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

    from lightrft.models.reward import CONFIG_KEY
    from lightrft.tasks.tiny import char_tokenizer

    tok = char_tokenizer()
    counts = {}
    for name, cls, extra in (
        ("classifier", AutoModelForSequenceClassification, {"num_labels": 1}),
        ("likelihood", AutoModelForCausalLM, {}),
    ):
        path = root(vocab) / name
        if not (path / "model.safetensors").is_file():
            cfg = Qwen2Config(**SIZES, **extra, vocab_size=vocab, pad_token_id=tok.pad_token_id)
            torch.manual_seed(0)
            model = cls.from_config(cfg, dtype=torch.float32)
            if name == "likelihood":
                block = {"heads": ["reward"], "pooling": "likelihood", "end_token_id": None}
                model.config.update({CONFIG_KEY: {**block, "probe_layer": None, "stats": {}}})
            model.save_pretrained(path)
            tok.save_pretrained(path)
            del model
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            counts[name] = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return counts


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def score_both(rank: int, vocab: int) -> tuple[float, float, float]:
    """Load the two reward models, score this rank's samples; (base, loaded, peak) RSS in MiB
    (``loaded``: after loading, minus ``base``)."""
    import random

    # The model classes' code (~220 MiB of imports) is loaded before the base is read: a
    # recipe has it loaded for its actor already.
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification  # noqa: F401

    from lightrft.rewards import CombinedReward, RewardModel

    base = resident_mib()
    reward = CombinedReward(
        {
            name: RewardModel(str(root(vocab) / name), chat_template=False, micro_batch_size=8)
            for name in ("classifier", "likelihood")
        }
    )
    loaded = resident_mib() - base
    rng = random.Random(rank)
    n = 16 + 4 * rank
    words = ["apple", "river", "stone", "lamp", "north", "tiger", "seven", "cloud"]
    prompts = [" ".join(rng.choices(words, k=12)) for _ in range(n)]
    responses = [" ".join(rng.choices(words, k=8)) for _ in range(n)]
    out = reward(Sample.batch(prompts, responses))
    assert out.total.shape == (n,) and torch.isfinite(out.total).all()
    return base, loaded, peak_mib()


def _rank_main(rank: int, world: int, port: int, out: str, vocab: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(f"{out}.{rank}").write_text(json.dumps(score_both(rank, vocab)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, vocab: int) -> list[list[float]]:
    """[base, loaded, peak] MiB of each rank."""
    if world == 1:  # one plain process: no process group, the models load whole
        torch.set_num_threads(1)
        return [list(score_both(0, vocab))]
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(prefix="lightrft_rm_rss_")
    mp.spawn(_rank_main, args=(world, port, out, vocab), nprocs=world, join=True)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    for r in range(world):
        os.unlink(f"{out}.{r}")
    return ranks


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "run":
        print(json.dumps(run(int(args[1]), int(args[2]))))
        return
    vocab = int(args[0]) if args else VOCAB
    counts = make(vocab)
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    print(f"glibc MALLOC_MMAP_THRESHOLD_={threshold or 'unset (dynamic)'}")
    print(
        f"vocab {vocab}; models: classifier {counts['classifier'] / 1e6:.0f}M, likelihood "
        f"{counts['likelihood'] / 1e6:.0f}M parameters (fp32, "
        f"{sum(counts.values()) * 4 / 2**20:.0f} MiB together)"
    )
    whole = None
    for world in (1, 2, 4):
        before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        res = subprocess.run(
            [sys.executable, __file__, "run", str(world), str(vocab)],
            capture_output=True,
            text=True,
            check=True,
        )
        ranks = json.loads(res.stdout.strip().splitlines()[-1])
        after = " ".join(f"{x:.2f}" for x in os.getloadavg())
        models = [peak - base for base, _, peak in ranks]
        loaded = [x for _, x, _ in ranks]
        peaks = [peak for _, _, peak in ranks]
        if whole is None:
            whole = (max(models), max(peaks))
        print(
            f"{world} process(es): reward models {', '.join(f'{m:.0f}' for m in models)} MiB "
            f"per rank (worst / 1 process {max(models) / whole[0]:.2f}; loaded, before "
            f"scoring: {', '.join(f'{x:.0f}' for x in loaded)}); peak RSS "
            f"{', '.join(f'{p:.0f}' for p in peaks)} MiB (worst / 1 process "
            f"{max(peaks) / whole[1]:.2f}); load average {before} -> {after}"
        )


if __name__ == "__main__":
    main()
