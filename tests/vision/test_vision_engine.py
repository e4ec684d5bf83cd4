"""The native engine on tiny vision-language models: trainer log-prob agreement, greedy equality
with HF generate, vision tokens never sampled, bad requests, sleep / wake / weight sync."""

import numpy as np
import pytest
import torch
from _vision_helpers import square

from lightrft.data import AudioInputs, Media, PromptDataset
from lightrft.engine import NativeEngine, Request, SamplingParams, sync_weights
from lightrft.models.forward import causal_lm_token_logprobs
from lightrft.models.modality import vision_token_ids
from lightrft.models.multimodal import load_processor, load_vision_model, set_vision_trainable

ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"]


def _prompts(proc):
    recs = [
        {"prompt": "<image>What colour is it?", "answer": "red", "images": [square((255, 0, 0))]},
        {"prompt": "Hi", "answer": "x"},  # text-only prompt in the same batch
        {
            "prompt": "<image> and <image>: which is larger?",
            "answer": "second",
            "images": [square((0, 255, 0), (56, 56)), square((0, 0, 255), (112, 84))],
        },
    ]
    return PromptDataset(proc, records=recs)


def _requests(ds):
    out = []
    for i in range(len(ds)):
        out.append(Request(ds[i]["prompt_ids"], ds[i]["media"]))
    return out


def _trainer_logprobs(model, req, completion):
    """The trainer path: one forward of prompt + completion through the fused kernel."""
    ids = torch.tensor([req.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        lp = causal_lm_token_logprobs(model, ids, media=req.media)
    return lp[0, len(req.prompt_token_ids) - 1 :]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_logprobs_equal_trainer_logprobs(tiny_vlm, arch):
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    reqs = _requests(_prompts(proc))
    engine = NativeEngine(path, dtype="float32", device="cpu")
    outs = engine.generate(reqs, SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3))
    assert len(outs) == 9
    suppressed = set(vision_token_ids(model.config))
    for c in outs:
        assert not suppressed & set(c.token_ids)
        ref = _trainer_logprobs(model, reqs[c.request_index], c)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_equals_hf_generate(tiny_vlm, arch):
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    reqs = _requests(_prompts(proc))
    engine = NativeEngine(path, dtype="float32", device="cpu")
    outs = engine.generate(reqs, SamplingParams(temperature=0.0, max_tokens=10))
    for req, c in zip(reqs, outs, strict=True):
        ids = torch.tensor([req.prompt_token_ids])
        kw = {}
        if req.media is not None:
            kw = req.media.model_inputs()
            if arch != "llava":
                kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=10,
            suppress_tokens=vision_token_ids(model.config),
            **kw,
        )
        assert c.token_ids == gen[0, ids.shape[1] :].tolist()
    assert sum(len(c.token_ids) for c in outs) >= 12  # not all stopped at once


def test_bad_multimodal_requests(tiny_vlm, tiny_model_dir):
    path = tiny_vlm("qwen2_vl")
    proc = load_processor(path)
    reqs = _requests(_prompts(proc))
    engine = NativeEngine(path, dtype="float32", device="cpu")
    sp = SamplingParams(max_tokens=2)
    bad_count = [t for t in reqs[0].prompt_token_ids]
    bad_count.remove(proc.image_token_id)
    with pytest.raises(ValueError, match=r"requests\[0\] has 3 image tokens"):
        engine.generate([Request(bad_count, reqs[0].media)], sp)
    with pytest.raises(TypeError, match="Media.image must be the processed ImageInputs"):
        Media(image=[square((1, 2, 3))])
    with pytest.raises(ValueError, match=r"requests\[0\]\.media is a dict; pass the Media"):
        engine.generate([Request(reqs[0].prompt_token_ids, {"image": reqs[0].media.image})], sp)
    audio = AudioInputs(
        [np.zeros(8, np.float32)], torch.zeros(1, 2, 4), torch.ones(1, 4), [1], 16000
    )
    with pytest.raises(
        ValueError, match=r"carries audio; the native engine takes images and videos only"
    ):
        engine.generate([Request(reqs[0].prompt_token_ids, Media(audio=audio))], sp)
    text_engine = NativeEngine(tiny_model_dir, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="not a vision-language model"):
        text_engine.generate([Request([5, 6], reqs[0].media)], sp)


