"""Peak RSS and step time of the SFT recipe on 2 gloo processes, by training strategy.

    python tests/benchmarks/strategies.py [--layers 8] [--steps 6]

The strategies: FSDP2, FSDP2 + LoRA (rank 16 on every linear layer of the decoder), DeepSpeed
ZeRO-2 and ZeRO-3, each a fresh ``lightrft run --nproc_per_node 2 sft`` of the same config but
for the ``strategy`` / ``lora`` / ``deepspeed`` keys. The model is the random Qwen2 of
``sharded_load_memory.py`` (hidden 1024, 8 layers, vocab 32,000, untied head: 168M parameters,
674 MB of fp32 safetensors) with a character tokenizer; the data are 2-digit additions (the
tiny demo's), packed, 16 samples per rank per step, AdamW. Reported per strategy: rank 0's peak
RSS (``memory/peak_rss_gib``: loading, training and the final export included) and the median
``time/step`` after the first two steps. One thread per process; run on an idle machine, the load
average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from sharded_load_memory import make, model_path  # this folder (a script's sys.path[0])

STRATEGIES = {
    "FSDP2": {},
    "FSDP2 + LoRA": {"lora": {"rank": 16, "alpha": 32}},
    "DeepSpeed ZeRO-2": {"strategy": "deepspeed", "deepspeed": {"stage": 2}},
    "DeepSpeed ZeRO-3": {"strategy": "deepspeed", "deepspeed": {"stage": 3}},
}


def config(work: Path, model: Path, steps: int, extra: dict) -> Path:
    cfg = {
        "output_dir": str(work / "out"),
        "device": "cpu",
        "prepare": [
            {
                "_component_": "lightrft.tasks.ensure_arith_dataset",
                "out_dir": str(work.parent / "data"),
                "n_train": 512,
                "n_test": 8,
                "digits": 2,
            }
        ],
        "model": {"path": str(model)},
        "dataset": {
            "_component_": "lightrft.data.SFTDataset",
            "path": str(work.parent / "data" / "train.jsonl"),
            "max_length": 64,
        },
        "packing": True,
        "batch_size": 16,
        "epochs": 1,
        "max_steps": steps,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-5},
        "clip_grad_norm": 1.0,
        "log_every": 1,
        "overwrite": True,
        "metrics": {"tensorboard": False},
        **extra,
    }
    path = work / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    params, size = make(args.layers)
    model = model_path(args.layers)
    if not (model / "tokenizer.json").is_file():
        from lightrft.tasks.tiny import char_tokenizer

        char_tokenizer().save_pretrained(model)
    root = Path(tempfile.mkdtemp(prefix="lightrft-strategies-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(
        f"model: {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB fp32; 2 gloo processes; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = {}
    for name, extra in STRATEGIES.items():
        work = root / name.replace(" ", "_").replace("+", "plus")
        work.mkdir()
        cmd = [sys.executable, "-m", "lightrft", "run", "--nproc_per_node", "2", "sft"]
        cmd += ["--config", str(config(work, model, args.steps, extra))]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "time/step" in r]
        step = statistics.median(r["time/step"] for r in rows[2:])
        results[name] = (rows[-1]["memory/peak_rss_gib"], step, rows[-1]["train/loss"])
        print(f"{name:18s} peak RSS {results[name][0]:.2f} GiB, {step:.2f} s/step", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    base_rss, base_step = results["FSDP2"][:2]
    print(
        f"{'strategy':18s} {'peak RSS GiB':>12s} {'vs FSDP2':>8s} {'s/step':>7s} {'vs FSDP2':>8s}"
    )
    for name, (rss, step, _) in results.items():
        print(f"{name:18s} {rss:12.2f} {rss / base_rss:7.2f}x {step:7.2f} {step / base_step:7.2f}x")


if __name__ == "__main__":
    main()
