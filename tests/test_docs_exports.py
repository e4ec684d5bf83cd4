"""Every code block of the docs and the README that loads an export runs as written.

Each block is extracted from the Markdown and run in a fresh interpreter (so it imports only what
it shows), in a directory holding tiny exports at the paths the docs use: a full fine-tune's
``outputs/tiny/add_sft/final``, a LoRA run's adapter ``outputs/lora_run/final`` (base
``outputs/tiny_lm``) and its ``outputs/lora_run/final_merged``. This is how the LoRA adapter
export's documented ``PeftModel.from_pretrained`` call was found to raise ``ImportError: Found an
incompatible version of torchao`` in the environment the README installed (torchao < 0.16 then);
the plain PEFT block imports nothing of LightRFT.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A call that loads a model or an adapter from a directory.
LOADS = re.compile(r"\b(from_pretrained|load_model|load_export)\(|PeftModel")
# ...from an export of a run (``final/``, ``final_merged/``).
EXPORT = re.compile(r"/final(_merged)?\b")
# Blocks that call a loader on something that is not an export, and why they are not run here.
NOT_EXPORTS = {
    "audio.md": "walkthrough on make_tiny_model's audio model and data/aqa (tests/audio covers it)",
    "vision.md": "walkthrough on make_tiny_model's VLM and data/geo (tests/vision covers it)",
}


def code_blocks(text: str) -> list[str]:
    """Fenced blocks, then indented (4-space) blocks outside fences."""
    blocks, rest = [], []
    fence = None
    for line in text.splitlines():
        if fence is None and line.lstrip().startswith("```"):
            fence = []
            continue
        if fence is not None:
            if line.lstrip().startswith("```"):
                blocks.append("\n".join(fence))
                fence = None
            else:
                fence.append(line)
            continue
        rest.append(line)
    indented: list[str] = []
    for line in rest + [""]:
        if line.startswith("    ") or (indented and not line.strip()):
            indented.append(line[4:])
        elif indented:
            blocks.append("\n".join(indented).strip("\n"))
            indented = []
    return [b for b in blocks if b.strip()]


def loading_blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for i, block in enumerate(code_blocks(doc.read_text())):
            if LOADS.search(block) and EXPORT.search(block):
                out.append((f"{doc.name}#{i}", block))
    return out


def test_every_loading_block_is_run_or_explained():
    runs = {name.split("#")[0] for name, _ in loading_blocks()}
    assert {"strategies.md", "quickstart.md"} <= runs
    # Issue 40: PEFT's own call on the adapter export, in a block that imports nothing of ours.
    assert any(
        "PeftModel.from_pretrained" in block and "lightrft" not in block
        for _, block in loading_blocks()
    )
    for doc in DOCS:
        for block in code_blocks(doc.read_text()):
            if LOADS.search(block) and not EXPORT.search(block):
                assert doc.name in NOT_EXPORTS, (
                    f"{doc.name}: a loading block on no export:\n{block}"
                )


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    from lightrft.models import load_model, load_tokenizer
    from lightrft.models.export import export_hf
    from lightrft.models.lora import apply_lora
    from lightrft.sections import LoraConfig
    from lightrft.tasks import make_tiny_model
    from lightrft.training.export import export_trained

    work = tmp_path_factory.mktemp("exports")
    cwd = os.getcwd()
    os.chdir(work)  # the adapter records its base as given: relative, like a run's model.path
    try:
        make_tiny_model("outputs/tiny_lm", layers=1, hidden=32, heads=2, kv_heads=1)
        tok = load_tokenizer("outputs/tiny_lm")
        export_hf(load_model("outputs/tiny_lm"), tok, "outputs/tiny/add_sft/final")
        opts = LoraConfig(rank=2, export_merged=True).resolve("lora")
        model = apply_lora(load_model("outputs/tiny_lm"), opts)
        with torch.no_grad():  # non-zero adapters, so the adapter changes the logits
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
        export_trained(model, tok, "outputs/lora_run/final", opts)
    finally:
        os.chdir(cwd)
    return work


def test_documented_loading_blocks_run_in_a_fresh_interpreter(exports):
    blocks = loading_blocks()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.update(
        TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1"
    )
    procs = [
        (
            name,
            subprocess.Popen(
                [sys.executable, "-c", block],
                cwd=exports,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
        for name, block in blocks
    ]
    failed = []
    for name, proc in procs:
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failed.append(f"{name} (exit {proc.returncode}):\n{out[-2000:]}")
    assert not failed, "\n\n".join(failed)


def test_load_export_gives_the_merged_logits(exports):
    from lightrft.models import load_export

    cwd = os.getcwd()
    os.chdir(exports)
    try:
        adapter = load_export("outputs/lora_run/final")
        merged = load_export("outputs/lora_run/final_merged")
        base = load_export("outputs/tiny_lm")
    finally:
        os.chdir(cwd)
    assert type(adapter).__name__ == "PeftModelForCausalLM"
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        a, m, b = adapter(ids).logits, merged(ids).logits, base(ids).logits
    torch.testing.assert_close(a, m, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, b, atol=1e-4)  # the adapter is applied


def test_load_export_names_a_missing_base(tmp_path):
    from lightrft.models import load_export

    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": "nowhere/tiny"}')
    with pytest.raises(FileNotFoundError, match="pass base="):
        load_export(tmp_path)
