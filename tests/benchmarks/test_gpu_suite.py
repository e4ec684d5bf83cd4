"""The GPU benchmark suite runs here too: ``--tiny`` on the CPU, every row measured or skipped with
its reason, in a subprocess (the suite opens its own one-process group)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SUITE = Path(__file__).with_name("gpu_suite.py")


def test_gpu_suite_tiny_writes_every_row(tmp_path):
    out = tmp_path / "suite.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(SUITE), "--tiny", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    table = out.read_text()
    assert not any(r["skipped"] and r["skipped"].startswith("FAILED") for r in rows.values())
    for shape in ("tiny-a", "tiny-b"):
        train = next(r for n, r in rows.items() if n.startswith(f"train {shape}"))
        assert float(train["figures"]["tokens/s"].replace(",", "")) > 0
        assert rows[f"sync {shape}: FSDP2 -> native engine"]["figures"]["time"].endswith("of 3")
    decode = [r for n, r in rows.items() if n.startswith("decode")]
    assert float(decode[0]["figures"]["tokens/s"].replace(",", "")) > 0
    kernel = next(r for n, r in rows.items() if n.startswith("logprobs"))
    assert {"naive", "lightrft"} <= kernel["figures"].keys()
    vlm = next(r for n, r in rows.items() if n.startswith("vlm grpo step"))
    assert vlm["figures"]["train/approx_kl"].startswith("0.0e+00")  # trainer == engine
    if not torch.cuda.is_available():  # the GPU-only parts say why they did not run
        assert kernel["figures"]["liger"] == "skipped: Liger's Triton kernel needs CUDA"
        assert rows["sync tiny-a: FSDP2 -> vLLM"]["skipped"] == "vLLM needs CUDA"
        assert decode[-1]["skipped"] == "vLLM needs CUDA"
        assert "MFU: n/a" in table
