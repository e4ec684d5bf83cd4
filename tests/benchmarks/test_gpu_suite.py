"""The GPU benchmark suite runs here too: ``--tiny`` on the CPU, every row measured or skipped with
its reason (in-process, as the recipe tests run: the suite closes the one-process group it opens)."""

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

SUITE = Path(__file__).with_name("gpu_suite.py")


def test_gpu_suite_tiny_writes_every_row(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    suite = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", suite)  # its dataclasses look themselves up
    spec.loader.exec_module(suite)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "suite.md"
    assert suite.main(["--tiny", "--out", str(out)]) == 0
    assert not dist.is_initialized()
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
    offload = {n.split("offload=")[1].split()[0]: r for n, r in rows.items() if "offload=" in n}
    assert offload.keys() == {"none", "params"}
    for r in offload.values():
        assert (
            r["figures"]["step"].startswith(tuple("123456789"))
            and "GiB" in r["figures"]["host resident"]
        )
    if not torch.cuda.is_available():  # the GPU-only parts say why they did not run
        assert kernel["figures"]["liger"] == "skipped: Liger's Triton kernel needs CUDA"
        assert rows["sync tiny-a: FSDP2 -> vLLM"]["skipped"] == "vLLM needs CUDA"
        assert decode[-1]["skipped"] == "vLLM needs CUDA"
        assert "MFU: n/a" in table
