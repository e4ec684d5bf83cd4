"""Video in prompt and SFT datasets: PyAV decoding of real files written here, frame lists,
sampling, resizing, the temporal patch layout (checked against the HF image processor's), and
bad input failing at load with file, line and field."""

import json

import numpy as np
import pytest
import torch
from _video_helpers import moving_square, write_video
from _vision_helpers import square

from lightrft.data import DataError, PromptDataset, SFTDataset
from lightrft.data.media import MediaOptions
from lightrft.data.templates import IGNORE_INDEX
from lightrft.data.video import VideoOptions, sample_indices, video_patches
from lightrft.models.multimodal import load_processor


@pytest.fixture(scope="module")
def proc(tiny_vlm):
    return load_processor(tiny_vlm("qwen2_vl"))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _video_tokens(ids, proc):
    return sum(1 for t in ids if t == proc.video_token_id)


def test_patch_layout_equals_the_image_processors_for_a_still_video(proc):
    # An image is a video of one frame repeated over the temporal patch: the HF image
    # processor's patches of a frame must equal ours of the frame twice.
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)
    from PIL import Image

    ref = proc.image_processor([Image.fromarray(frame)], return_tensors="pt")
    ip = proc.image_processor
    x = torch.from_numpy(np.stack([frame, frame])).permute(0, 3, 1, 2).float() / 255
    mean = torch.tensor(ip.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(ip.image_std).view(1, 3, 1, 1)
    ours, grid = video_patches((x - mean) / std, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert list(grid) == ref["image_grid_thw"][0].tolist() == [1, 4, 6]
    torch.testing.assert_close(ours, ref["pixel_values"], atol=1e-5, rtol=0)
    # Three frames: padded with the last one to two temporal patches; the second group is
    # the third frame twice.
    three = torch.stack([x[0], x[0] * 0, x[0] * 0.5])
    p, grid = video_patches(three, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert grid == (2, 4, 6) and p.shape == (2 * 24, 3 * 2 * 14 * 14)
    second = p[24:].view(24, 3, 2, 14, 14)
    torch.testing.assert_close(second[:, :, 0], second[:, :, 1])


def test_sampling_by_fps_and_by_count():
    # 10 frames at 4 fps (2.5 s): 2 fps takes every other frame, from the first.
    assert sample_indices(10, 4.0, fps=2.0, num_frames=None) == ([0, 2, 4, 6, 8], 2.0)
    # Asking more than the video has takes every frame at its own rate.
    assert sample_indices(3, 4.0, fps=8.0, num_frames=None) == ([0, 1, 2], 4.0)
    # 4 frames spread over 10 (first and last kept): 4 frames in 2.5 s = 1.6 fps.
    assert sample_indices(10, 4.0, fps=None, num_frames=4) == ([0, 3, 6, 9], 1.6)
    assert sample_indices(1, 4.0, fps=None, num_frames=4) == ([0], 4.0)


def test_video_file_and_frame_list_load_sample_resize_and_expand(proc, tmp_path):
    write_video(tmp_path / "clip.mp4", moving_square(8, size=70), fps=4)
    frames = moving_square(3)
    from PIL import Image

    for k, f in enumerate(frames):
        Image.fromarray(f).save(tmp_path / f"f{k}.png")
    square((1, 2, 3)).save(tmp_path / "still.png")
    data = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "<video>which way?", "answer": "right", "videos": ["clip.mp4"]},
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "video", "video": ["f0.png", "f1.png", "f2.png"]},
                            {"type": "text", "text": "which way?"},
                        ],
                    }
                ],
                "answer": "left",
            },
            {"prompt": "<image>and this?", "answer": "x", "images": ["still.png"]},
        ],
    )
    ds = PromptDataset(proc, data, media=MediaOptions(video=VideoOptions(fps=2.0)))
    v = ds[0]["media"].video
    # 8 frames at 4 fps sampled at 2 fps: 4 frames, 70x70 -> 56x56 (multiples of 28): 2
    # temporal patches of 4x4 patches, 2 * 4 * 4 / 2**2 = 8 tokens.
    assert v.video_grid_thw.tolist() == [[2, 4, 4]] and v.num_tokens == [8]
    assert v.fps == [2.0] and v.videos[0].shape == (4, 56, 56, 3)
    assert v.second_per_grid_ts is None  # Qwen2-VL: no time positions
    assert v.pixel_values_videos.shape == (32, 3 * 2 * 14 * 14)
    assert _video_tokens(ds[0]["prompt_ids"], proc) == 8
    assert ds[0]["media"].image is None
    # A frame list: 3 frames at video_fps, padded to 2 temporal patches.
    v = ds[1]["media"].video
    assert v.video_grid_thw.tolist() == [[2, 4, 4]] and v.fps == [2.0]
    np.testing.assert_array_equal(v.videos[0], frames)
    # By count, grown to the minimum area: 84x84 (3x3 merged tokens a temporal patch).
    again = PromptDataset(
        proc, data, media=MediaOptions(video=VideoOptions(num_frames=8, min_pixels=84 * 84))
    )
    assert again[0]["media"].video.videos[0].shape == (8, 84, 84, 3)
    assert again[0]["media"].video.video_grid_thw.tolist() == [[4, 6, 6]]
    # The frames decoded from an mp4 are the sampled frames (a lossy codec: close, not equal).
    write_video(tmp_path / "still56.mp4", moving_square(8), fps=4)
    one = _jsonl(
        tmp_path / "one.jsonl", [{"prompt": "<video>q", "answer": "a", "videos": "still56.mp4"}]
    )
    got = PromptDataset(proc, one)[0]["media"].video.videos[0].astype(float)
    assert np.abs(got - moving_square(8)[::2]).mean() < 8
    assert ds[2]["media"].video is None and ds[2]["media"].image is not None
    assert ds.stats["video_clipped"] == 0


