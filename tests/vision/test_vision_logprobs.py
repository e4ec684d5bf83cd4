"""Multimodal per-token log-probs through the fused kernel equal a plain HF forward's."""

import pytest
import torch
from _vision_helpers import square

from lightrft.data import PromptDataset, SFTDataset, pack_or_pad_collator
from lightrft.models.forward import causal_lm_token_logprobs
from lightrft.models.multimodal import load_processor, load_vision_model


def _samples(proc):
    """Two prompt+completion samples with one and two images, and one text-only sample."""
    recs = [
        {"prompt": "<image>What colour?", "completion": "red", "images": [square((255, 0, 0))]},
        {
            "prompt": "<image> then <image>: same?",
            "completion": "no",
            "images": [square((0, 255, 0), (84, 56)), square((0, 0, 255), (40, 70))],
        },
        {"prompt": "No image here.", "completion": "ok"},
    ]
    return SFTDataset(proc, records=recs)


def _reference(model, item):
    """log_softmax of a plain HF forward of one sample (the model computes its positions)."""
    ids = item["input_ids"][None]
    kwargs = {}
    if "media" in item:
        kwargs = item["media"].image.model_inputs()
        if hasattr(model.model, "get_rope_index"):
            kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    logits = model(input_ids=ids, **kwargs).logits[0, :-1].float()  # [L-1, V]
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"])
@pytest.mark.parametrize("packing", [False, True])
def test_fused_logprobs_match_hf_forward(tiny_vlm, arch, packing):
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    ds = _samples(proc)
    items = [ds[i] for i in range(len(ds))]
    batch = pack_or_pad_collator(proc.tokenizer, packing)(items)
    ids = batch["input_ids"]
    with torch.no_grad():
        lp = causal_lm_token_logprobs(
            model,
            ids,
            attention_mask=batch.get("attention_mask"),
            position_ids=batch["position_ids"],
            media=batch["media"],
        )
    offset = 0
    for r, item in enumerate(items):
        n = len(item["input_ids"])
        ref = _reference(model, item)
        row, start = (0, offset) if packing else (r, 0)
        got = lp[row, start : start + n - 1]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        offset += n


def test_two_d_positions_would_break_mrope(tiny_vlm):
    """The pitfall the forward kwargs avoid: cumulative 2-D positions change Qwen-VL logits."""
    path = tiny_vlm("qwen2_vl")
    proc, model = load_processor(path), load_vision_model(path)
    item = _samples(proc)[0]
    ids = item["input_ids"][None]
    kw = {**item["media"].image.model_inputs(), "mm_token_type_ids": (ids == 0).int() + 0}
    kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        good = model(input_ids=ids, **kw).logits
        bad = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], **kw).logits
    assert (good - bad).abs().max() > 1e-4


def test_prompt_dataset_images_feed_the_same_forward(tiny_vlm):
    path = tiny_vlm("qwen2_vl")
    proc = load_processor(path)
    ds = PromptDataset(
        proc,
        records=[{"prompt": "<image>colour?", "answer": "red", "images": [square((255, 0, 0))]}],
    )
    item = ds[0]
    n_img = sum(1 for t in item["prompt_ids"] if t == proc.image_token_id)
    assert n_img == sum(item["media"].image.num_tokens) == 4
    assert item["media"].image.image_grid_thw.tolist() == [[1, 4, 4]]


def test_images_for_a_text_model_are_refused(tiny_vlm, tiny_model_dir):
    from lightrft.models import load_causal_lm

    item = _samples(load_processor(tiny_vlm("qwen2_vl")))[0]
    with pytest.raises(ValueError, match="is not a vision-language model"):
        causal_lm_token_logprobs(
            load_causal_lm(tiny_model_dir), item["input_ids"][None], media=item["media"]
        )
