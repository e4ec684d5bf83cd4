"""The vLLM adapter's multimodal request conversion on CPU; the engine itself on a CUDA GPU."""

import importlib.util

import pytest
import torch
from _vision_helpers import square

from lightrft.data import PromptDataset
from lightrft.data.media import MediaOptions
from lightrft.data.vision import ImageOptions
from lightrft.engine import Request, SamplingParams
from lightrft.engine import vllm_adapter as va
from lightrft.engine.external import collapse_placeholders, hf_weight_names
from lightrft.models.modality import vision_token_ids
from lightrft.models.multimodal import load_processor

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _dataset(proc):
    return PromptDataset(
        proc,
        records=[
            {
                "prompt": "<image> vs <image>: bigger?",
                "answer": "2",
                "images": [square((255, 0, 0)), square((0, 0, 255), (112, 84))],
            },
            {"prompt": "text only", "answer": "x"},
        ],
        media=MediaOptions(image=ImageOptions(min_pixels=28 * 28, max_pixels=28 * 28 * 16)),
    )


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_vllm_prompt_collapses_each_image_run_and_passes_pil_images(tiny_vlm, arch):
    proc = load_processor(tiny_vlm(arch))
    item = _dataset(proc)[0]
    images = item["media"].image
    tok = proc.image_token_id
    prompt = va.vllm_prompt(item["prompt_ids"], item["media"], tok)
    ids = prompt["prompt_token_ids"]
    assert ids.count(tok) == 2
    # Expanding each placeholder back by the image's token count gives the original ids.
    back = []
    k = 0
    for t in ids:
        back += [t] * (images.num_tokens[k] if t == tok else 1)
        k += t == tok
    assert back == item["prompt_ids"]
    assert prompt["multi_modal_data"]["image"] == images.images
    if arch == "qwen2_vl":
        assert images.num_tokens == [4, 12]
        size = prompt["mm_processor_kwargs"]["size"]
        assert size["shortest_edge"] == 28 * 28 and size["longest_edge"] == 28 * 28 * 16
    else:
        assert images.num_tokens == [4, 4] and "mm_processor_kwargs" not in prompt


def test_vllm_prompt_text_only_and_bad_inputs(tiny_vlm):
    proc = load_processor(tiny_vlm("qwen2_vl"))
    item = _dataset(proc)[0]
    assert va.vllm_prompt([1, 2, 3], None, 7) == {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match="media is a dict; pass the Media"):
        va.vllm_prompt(item["prompt_ids"], {"image": item["media"].image}, proc.image_token_id)
    with pytest.raises(ValueError, match="the model is not vision-language"):
        va.vllm_prompt(item["prompt_ids"], item["media"], None)
    with pytest.raises(ValueError, match="needs 4 consecutive image tokens"):
        collapse_placeholders([5, 9, 9, 5], 9, [4])
    with pytest.raises(ValueError, match="places 1 of its 2 images"):
        collapse_placeholders([5, 9, 5], 9, [1, 1])
    with pytest.raises(ValueError, match="more image tokens than its 1 images"):
        collapse_placeholders([9, 5, 9], 9, [1])


def test_vision_tokens_get_logit_bias_and_weight_names_include_the_tower(tiny_vlm):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_vlm("qwen2_5_vl"))
    kw = va.vllm_sampling_kwargs(SamplingParams(), suppress_token_ids=vision_token_ids(cfg))
    assert kw["logit_bias"] == {t: -100.0 for t in vision_token_ids(cfg)}
    assert "logit_bias" not in va.vllm_sampling_kwargs(SamplingParams())
    accepted, required = hf_weight_names(cfg)
    assert "model.visual.blocks.0.attn.qkv.weight" in required
    assert "model.language_model.layers.0.mlp.up_proj.weight" in required


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_VLLM), reason="needs CUDA and vllm==0.32.0"
)
def test_vllm_engine_vision_on_gpu(tmp_path):
    """Greedy equals the native engine's, log-probs equal the trainer path's, and a weight sync
    after a level-2 sleep (vision tower included) restores the same outputs."""
    from lightrft.engine import NativeEngine, sync_weights
    from lightrft.models.forward import causal_lm_token_logprobs
    from lightrft.models.multimodal import load_vision_model
    from lightrft.tasks import make_tiny_model

    # head_dim 64: a size every vLLM attention backend supports.
    path = make_tiny_model(tmp_path / "m", arch="qwen2_vl", hidden=256, heads=4, kv_heads=2)
    proc = load_processor(path)
    ds = _dataset(proc)
    reqs = [Request(ds[i]["prompt_ids"], ds[i]["media"]) for i in range(len(ds))]
    engine = va.VLLMEngine(
        path,
        dtype="float32",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        seed=0,
        limit_mm_per_prompt={"image": 2},
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

    engine.sleep(2)
    engine.wake_up()
    sync_weights(hf, engine)
    after = engine.generate(reqs, SamplingParams(temperature=0, max_tokens=8))
    assert [c.token_ids for c in after] == [c.token_ids for c in greedy]
