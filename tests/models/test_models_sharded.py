"""Loading that scales: meta-device build -> FSDP2 shards -> each rank reads its own slices."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

from lightrft.models import load_model
from lightrft.models.names import hf_checkpoint_name
from lightrft.models.sharded import (
    SafetensorsIndex,
    build_on_meta,
    checkpoint_names,
    load_parallel,
)
from lightrft.tasks import make_tiny_model

IDS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23], [2, 4, 6, 8, 10, 12, 14, 16]])


def _reference(path) -> dict:
    model = load_model(path)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return {"logits": logits, "buffers": buffers}


def _lora(model):
    from lightrft.models.lora import apply_lora
    from lightrft.sections import LoraConfig

    return apply_lora(
        model, LoraConfig.read({"rank": 4, "alpha": 8.0, "trained_modules": ["lm_head"]})
    )


def _sharded_worker(rank: int, world: int, tied: str, untied: str, vlm: str, ref_file: str) -> None:
    from torch.distributed.tensor import DTensor

    refs = torch.load(ref_file)
    for name, path in (("tied", tied), ("untied", untied), ("vlm", vlm)):
        torch.manual_seed(0)
        model = load_parallel(path)
        # No rank holds a full copy: every weight with more than one row is a proper shard
        # (checked before forward: the last block stays unsharded after it, see parallelize).
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor), n
            if p.shape[0] >= world:
                assert p.to_local().shape[0] < p.shape[0], n
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
        torch.testing.assert_close(logits, refs[name]["logits"], rtol=0, atol=1e-6)
        # Non-persistent buffers (rotary inv_freq) are computed, not garbage left by meta init.
        for n, b in model.named_buffers():
            torch.testing.assert_close(b, refs[name]["buffers"][n], rtol=0, atol=0)
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        assert (head.weight is emb.weight) == (name == "tied")

    # A frozen model (a reference policy): its untied LM head is an FSDP2 group of its own,
    # gathered only for the head's forward; the fused log-probs read it there and equal the
    # single-process ones. A trained model keeps the head in the root group.
    from torch.distributed.fsdp import FSDPModule

    from lightrft.models.forward import causal_lm_token_logprobs

    frozen = load_parallel(untied, prepare=lambda m: m.requires_grad_(False))
    assert isinstance(frozen.get_output_embeddings(), FSDPModule)
    assert not isinstance(load_parallel(untied).get_output_embeddings(), FSDPModule)
    with torch.no_grad():
        logits = frozen(input_ids=IDS).logits
        lp = causal_lm_token_logprobs(frozen, IDS)
    torch.testing.assert_close(logits, refs["untied"]["logits"], rtol=0, atol=1e-6)
    want = refs["untied"]["logits"][:, :-1].log_softmax(-1).gather(-1, IDS[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    # Nothing of it stays gathered after the forward (no backward will come): the last block
    # and the head are resharded too.
    for n, p in frozen.named_parameters():
        if p.shape[0] >= world:
            assert p._local_tensor.untyped_storage().size() > 0, n
            assert p.to_local().shape[0] < p.shape[0], n
    last = frozen.model.layers[-1]
    assert all(
        not (hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group.is_unsharded)
        for m in (last, frozen.lm_head)
    )

    # LoRA created on the meta base layers: adapters initialised as PEFT does, in full, then
    # sharded (lora_A rows differ across ranks); lora_B = 0 keeps the base model's logits.
    torch.manual_seed(0)
    model = load_parallel(untied, prepare=_lora)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    torch.testing.assert_close(logits, refs["untied"]["logits"], rtol=0, atol=1e-6)
    a = dict(model.named_parameters())[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    ].full_tensor()
    assert torch.linalg.matrix_rank(a) == 4
    # The trained copy of the head (modules_to_save) is read from the checkpoint too.
    head = dict(model.named_parameters())["base_model.model.lm_head.modules_to_save.default.weight"]
    base = load_model(untied).lm_head.weight
    torch.testing.assert_close(head.full_tensor(), base, rtol=0, atol=0)


def test_sharded_load_matches_single_process(tmp_path, tiny_vlm):
    """Tied and untied text models and a vision-language model (its tower sharded too, text
    input): the sharded model's logits and buffers equal the single-process model's."""
    tied = make_tiny_model(tmp_path / "tied", tie_embeddings=True, hidden=48, heads=4, kv_heads=2)
    untied = make_tiny_model(tmp_path / "untied", layers=3, seed=1)
    vlm = tiny_vlm("qwen2_5_vl")
    refs = {"tied": _reference(tied), "untied": _reference(untied), "vlm": _reference(vlm)}
    torch.save(refs, tmp_path / "refs.pt")
    run_distributed(_sharded_worker, str(tied), str(untied), str(vlm), str(tmp_path / "refs.pt"))


def test_single_process_is_plain_loading(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    model = load_parallel(path)
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=IDS).logits, _reference(path)["logits"], rtol=0, atol=0
        )


def test_meta_build_keeps_buffers_real(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    model = build_on_meta(path)
    assert all(p.is_meta for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and not any(b.is_meta for b in buffers.values())
    ref = _reference(path)["buffers"]
    for n, b in buffers.items():
        torch.testing.assert_close(b, ref[n], rtol=0, atol=0)
    names, converted = checkpoint_names(model, list(SafetensorsIndex.read(path).files))
    assert not converted
    assert set(names) == {n for n, _ in model.named_parameters()}


def test_checkpoint_names_strip_wrappers():
    name = (
        "base_model.model.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.base_layer.weight"
    )
    assert hf_checkpoint_name(name) == "model.layers.0.mlp.up_proj.weight"
    assert hf_checkpoint_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"


def test_missing_safetensors_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        SafetensorsIndex.read(tmp_path)


def test_legacy_layout_is_renamed_and_kept_on_save(tiny_vlm, tmp_path):
    """transformers 5 writes Qwen2.5-VL in its legacy layout (``model.layers``, ``visual``):
    the meta-built model reads it through transformers' renamings and, like from_pretrained,
    saves that layout back (the recipes' export)."""
    from safetensors import safe_open

    path = tiny_vlm("qwen2_5_vl")
    model = build_on_meta(path)
    keys = list(SafetensorsIndex.read(path).files)
    names, converted = checkpoint_names(model, keys)
    assert not converted
    assert names["model.language_model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert set(names) == {n for n, _ in model.named_parameters()}
    model.to_empty(device="cpu")
    model.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(keys)