@pytest.mark.parametrize("train_vision", [False, True])
def test_sleep_wake_and_weight_sync_with_vision_tower(tiny_vlm, train_vision):
    """After a level-2 sleep the engine takes every weight back under the trainer's names; a
    trained vision tower's update reaches the engine's."""
    path = tiny_vlm("qwen2_vl")
    proc, model = load_processor(path), load_vision_model(path)
    set_vision_trainable(model, train_vision)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    reqs = _requests(_prompts(proc))[:1]
    engine = NativeEngine(path, dtype="float32", device="cpu")
    engine.sleep(2)
    engine.wake_up()
    stats = sync_weights(model, engine)
    assert stats.tensors == len(list(model.parameters()))
    outs = engine.generate(reqs, SamplingParams(n=2, max_tokens=6, seed=1))
    for c in outs:
        ref = _trainer_logprobs(model, reqs[0], c)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)
    eng_vis = dict(engine.model.named_parameters())["model.visual.blocks.0.attn.qkv.weight"]
    trn_vis = dict(model.named_parameters())["model.visual.blocks.0.attn.qkv.weight"]
    assert torch.equal(eng_vis, trn_vis)

    # Level-1 cycles may leave the frozen tower out: only trainable weights travel.
    engine.sleep(1)
    engine.wake_up()
    lean = sync_weights(model, engine, skip_frozen=True)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert lean.tensors == trainable
    assert (trainable < stats.tensors) == (not train_vision)
    again = engine.generate(reqs, SamplingParams(n=2, max_tokens=6, seed=1))
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]


def test_prefill_chunks_and_waves_do_not_change_multimodal_samples(tiny_vlm):
    """One request per prefill chunk and two rows per wave give the seeded samples of one batch:
    each chunk's images are those of its own rows."""
    path = tiny_vlm("qwen2_5_vl")
    reqs = _requests(_prompts(load_processor(path)))
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5)
    whole = NativeEngine(path, dtype="float32", device="cpu").generate(reqs, sp)
    split = NativeEngine(
        path, dtype="float32", device="cpu", max_prefill_tokens=1, max_num_seqs=2
    ).generate(reqs, sp)
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]
    for a, b in zip(split, whole, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )


def test_image_requests_admitted_mid_batch_equal_each_request_alone(tiny_vlm):
    """Continuous batching with M-RoPE: a request admitted while another decodes gets its own
    positions and rope offset (its log-probs are the trainer's), and samples what it samples
    alone."""
    path = tiny_vlm("qwen2_5_vl")
    model = load_vision_model(path)
    reqs = _requests(_prompts(load_processor(path)))
    reqs = [reqs[1], reqs[0], reqs[2], reqs[0]]  # a text prompt first, images admitted later
    sps = [
        SamplingParams(n=1, max_tokens=m, seed=40 + k, ignore_eos=True)
        for k, m in enumerate([10, 2, 4, 3])
    ]
    narrow = NativeEngine(path, dtype="float32", device="cpu", max_num_seqs=2)
    outs = narrow.generate(reqs, sps)
    assert narrow.stats.admitted_while_decoding >= 2
    alone = NativeEngine(path, dtype="float32", device="cpu")
    for req, sp, c in zip(reqs, sps, outs, strict=True):
        (ref,) = alone.generate([req], [sp])
        assert c.token_ids == ref.token_ids
        trainer = _trainer_logprobs(model, req, c)
        torch.testing.assert_close(torch.tensor(c.logprobs), trainer, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_multi_turn_after_an_image_prompt_matches_the_trainer(tiny_vlm, arch):
    """The first turn sees the image; observations are text appended to the row's cache. The
    sampled tokens' log-probs equal the trainer's over prompt + the whole response (M-RoPE
    positions included), and an observation holding a vision token is refused."""
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    reqs = _requests(_prompts(proc))
    engine = NativeEngine(path, dtype="float32", device="cpu")
    free = engine.generate(reqs, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stops = sorted({c.token_ids[2] for c in free})  # ids greedy decoding reaches early
    suppressed = vision_token_ids(model.config)
    text_ids = [t for t in range(5, 40) if t not in suppressed][:4]

    def continuation(turn):
        return text_ids[: turn.turn_index + 2] if turn.turn_index < 2 else None

    sp = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=stops)
    outs = engine.generate(reqs, sp, continuation=continuation)
    assert all(c.num_turns > 1 for c in outs if reqs[c.request_index].media is not None)
    for c in outs:
        mask = torch.tensor(c.sampled_mask)
        ref = _trainer_logprobs(model, reqs[c.request_index], c)
        torch.testing.assert_close(torch.tensor(c.logprobs)[mask], ref[mask], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="media placeholder id"):
        engine.generate(reqs[:1], sp, continuation=lambda t: [suppressed[0]])
