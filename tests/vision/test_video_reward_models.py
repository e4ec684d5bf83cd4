"""Video through preference data and the RL-side reward models: a preference pair with a video
encodes as the SFT data does, trains through recipes/reward_model.py, and is scored in RL from
the rollout's conversation as in training (RewardModel, the vision judge); bad videos name the
file, line and field; the reward server refuses video parts by name."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from _video_helpers import moving_square, write_video

from lightrft.data import DataError, PromptDataset, SFTDataset, conversation
from lightrft.data.preference import PreferenceCollator, PreferenceDataset
from lightrft.data.templates import IGNORE_INDEX
from lightrft.models.multimodal import load_processor

QUESTION = "<video>Which way does the square move?"
# Not the defaults (2 fps): the options must reach the video reader. 56x56 frames stay 56x56.
VIDEO = {"video_fps": 4.0, "video_max_pixels": 56 * 56}


@pytest.fixture
def clips(tmp_path):
    """Two 2-second mp4 clips at 8 fps (16 frames of 56x56): a square moving right, and left."""
    write_video(tmp_path / "right.mp4", moving_square(16, step=2), fps=8)
    write_video(tmp_path / "left.mp4", moving_square(16, step=2, direction=-1), fps=8)
    return ["right.mp4", "left.mp4"]


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _pairs(clips, n: int = 2, rejected: str | None = None) -> list[dict]:
    names = ["right", "left"]
    return [
        {
            "prompt": QUESTION,
            "videos": [clips[k % 2]],
            "chosen": names[k % 2],
            "rejected": rejected or names[1 - k % 2],
        }
        for k in range(n)
    ]


def test_a_preference_pair_with_a_video_encodes_as_the_sft_samples(tiny_vlm, clips, tmp_path):
    proc = load_processor(tiny_vlm("qwen2_vl"))
    pairs = PreferenceDataset(proc, _write(tmp_path / "p.jsonl", _pairs(clips, 1)), **VIDEO)
    sft_records = [
        {"prompt": QUESTION, "videos": [clips[0]], "completion": answer}
        for answer in ("right", "left")
    ]
    sft = SFTDataset(proc, _write(tmp_path / "s.jsonl", sft_records), **VIDEO)
    item = pairs[0]
    for k in range(2):  # chosen, rejected
        want = sft[k]
        assert torch.equal(item["sequences"][k], want["input_ids"])
        # The response starts at the SFT sample's first loss token.
        assert item["starts"][k] == int((want["labels"] != IGNORE_INDEX).nonzero()[0])
        got_v, want_v = item["media"].video, want["media"].video
        assert torch.equal(got_v.pixel_values_videos, want_v.pixel_values_videos)
        assert torch.equal(got_v.video_grid_thw, want_v.video_grid_thw)
    # 16 frames at 8 fps sampled at 4 fps: 8 frames, 4 temporal patches of 2x2 merged tokens.
    video = item["media"].video
    assert video.video_grid_thw.tolist() == [[4, 4, 4]] and video.fps == [4.0]
    n_video = sum(video.num_tokens)
    assert item["sequences"][0].tolist().count(proc.video_token_id) == n_video == 16
    assert pairs.stats["videos"] == 1 and pairs.stats["video_clipped"] == 0
    # The defaults sample 2 fps: half the frames.
    default = PreferenceDataset(proc, _write(tmp_path / "d.jsonl", _pairs(clips, 1)))
    assert default[0]["media"].video.video_grid_thw[0, 0] == 2
    # The collator gives each candidate the item's video, in sequence order.
    batch = PreferenceCollator(proc.tokenizer.pad_token_id)([pairs[0], pairs[0]])
    assert batch["media"].video.num_tokens == [n_video] * 4
    clipped = PreferenceDataset(
        proc, _write(tmp_path / "c.jsonl", _pairs(clips, 1)), **VIDEO, max_video_frames=4
    )
    assert clipped.stats["video_clipped"] == 1
    assert clipped[0]["media"].video.video_grid_thw.tolist() == [[2, 4, 4]]


@pytest.mark.parametrize(
    ("video", "match"),
    [
        ("missing.mp4", r"p\.jsonl line 2: videos\[0\]: video file not found: .*missing\.mp4"),
        ("bad.mp4", r"p\.jsonl line 2: videos\[0\]: cannot decode the video file .*bad\.mp4"),
        (["gone.png"], r"p\.jsonl line 2: videos\[0\]\[0\]: image file not found"),
    ],
)
def test_a_bad_video_in_a_preference_record_names_file_line_and_field(
    tiny_vlm, clips, tmp_path, video, match
):
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    records = _pairs(clips, 2)
    records[1]["videos"] = [video]
    path = _write(tmp_path / "p.jsonl", records)
    with pytest.raises(DataError, match=match):
        PreferenceDataset(load_processor(tiny_vlm("qwen2_vl")), path, **VIDEO)


def test_videos_need_a_qwen_vl_processor_and_the_chat_template(tiny_vlm, clips, tmp_path):
    from lightrft.models import load_tokenizer

    path = _write(tmp_path / "p.jsonl", _pairs(clips, 1))
    with pytest.raises(DataError, match=r"p\.jsonl line 1: .*'videos' holds videos.*Qwen2-VL"):
        PreferenceDataset(load_tokenizer(tiny_vlm("qwen2_vl")), path)
    with pytest.raises(DataError, match=r"line 1: field 'videos': videos need apply_chat_templ"):
        PreferenceDataset(load_processor(tiny_vlm("qwen2_vl")), path, apply_chat_template=False)
    with pytest.raises(DataError, match=r"line 1: the record has videos, but the dataset"):
        PreferenceDataset(load_processor(tiny_vlm("llava")), path)
    with pytest.raises(ValueError, match="video options .* need a Qwen2-VL or Qwen2.5-VL"):
        PreferenceDataset(load_processor(tiny_vlm("llava")), path, video_fps=4.0)


_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "segment_ids", "scored", "media")


def test_reward_model_recipe_trains_on_video_pairs_and_rl_scores_them_as_trained(
    tiny_vlm, clips, tmp_path
):
    from lightrft import cli
    from lightrft.models.reward import load_reward_net
    from lightrft.rewards import RewardModel

    data = _write(tmp_path / "train.jsonl", _pairs(clips, 4))
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "device": "cpu",
        "model": {"path": str(tiny_vlm("qwen2_vl")), "pooling": "likelihood"},
        "dataset": {"_component_": "lightrft.data.PreferenceDataset", "path": data, **VIDEO},
        "batch_size": 2,
        "epochs": 1,
        "max_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "metrics": {"tensorboard": False},
    }
    (tmp_path / "rm.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["run", "reward_model", "--config", str(tmp_path / "rm.yaml")]) == 0
    final = tmp_path / "out" / "final"
    net = load_reward_net(final).eval()
    proc = load_processor(final)
    pairs = PreferenceDataset(proc, data, **VIDEO)
    # The rollout's prompts sampled faster (8 fps, every frame) than the reward model's data:
    # each conversation's video part carries its rate, and the reward model re-samples it at
    # its own 4 fps, as its preference data sampled the file.
    prompts = PromptDataset(proc, data, reference_required=False, video_fps=8.0)
    assert prompts[0]["media"].video.video_grid_thw[0, 0] == 8  # 16 frames
    chats = [conversation(prompts[k]["messages"], prompts[k]["media"]) for k in range(2)]
    assert chats[0][0]["content"][0]["fps"] == 8.0
    rm = RewardModel(str(final), micro_batch_size=4, **VIDEO)
    texts = [prompts[k]["prompt"] for k in range(2)]
    got = rm(texts * 2, ["right", "left", "left", "right"], conversations=chats * 2)
    with torch.no_grad():
        batch = PreferenceCollator(proc.tokenizer.pad_token_id)([pairs[0], pairs[1]])
        want = net(num_sequences=4, **{k: batch[k] for k in _FORWARD_KEYS if k in batch})
    # The batch's order: pair 0 (the right-moving clip) "right", "left"; pair 1 (left) "left",
    # "right"; the samples': (right, "right"), (left, "left"), (right, "left"), (left, "right").
    torch.testing.assert_close(got, want[[0, 2, 1, 3], 0], atol=1e-5, rtol=1e-5)
    # Same question, same answer, another video: another score.
    swapped = rm(texts, ["right", "right"], conversations=chats)
    assert swapped[0] != swapped[1]
    # The reward model reads the videos as its options say: the defaults (2 fps) differ.
    default = RewardModel(str(final))(texts, ["right"] * 2, conversations=chats)
    assert not torch.allclose(default, swapped)


def test_a_video_judge_sees_the_conversations_video(tiny_vlm, clips, tmp_path):
    """The vision judge's request for a conversation with a video equals what the prompt
    dataset builds from the judgment record ``"<video>" + filled template`` with the judge's
    video options: the same ids and the same video patches."""
    from lightrft.rewards import GenerativeReward
    from lightrft.rewards.generative import media_parts

    vl = str(tiny_vlm("qwen2_vl"))
    proc = load_processor(vl)
    template = "{prompt}\nAnswer: {response}\nScore:"
    judge = GenerativeReward(judge=vl, template=template, fallback=0.0, max_tokens=2, **VIDEO)
    records = [{"prompt": QUESTION, "videos": [str(tmp_path / c)]} for c in clips]
    prompts = PromptDataset(proc, records=records, reference_required=False, video_fps=8.0)
    chats = [conversation(prompts[k]["messages"], prompts[k]["media"]) for k in range(2)]
    text = template.format(prompt=QUESTION.replace("<video>", ""), response="right")
    (req,) = judge.media_requests([text], [media_parts(chats[0])])
    record = {"prompt": "<video>" + text, "videos": [str(tmp_path / clips[0])]}
    want = PromptDataset(proc, records=[record], reference_required=False, **VIDEO)[0]
    assert req.prompt_token_ids == want["prompt_ids"]
    got_v, want_v = req.media.video, want["media"].video
    assert torch.equal(got_v.pixel_values_videos, want_v.pixel_values_videos)
    assert got_v.video_grid_thw.tolist() == want_v.video_grid_thw.tolist() == [[4, 4, 4]]
    # The engine judges the requests with their videos (one verdict a sample).
    out = judge([p["prompt"] for p in (prompts[0], prompts[1])], ["right"] * 2, conversations=chats)
    assert out.shape == (2,) and len(judge.last_verdicts) == 2
    with pytest.raises(ValueError, match="video options apply to a local vision-language judge"):
        GenerativeReward(url="http://127.0.0.1:1/v1/completions", fallback=0.0, video_fps=4)


def test_the_reward_server_refuses_video_parts_by_name(tiny_vlm, clips, tmp_path):
    from lightrft.rewards.remote import wire_conversation
    from lightrft.rewards.server import decode_conversations

    proc = load_processor(tiny_vlm("qwen2_vl"))
    ds = PromptDataset(
        proc, _write(tmp_path / "p.jsonl", _pairs(clips, 1)), reference_required=False
    )
    chat = conversation(ds[0]["messages"], ds[0]["media"])
    with pytest.raises(
        ValueError,
        match=r"conversations\[3\]\[0\]\.content\[0\]: a video part cannot be sent to a reward "
        r"server \(the protocol carries images only\): score video prompts in-process",
    ):
        wire_conversation(chat, 3)
    wire = [{"role": "user", "content": [{"type": "video", "video": ["data:image/png;base64,"]}]}]
    with pytest.raises(
        ValueError,
        match=r"'conversations'\[0\]\[0\]\.content\[0\]: a video part is not carried by the "
        r"reward server \(images only\)",
    ):
        decode_conversations([wire], 1)