def test_qwen2_5_vl_gets_seconds_per_temporal_patch(tiny_vlm, tmp_path):
    proc = load_processor(tiny_vlm("qwen2_5_vl"))
    write_video(tmp_path / "v.mp4", moving_square(8), fps=8)
    data = _jsonl(tmp_path / "t.jsonl", [{"prompt": "<video>q", "answer": "a", "videos": "v.mp4"}])
    v = PromptDataset(proc, data, media=MediaOptions(video=VideoOptions(fps=4.0)))[0]["media"].video
    # 4 fps sampled: a temporal patch of 2 frames spans 0.5 s.
    assert v.fps == [4.0] and v.second_per_grid_ts.tolist() == [0.5]
    assert v.model_inputs()["second_per_grid_ts"].tolist() == [0.5]


def test_sft_sample_with_a_video_has_no_loss_on_video_tokens(proc, tmp_path):
    write_video(tmp_path / "v.mp4", moving_square(4), fps=2)
    data = _jsonl(
        tmp_path / "sft.jsonl",
        [{"prompt": "<video>which way?", "completion": "right", "videos": ["v.mp4"]}],
    )
    ds = SFTDataset(proc, data)
    item = ds[0]
    tok = proc.video_token_id
    video_at = item["input_ids"] == tok
    assert int(video_at.sum()) == sum(item["media"].video.num_tokens) == 8
    assert (item["labels"][video_at] == IGNORE_INDEX).all()
    assert ds.stats["videos"] == 1


def test_overlong_video_is_clipped_and_counted_or_refused(proc, tmp_path):
    write_video(tmp_path / "long.mp4", moving_square(12), fps=4)
    data = _jsonl(
        tmp_path / "t.jsonl", [{"prompt": "<video>q", "answer": "a", "videos": ["long.mp4"]}]
    )
    ds = PromptDataset(proc, data, media=MediaOptions(video=VideoOptions(fps=4.0, max_frames=5)))
    assert ds.stats["video_clipped"] == 1
    assert ds[0]["media"].video.video_grid_thw.tolist() == [[3, 4, 4]]  # 5 frames -> 3 groups
    with pytest.raises(
        DataError,
        match=r"t\.jsonl line 1: videos\[0\]: the video gives 12 frames at 4 fps, over "
        r"media\.video\.max_frames=5 \(media\.video\.overlong='refuse'\)",
    ):
        PromptDataset(
            proc,
            data,
            media=MediaOptions(video=VideoOptions(fps=4.0, max_frames=5, overlong="refuse")),
        )


