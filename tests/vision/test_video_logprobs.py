"""Per-token log-probs of samples with videos (and images beside them) through the media
container, the collate and the fused-kernel funnel equal a plain HF forward's, padded and
packed, for tiny Qwen2-VL and Qwen2.5-VL."""

import pytest
import torch
from _video_helpers import moving_square, write_video
from _vision_helpers import square
from PIL import Image

from lightrft.data import SFTDataset, pack_or_pad_collator
from lightrft.data.media import MediaOptions
from lightrft.data.video import VideoOptions
from lightrft.models.forward import causal_lm_token_logprobs
from lightrft.models.multimodal import load_processor, load_vision_model


def _frames(n, direction):
    return [Image.fromarray(f) for f in moving_square(n, direction=direction)]


def _samples(proc, tmp_path):
    """A video file, a frame list beside an image (image first), a video before an image, and
    a text-only sample."""
    clip = write_video(tmp_path / "clip.mp4", moving_square(6, size=70), fps=4)
    recs = [
        {"prompt": "<video>Which way?", "completion": "right", "videos": [str(clip)]},
        {
            "prompt": "<image> and <video>: same?",
            "completion": "no",
            "images": [square((0, 255, 0), (84, 56))],
            "videos": [_frames(3, -1)],
        },
        {
            "prompt": "<video> then <image>",
            "completion": "ok",
            "images": [square((0, 0, 255))],
            "videos": [_frames(4, 1)],
        },
        {"prompt": "No video here.", "completion": "fine"},
    ]
    return SFTDataset(
        proc, records=recs, media=MediaOptions(video=VideoOptions(fps=4.0))
    )  # 0.5 s per temporal patch


def _reference(model, item, time_scale=1.0):
    """log_softmax of a plain HF forward of one sample (the model computes its positions)."""
    ids = item["input_ids"][None]
    kwargs = {}
    media = item.get("media")
    if media is not None:
        if media.image is not None:
            kwargs.update(media.image.model_inputs())
        if media.video is not None:
            v = media.video
            kwargs.update(
                pixel_values_videos=v.pixel_values_videos, video_grid_thw=v.video_grid_thw
            )
            if v.second_per_grid_ts is not None:
                kwargs["second_per_grid_ts"] = v.second_per_grid_ts * time_scale
        cfg = model.config
        kwargs["mm_token_type_ids"] = (ids == cfg.image_token_id).int() + 2 * (
            ids == cfg.video_token_id
        ).int()
    logits = model(input_ids=ids, **kwargs).logits[0, :-1].float()  # [L-1, V]
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("packing", [False, True])
def test_video_logprobs_match_hf_forward(tiny_vlm, tmp_path, arch, packing):
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    ds = _samples(proc, tmp_path)
    items = [ds[i] for i in range(len(ds))]
    assert [len(it["media"].video) if "media" in it else 0 for it in items] == [1, 1, 1, 0]
    batch = pack_or_pad_collator(proc.tokenizer, packing)(items)
    assert batch["media"].video.video_grid_thw.shape == (3, 3)
    with torch.no_grad():
        lp = causal_lm_token_logprobs(
            model,
            batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch["position_ids"],
            media=batch["media"],
        )
        offset = 0
        for r, item in enumerate(items):
            n = len(item["input_ids"])
            ref = _reference(model, item)
            row, start = (0, offset) if packing else (r, 0)
            torch.testing.assert_close(lp[row, start : start + n - 1], ref, atol=1e-5, rtol=0)
            offset += n
        if arch == "qwen2_5_vl":
            # The seconds per temporal patch reach the time positions: with others the
            # reference differs.
            other = _reference(model, items[0], time_scale=3.0)
            assert (other - _reference(model, items[0])).abs().max() > 1e-5


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_a_still_video_scores_as_its_image(tiny_vlm, arch):
    # The video path's diagnosis (docs/vision.md, "Video"): an image given as a frame list of
    # itself twice (one temporal patch) must give the image's log-probs after the media tokens
    # (same patches, same M-RoPE positions), so a model trained on either learns the same; a
    # second frame that differs changes them.
    path = tiny_vlm(arch)
    proc, model = load_processor(path), load_vision_model(path)
    board, other = square((255, 0, 0), (84, 84)), square((0, 0, 255), (84, 84))
    recs = [
        {"prompt": "<image>How many?", "completion": "3", "images": [board]},
        {"prompt": "<video>How many?", "completion": "3", "videos": [[board, board]]},
        {"prompt": "<video>How many?", "completion": "3", "videos": [[board, other]]},
    ]
    ds = SFTDataset(proc, records=recs, media=MediaOptions(video=VideoOptions(fps=2.0)))
    items = [ds[i] for i in range(3)]
    assert items[0]["media"].video is None and items[1]["media"].image is None
    assert len({len(it["input_ids"]) for it in items}) == 1
    ids = items[1]["input_ids"].tolist()
    after = max(i for i, t in enumerate(ids) if t == proc.video_token_id)
    with torch.no_grad():
        lp = []
        for item in items:
            batch = pack_or_pad_collator(proc.tokenizer, False)([item])
            lp.append(
                causal_lm_token_logprobs(
                    model,
                    batch["input_ids"],
                    attention_mask=batch.get("attention_mask"),
                    position_ids=batch["position_ids"],
                    media=batch["media"],
                )[0, after:]
            )
    torch.testing.assert_close(lp[1], lp[0], atol=1e-6, rtol=0)
    assert (lp[2] - lp[0]).abs().max() > 1e-4
