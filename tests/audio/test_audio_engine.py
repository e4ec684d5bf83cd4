"""The native engine on a tiny Qwen2-Audio: trainer log-prob agreement, one audio-tower pass per
request (not per sample), greedy equality with HF generate, the audio token never sampled, bad
requests, weight sync with a frozen or trained audio tower."""

import pytest
import torch
from _audio_helpers import tone

from lightrft.data import ImageInputs, Media, PromptDataset
from lightrft.engine import NativeEngine, Request, SamplingParams, sync_weights
from lightrft.models import load_model, load_processor, set_audio_trainable
from lightrft.models.forward import causal_lm_token_logprobs


def _prompts(proc):
    recs = [
        {
            "prompt": "<audio>How many beeps?",
            "answer": "2",
            "audios": {"array": tone(0.6, 16000, 440), "sampling_rate": 16000},
        },
        {"prompt": "Hi", "answer": "x"},  # text-only prompt in the same batch
        {
            "prompt": "<audio> then <audio>: higher?",
            "answer": "second",
            "audios": [
                {"array": tone(0.3, 8000, 300), "sampling_rate": 8000},
                {"array": tone(1.1, 16000, 900), "sampling_rate": 16000},
            ],
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


def test_engine_logprobs_equal_trainer_logprobs_one_tower_pass_per_request(tiny_alm):
    proc, model = load_processor(tiny_alm), load_model(tiny_alm)
    reqs = _requests(_prompts(proc))
    engine = NativeEngine(tiny_alm, dtype="float32", device="cpu")
    seen = []
    engine.model.model.audio_tower.register_forward_hook(
        lambda _m, args, _o: seen.append(args[0].shape[0])
    )
    outs = engine.generate(reqs, SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=3))
    assert len(outs) == 12
    # The prefill encodes each request's audio once (3 audio in one chunk), not once per sample.
    assert seen == [3]
    audio_id = proc.audio_token_id
    for c in outs:
        assert audio_id not in c.token_ids
        ref = _trainer_logprobs(model, reqs[c.request_index], c)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_engine_greedy_equals_hf_generate(tiny_alm):
    proc, model = load_processor(tiny_alm), load_model(tiny_alm)
    reqs = _requests(_prompts(proc))
    outs = NativeEngine(tiny_alm, dtype="float32", device="cpu").generate(
        reqs, SamplingParams(temperature=0.0, max_tokens=10)
    )
    for req, c in zip(reqs, outs, strict=True):
        ids = torch.tensor([req.prompt_token_ids])
        kw = req.media.model_inputs() if req.media is not None else {}
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=10,
            suppress_tokens=[proc.audio_token_id],
            **kw,
        )
        assert c.token_ids == gen[0, ids.shape[1] :].tolist()
    assert sum(len(c.token_ids) for c in outs) >= 12  # not all stopped at once


def test_prefill_chunks_do_not_change_audio_samples(tiny_alm):
    reqs = _requests(_prompts(load_processor(tiny_alm)))
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5)
    whole = NativeEngine(tiny_alm, dtype="float32", device="cpu").generate(reqs, sp)
    split = NativeEngine(
        tiny_alm, dtype="float32", device="cpu", max_prefill_tokens=1, max_num_seqs=2
    ).generate(reqs, sp)
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]


def test_bad_audio_requests(tiny_alm, tiny_model_dir):
    proc = load_processor(tiny_alm)
    reqs = _requests(_prompts(proc))
    engine = NativeEngine(tiny_alm, dtype="float32", device="cpu")
    sp = SamplingParams(max_tokens=2)
    fewer = list(reqs[0].prompt_token_ids)
    fewer.remove(proc.audio_token_id)
    n = sum(reqs[0].media.audio.num_tokens)
    with pytest.raises(ValueError, match=rf"requests\[0\] has {n - 1} audio tokens but its 1"):
        engine.generate([Request(fewer, reqs[0].media)], sp)
    with pytest.raises(TypeError, match="Media.audio must be the processed AudioInputs"):
        Media(audio=[tone(0.5)])
    image = ImageInputs([None], torch.zeros(4, 8), torch.tensor([[1, 2, 2]]), [1], {})
    with pytest.raises(ValueError, match=r"carries image; the native engine takes audio only"):
        engine.generate([Request(reqs[0].prompt_token_ids, Media(image=image))], sp)
    text_engine = NativeEngine(tiny_model_dir, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="nor an audio-language one"):
        text_engine.generate([Request([5, 6], reqs[0].media)], sp)


@pytest.mark.parametrize("train_audio", [False, True])
def test_weight_sync_with_audio_tower(tiny_alm, train_audio):
    """A level-2 sleep takes every weight back; a trained audio tower's update reaches the
    engine, a frozen one stays out of a lean (trainable-only) sync."""
    proc, model = load_processor(tiny_alm), load_model(tiny_alm)
    frozen = set_audio_trainable(model, train_audio)
    assert frozen and all(n.startswith("model.audio_tower.") for n in frozen)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    reqs = _requests(_prompts(proc))[:1]
    engine = NativeEngine(tiny_alm, dtype="float32", device="cpu")
    engine.sleep(2)
    engine.wake_up()
    stats = sync_weights(model, engine)
    assert stats.tensors == len(list(model.parameters()))
    outs = engine.generate(reqs, SamplingParams(n=2, max_tokens=6, seed=1))
    for c in outs:
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _trainer_logprobs(model, reqs[0], c), atol=1e-5, rtol=0
        )
    engine.sleep(1)
    engine.wake_up()
    lean = sync_weights(model, engine, skip_frozen=True)
    assert (lean.tensors < stats.tensors) == (not train_audio)
