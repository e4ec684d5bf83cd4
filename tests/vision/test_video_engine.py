"""The native engine with videos (tiny Qwen2-VL and Qwen2.5-VL): its log-probs equal the
trainer's, greedy equals HF generate, each group's video is encoded once (one prefill per
request, copied to its n rows), and a video request to a model without video is refused."""

import importlib.util

import pytest
import torch
from _video_helpers import moving_square, write_video
from _vision_helpers import square
from PIL import Image

from lightrft.data import PromptDataset
from lightrft.data.media import MediaOptions
from lightrft.data.video import VideoOptions
from lightrft.engine import NativeEngine, Request, SamplingParams
from lightrft.models.forward import causal_lm_token_logprobs, mm_token_types
from lightrft.models.modality import vision_token_ids
from lightrft.models.multimodal import load_processor, load_vision_model


def _requests(proc, tmp_path):
    clip = write_video(tmp_path / "clip.mp4", moving_square(6), fps=4)
    frames = [Image.fromarray(f) for f in moving_square(3, direction=-1)]
    recs = [
        {"prompt": "<video>Which way?", "answer": "right", "videos": [str(clip)]},
        {"prompt": "Hi", "answer": "x"},
        {
            "prompt": "<image> and <video>?",
            "answer": "left",
            "images": [square((0, 255, 0), (84, 56))],
            "videos": [frames],
        },
    ]
    ds = PromptDataset(proc, records=recs, media=MediaOptions(video=VideoOptions(fps=4.0)))
    return [Request(ds[i]["prompt_ids"], ds[i]["media"]) for i in range(len(ds))]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_engine_with_videos_equals_trainer_and_encodes_once_per_group(tiny_vlm, tmp_path, arch):
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    reqs = _requests(proc, tmp_path)
    engine = NativeEngine(path, dtype="float32", device="cpu")
    seen = []
    hook = engine.model.model.visual.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(args[0].shape[0]), with_kwargs=True
    )
    try:
        outs = engine.generate(reqs, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=1))
    finally:
        hook.remove()
    # Each request's patches pass the vision tower once, not once per sample.
    media = [r.media for r in reqs if r.media is not None]
    patches = sum(m.video.pixel_values_videos.shape[0] for m in media) + sum(
        m.image.pixel_values.shape[0] for m in media if m.image is not None
    )
    assert sum(seen) == patches
    suppressed = set(vision_token_ids(model.config))
    assert len(outs) == 9
    for c in outs:
        assert not suppressed & set(c.token_ids)
        req = reqs[c.request_index]
        ids = torch.tensor([req.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            ref = causal_lm_token_logprobs(model, ids, media=req.media)[
                0, len(req.prompt_token_ids) - 1 :
            ]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)
    # Greedy decoding equals HF generate with the same video inputs.
    greedy = engine.generate([reqs[0]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    ids = torch.tensor([reqs[0].prompt_token_ids])
    gen = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=mm_token_types(model.config, ids),
        do_sample=False,
        max_new_tokens=8,
        suppress_tokens=vision_token_ids(model.config),
        **reqs[0].media.model_inputs(),
    )
    assert greedy.token_ids == gen[0, ids.shape[1] :].tolist()


def test_video_request_to_a_model_without_video_is_refused(tiny_vlm, tmp_path):
    reqs = _requests(load_processor(tiny_vlm("qwen2_vl")), tmp_path)
    engine = NativeEngine(tiny_vlm("llava"), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"requests\[0\] carries video; the native engine takes"):
        engine.generate([reqs[0]], SamplingParams(max_tokens=2))
    qwen = NativeEngine(tiny_vlm("qwen2_vl"), dtype="float32", device="cpu")
    ids = list(reqs[0].prompt_token_ids)
    ids.remove(qwen.media_token_ids["video"])
    with pytest.raises(
        ValueError, match=r"requests\[0\] has 11 video tokens but its 1 video\(s\) take 12"
    ):
        qwen.generate([Request(ids, reqs[0].media)], SamplingParams(max_tokens=2))


def test_vllm_prompt_carries_videos_as_frames_with_metadata(tiny_vlm, tmp_path):
    """The vLLM adapter's request conversion, on CPU: vLLM is not installed here (its wheel is
    CUDA-only), so the request dict is checked, not what vLLM makes of it."""
    from lightrft.engine import vllm_adapter as va

    proc = load_processor(tiny_vlm("qwen2_5_vl"))
    req = _requests(proc, tmp_path)[2]  # an image, then a video of 3 frames
    video, image = req.media.video, req.media.image
    prompt = va.vllm_prompt(
        req.prompt_token_ids, req.media, proc.image_token_id, None, proc.video_token_id
    )
    ids = prompt["prompt_token_ids"]
    assert ids.count(proc.video_token_id) == 1 and ids.count(proc.image_token_id) == 1
    # Expanding each run back by its token count gives the original ids.
    back, k = [], {proc.image_token_id: 0, proc.video_token_id: 0}
    counts = {proc.image_token_id: image.num_tokens, proc.video_token_id: video.num_tokens}
    for t in ids:
        if t in counts:
            back += [t] * counts[t][k[t]]
            k[t] += 1
        else:
            back.append(t)
    assert back == list(req.prompt_token_ids)
    ((frames, meta),) = prompt["multi_modal_data"]["video"]
    assert frames is video.videos[0] and frames.shape == (3, 56, 56, 3)
    assert meta["fps"] == 4.0 and meta["total_num_frames"] == 3
    assert meta["frames_indices"] == [0, 1, 2] and meta["duration"] == 0.75
    assert prompt["multi_modal_data"]["image"] == image.images
    videos_kwargs = prompt["mm_processor_kwargs"]["videos_kwargs"]
    assert videos_kwargs["do_sample_frames"] is False
    assert videos_kwargs["size"] == {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}
    with pytest.raises(ValueError, match="the request has videos but the model takes no video"):
        va.vllm_prompt(req.prompt_token_ids, req.media, proc.image_token_id, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None),
    reason="needs CUDA and vllm==0.32.0 (the request conversion is checked on CPU above)",
)
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_vllm_engine_video_on_gpu(tmp_path, arch):
    """Real vLLM with video requests (a file and a frame list, one beside an image): greedy
    equals the native engine's, and sampled log-probs equal the trainer path's."""
    from lightrft.engine import vllm_adapter as va
    from lightrft.tasks import make_tiny_model

    # head_dim 64: a size every vLLM attention backend supports.
    path = make_tiny_model(tmp_path / "m", arch=arch, hidden=256, heads=4, kv_heads=2)
    reqs = _requests(load_processor(path), tmp_path)
    engine = va.VLLMEngine(
        path,
        dtype="float32",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        seed=0,
        limit_mm_per_prompt={"image": 1, "video": 1},
    )
    native = NativeEngine(path, dtype="float32", device="cuda")
    greedy = engine.generate(reqs, SamplingParams(temperature=0, max_tokens=8))
    ref = native.generate(reqs, SamplingParams(temperature=0, max_tokens=8))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in ref]
    hf = load_vision_model(path, device="cuda").eval()
    sampled = engine.generate(reqs, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1))
    for c in sampled:
        req = reqs[c.request_index]
        ids = torch.tensor([c.prompt_token_ids + c.token_ids], device="cuda")
        with torch.no_grad():
            lp = causal_lm_token_logprobs(hf, ids, media=req.media)[0]
        lp = lp[len(c.prompt_token_ids) - 1 :].cpu()
        assert torch.allclose(torch.tensor(c.logprobs), lp, atol=1e-3)
