"""Tiny Qwen2-Audio: a normal HF directory loaded by the real loaders (no torchvision, no
torchaudio), the audio tower frozen by default in what a step changes, FSDP2 sharding of the
audio tower over 2 gloo processes."""

import json
import subprocess
import sys

import pytest
import torch
from _audio_helpers import tone
from _dist import run_distributed

from lightrft import cli
from lightrft.data import SFTDataset, pack_or_pad_collator
from lightrft.models import load_model, load_processor, parallelize, set_towers_trainable
from lightrft.models.forward import causal_lm_cross_entropy
from lightrft.models.modality import media_token_ids
from lightrft.models.multimodal import media_blocks


def test_tiny_audio_lm_is_a_normal_hf_directory(tiny_alm):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = load_model(tiny_alm)
    assert type(model) is Qwen2AudioForConditionalGeneration
    proc = AutoProcessor.from_pretrained(tiny_alm)
    assert type(proc) is type(load_processor(tiny_alm))
    assert type(proc.feature_extractor).__name__ == "WhisperFeatureExtractor"
    tok = proc.tokenizer
    for t in media_token_ids(model.config):
        assert tok.added_tokens_decoder[t].special
    msgs = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|audio_bos|><|AUDIO|><|audio_eos|>hi<|im_end|>\n<|im_start|>assistant\n")
    inputs = proc(text=[text], audio=[tone(0.7)], return_tensors="pt")
    assert model(**inputs).logits.shape[:2] == inputs["input_ids"].shape


def test_cli_tiny_model_arch_qwen2_audio(tmp_path, capsys):
    assert cli.main(["tiny-model", "--out", str(tmp_path / "m"), "--arch", "qwen2_audio"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_audio" and cfg["audio_config"]["num_mel_bins"] == 16
    assert "qwen2_audio" in capsys.readouterr().out


def test_audio_path_never_needs_torchaudio_or_librosa(tiny_alm, tmp_path):
    """Decoding, resampling, features and a forward with torchaudio, librosa and torchvision
    made unimportable."""
    code = f"""
import sys
for name in ("torchaudio", "librosa", "torchvision"):
    sys.modules[name] = None
import numpy as np, soundfile as sf
from lightrft.data import SFTDataset
from lightrft.models import load_model, load_processor
sf.write({str(tmp_path / "x.flac")!r}, np.sin(np.arange(9000) / 5).astype("float32") * 0.3, 22050)
proc = load_processor({str(tiny_alm)!r})
ds = SFTDataset(proc, records=[{{"prompt": "<audio>q", "completion": "a",
                                "audios": [{str(tmp_path / "x.flac")!r}]}}])
item = ds[0]
load_model({str(tiny_alm)!r})(input_ids=item["input_ids"][None], **item["media"].audio.model_inputs())
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def _batch(proc):
    ds = SFTDataset(
        proc,
        records=[
            {
                "prompt": "<audio>pitch?",
                "completion": "low",
                "audios": [{"array": tone(0.5, 16000, 200), "sampling_rate": 16000}],
            },
            {
                "prompt": "<audio>pitch?",
                "completion": "high",
                "audios": [{"array": tone(0.9, 16000, 2000), "sampling_rate": 16000}],
            },
        ],
    )
    return pack_or_pad_collator(proc.tokenizer)([ds[0], ds[1]])


def _loss(model, batch):
    return causal_lm_cross_entropy(
        model,
        batch["input_ids"],
        targets=batch["labels"][:, 1:],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        media=batch["media"],
    )


@pytest.mark.parametrize("train_audio", [False, True])
def test_audio_tower_freezing_decides_what_a_step_changes(tiny_alm, train_audio):
    proc, model = load_processor(tiny_alm), load_model(tiny_alm)
    names = set(set_towers_trainable(model, audio=train_audio))
    assert names and all(n.startswith("model.audio_tower.") for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    _loss(model, _batch(proc)).backward()
    opt.step()
    changed_tower = 0
    for n, p in model.named_parameters():
        changed = not torch.equal(p, before[n])
        used = p.grad is not None
        assert changed == (used and (n not in names or train_audio)), n
        changed_tower += changed and n in names
    # The projector (multi_modal_projector) trains either way, as LLaVA's does.
    assert not torch.equal(
        model.model.multi_modal_projector.linear.weight,
        before["model.multi_modal_projector.linear.weight"],
    )
    assert (changed_tower >= len(names) - 2) if train_audio else changed_tower == 0


def _fsdp_worker(rank, world, path, expected_loss):
    for train_audio in (False, True):
        proc, model = load_processor(path), load_model(path)
        set_towers_trainable(model, audio=train_audio)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        parallelize(model, param_dtype=torch.float32)
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        blocks = media_blocks(model)  # the audio tower's
        assert blocks and all(isinstance(b, FSDPModule) for b in blocks)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        loss = _loss(model, _batch(proc))
        assert abs(float(loss) - expected_loss) < 1e-5
        loss.backward()
        opt.step()
        for n, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), before[n]) == (n in frozen), n


def test_fsdp2_shards_the_audio_tower_over_two_processes(tiny_alm):
    """Frozen and trained tower: the sharded loss equals the unsharded one; a step changes
    exactly the trainable parameters."""
    proc, model = load_processor(tiny_alm), load_model(tiny_alm)
    with torch.no_grad():
        expected = float(_loss(model, _batch(proc)))
    run_distributed(_fsdp_worker, str(tiny_alm), expected)