@pytest.mark.parametrize(
    ("video", "match"),
    [
        ("missing.mp4", r"line 1: videos\[0\]: video file not found: .*missing\.mp4"),
        ("corrupt.mp4", r"line 1: videos\[0\]: cannot decode the video file .*corrupt\.mp4"),
        ("empty.avi", r"line 1: videos\[0\]: the video file .*empty\.avi has no frames"),
        ([], r"line 1: videos\[0\]: the video has no frames \(an empty frame list\)"),
        (["gone.png"], r"line 1: videos\[0\]\[0\]: image file not found"),
        (3, r"line 1: videos\[0\]: expected a video file path or a list of frame images"),
        (["thin.png"], r"line 1: videos\[0\]: cannot size a 600x2 frame \(absolute aspect ratio"),
    ],
)
def test_bad_videos_fail_at_load_naming_file_line_and_field(proc, tmp_path, video, match):
    from PIL import Image

    (tmp_path / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    Image.new("RGB", (600, 2)).save(tmp_path / "thin.png")  # sides 300 times apart
    write_video(tmp_path / "empty.avi", moving_square(0))
    data = _jsonl(
        tmp_path / "bad.jsonl",
        [{"prompt": "<video>q", "answer": "a", "videos": [video]}],
    )
    with pytest.raises(DataError, match=r"bad\.jsonl " + match):
        PromptDataset(proc, data)


def test_video_needs_a_qwen_vl_processor_and_matching_parts(tiny_vlm, proc, tmp_path):
    write_video(tmp_path / "v.mp4", moving_square(2), fps=2)
    rec = {"prompt": "<video>q", "answer": "a", "videos": ["v.mp4"]}
    data = _jsonl(tmp_path / "t.jsonl", [rec])
    llava = load_processor(tiny_vlm("llava"))
    with pytest.raises(DataError, match=r"t\.jsonl line 1: the record has videos, but the dataset"):
        PromptDataset(llava, data)
    with pytest.raises(ValueError, match="media.video options need a Qwen2-VL or Qwen2.5-VL"):
        PromptDataset(llava, data, media=MediaOptions(video=VideoOptions(fps=1.0)))
    parts = {"messages": [{"role": "user", "content": [{"type": "video"}]}], "answer": "a"}
    data = _jsonl(tmp_path / "p.jsonl", [parts])
    with pytest.raises(DataError, match=r"p\.jsonl line 1: field 'videos': 0 video\(s\) but"):
        PromptDataset(proc, data)
    with pytest.raises(
        ValueError, match="media.video.num_frames=8 is over media.video.max_frames=4"
    ):
        PromptDataset(
            proc, data, media=MediaOptions(video=VideoOptions(num_frames=8, max_frames=4))
        )


def test_conversation_puts_each_videos_sampled_frames_in_its_part(proc, tmp_path):
    from lightrft.data.prompts import conversation

    write_video(tmp_path / "v.mp4", moving_square(4), fps=4)
    data = _jsonl(tmp_path / "t.jsonl", [{"prompt": "<video>q", "answer": "a", "videos": "v.mp4"}])
    item = PromptDataset(proc, data, media=MediaOptions(video=VideoOptions(fps=2.0)))[0]
    (msg,) = conversation(item["messages"], item["media"])
    part = msg["content"][0]
    assert part["type"] == "video" and len(part["video"]) == 2  # 4 frames at 4 fps, 2 kept
    np.testing.assert_array_equal(np.asarray(part["video"][1]), item["media"].video.videos[0][1])
