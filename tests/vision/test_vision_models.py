"""Tiny vision-language models, their processors without torchvision, loading, freezing the
vision tower, and FSDP2 sharding of the tower over 2 gloo processes."""

import json
import subprocess
import sys

import pytest
import torch
from _dist import run_distributed
from _vision_helpers import square

from lightrft import cli
from lightrft.data import SFTDataset, pack_or_pad_collator
from lightrft.models import parallelize
from lightrft.models.forward import causal_lm_cross_entropy
from lightrft.models.modality import vision_token_ids
from lightrft.models.multimodal import (
    load_processor,
    load_vision_model,
    media_blocks,
    set_vision_trainable,
)

ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_vlm_is_a_normal_hf_directory(tiny_vlm, arch):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_vlm(arch)
    model = AutoModelForImageTextToText.from_pretrained(path)
    proc = AutoProcessor.from_pretrained(path)  # our image-only subclass is registered
    assert type(proc) is type(load_processor(path))
    cfg = model.config
    tok = proc.tokenizer
    text = cfg.get_text_config()
    for t in vision_token_ids(cfg):
        assert tok.added_tokens_decoder[t].special
    if arch != "llava":
        head_dim = text.hidden_size // text.num_attention_heads
        assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
        out = getattr(cfg.vision_config, "out_hidden_size", None) or cfg.vision_config.hidden_size
        assert out == text.hidden_size
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text_in = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert proc.image_token in text_in and text_in.endswith("<|im_start|>assistant\n")
    inputs = proc(text=[text_in], images=[square((9, 9, 9))], return_tensors="pt")
    assert model(**inputs).logits.shape[:2] == inputs["input_ids"].shape


def test_cli_tiny_model_arch(tmp_path, capsys):
    assert cli.main(["tiny-model", "--out", str(tmp_path / "m"), "--arch", "qwen2_5_vl"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert "qwen2_5_vl" in capsys.readouterr().out


def test_processing_never_needs_torchvision(tiny_vlm):
    """The whole image path runs with torchvision made unimportable (as on this CPU machine)."""
    code = f"""
import sys
sys.modules["torchvision"] = None
from lightrft.models.multimodal import load_processor, load_vision_model
from PIL import Image
path = {str(tiny_vlm("qwen2_vl"))!r}
proc = load_processor(path)
assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil", type(proc.image_processor)
inputs = proc(text=["<|vision_start|><|image_pad|><|vision_end|>x"],
              images=[Image.new("RGB", (56, 56))], return_tensors="pt")
load_vision_model(path)(**inputs)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_load_processor_refuses_a_text_model(tiny_model_dir):
    with pytest.raises(ValueError, match="vision-language"):
        load_processor(tiny_model_dir)


def _batch(proc):
    ds = SFTDataset(
        proc,
        records=[
            {"prompt": "<image>colour?", "completion": "red", "images": [square((255, 0, 0))]},
            {"prompt": "<image>colour?", "completion": "blue", "images": [square((0, 0, 255))]},
        ],
    )
    return pack_or_pad_collator(proc.tokenizer)([ds[0], ds[1]])


def _loss(model, batch):
    targets = batch["labels"][:, 1:]
    return causal_lm_cross_entropy(
        model,
        batch["input_ids"],
        targets=targets,
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        media=batch["media"],
    )


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
@pytest.mark.parametrize("train_vision", [False, True])
def test_vision_tower_freezing_decides_what_a_step_changes(tiny_vlm, arch, train_vision):
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    names = set(set_vision_trainable(model, train_vision))
    assert names and all(n.startswith(("model.visual.", "model.vision_tower.")) for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    _loss(model, _batch(proc)).backward()
    opt.step()
    changed_vision = 0
    for n, p in model.named_parameters():
        changed = not torch.equal(p, before[n])
        # LLaVA's feature layer comes before CLIP's post-layernorm: that one gets no gradient.
        used = p.grad is not None
        assert changed == (used and (n not in names or train_vision)), n
        changed_vision += changed and n in names
    assert (changed_vision >= len(names) - 2) if train_vision else changed_vision == 0


def _fsdp_worker(rank, world, path, expected_loss):
    for train_vision in (False, True):
        _fsdp_step(path, train_vision, expected_loss)


def _fsdp_step(path, train_vision, expected_loss):
    proc, model = load_processor(path), load_vision_model(path)
    set_vision_trainable(model, train_vision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    parallelize(model, param_dtype=torch.float32)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    blocks = media_blocks(model)  # the vision tower's
    assert blocks and all(isinstance(b, FSDPModule) for b in blocks)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    loss = _loss(model, _batch(proc))
    assert abs(float(loss) - expected_loss) < 1e-5
    loss.backward()
    opt.step()
    for n, p in model.named_parameters():
        full = p.full_tensor()
        assert torch.equal(full, before[n]) == (n in frozen), n


@pytest.mark.slow  # test_vlm_sft_two_processes_train_the_tower shards it through the recipe
def test_fsdp2_shards_the_vision_tower_over_two_processes(tiny_vlm):
    """Frozen and trained tower: sharded loss equals the unsharded one; a step changes exactly
    the trainable parameters."""
    path = tiny_vlm("qwen2_vl")
    proc, model = load_processor(path), load_vision_model(path)
    with torch.no_grad():
        expected = float(_loss(model, _batch(proc)))
    run_distributed(_fsdp_worker, str(path), expected)
