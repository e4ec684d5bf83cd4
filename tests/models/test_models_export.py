"""export_hf: the exported directory reloads with AutoModelForCausalLM and gives the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from _dist import run_distributed
from safetensors import safe_open

from lightrft.models import load_causal_lm, load_tokenizer
from lightrft.models.export import export_hf
from lightrft.models.names import strip_wrappers
from lightrft.models.parallel import parallelize
from lightrft.tasks.tiny import make_tiny_model


def _ids() -> torch.Tensor:
    return torch.randint(3, 99, (2, 10), generator=torch.Generator().manual_seed(0))  # [B, T]


def _train(model, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for s in range(steps):
        x = torch.randint(3, 99, (2, 10), generator=torch.Generator().manual_seed(s + 1))
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()


def _reload_logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=_ids(), use_cache=False).logits


def _safetensor_keys(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_strip_wrappers():
    name = "model.layers.0._checkpoint_wrapped_module._orig_mod.mlp.up_proj.weight"
    assert strip_wrappers(name) == "model.layers.0.mlp.up_proj.weight"


def test_export_rejects_non_hf_model(tmp_path):
    with pytest.raises(ValueError, match="needs a Hugging Face model .* got Linear"):
        export_hf(torch.nn.Linear(2, 2), None, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_round_trip_single_process(tiny_model_dir, tmp_path):
    model = parallelize(load_causal_lm(tiny_model_dir), activation_checkpointing=True)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    _train(model)
    with torch.no_grad():
        want = model(input_ids=_ids(), use_cache=False).logits
    out = export_hf(model, load_tokenizer(tiny_model_dir), tmp_path / "final")
    assert out == tmp_path / "final" and not (tmp_path / "final.tmp").exists()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert not any("_checkpoint_wrapped_module" in k for k in _safetensor_keys(out))
    got = _reload_logits(out)
    assert torch.equal(got, want)
    tok = load_tokenizer(out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template

    # Exporting again replaces the directory (atomically) with the new weights.
    _train(model, steps=1)
    with torch.no_grad():
        want2 = model(input_ids=_ids(), use_cache=False).logits
    export_hf(model, None, out)
    assert torch.equal(_reload_logits(out), want2) and not torch.equal(want2, want)


def test_export_tied_embeddings_and_dtype(tmp_path):
    src = make_tiny_model(tmp_path / "tied", tie_embeddings=True)
    model = load_causal_lm(src)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _train(model)
    out = export_hf(model, load_tokenizer(src), tmp_path / "final")
    assert "lm_head.weight" not in _safetensor_keys(out)  # one copy of the tied matrix
    with torch.no_grad():
        want = model(input_ids=_ids(), use_cache=False).logits
    assert torch.equal(_reload_logits(out), want)

    bf16 = export_hf(model, None, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(bf16 / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def _fsdp_export_worker(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.tensor import DTensor

    for tie in ("untied", "tied"):
        model = parallelize(load_causal_lm(f"{root}/{tie}"))
        assert isinstance(model.model.embed_tokens.weight, DTensor)
        _train(model)
        with torch.no_grad():
            logits = model(input_ids=_ids(), use_cache=False).logits
        out = export_hf(model, load_tokenizer(f"{root}/{tie}"), f"{root}/{tie}_final")
        assert (out / "model.safetensors").is_file()  # every rank sees the finished export
        if rank == 0:
            torch.save(logits, f"{root}/{tie}_logits.pt")


def test_export_round_trip_fsdp2_two_processes(tmp_path):
    make_tiny_model(tmp_path / "untied")
    make_tiny_model(tmp_path / "tied", tie_embeddings=True)
    run_distributed(_fsdp_export_worker, str(tmp_path))
    for tie in ("untied", "tied"):
        out = tmp_path / f"{tie}_final"
        want = torch.load(tmp_path / f"{tie}_logits.pt")
        assert torch.equal(_reload_logits(out), want)
        assert ("lm_head.weight" in _safetensor_keys(out)) is (tie == "untied")
