"""Video through preference data and the RL-side reward models: a preference pair with a video
encodes as the SFT data does, trains through recipes/reward_model.py, and is scored in RL from
the rollout's conversation as in training (RewardModel, the vision judge); bad videos name the
file, line and field; behind the reward server (frames as PNG) the reward model and the judge
score a video conversation as in-process, and the server's frame and pixel bounds, malformed
video parts and missing auth are answered by name."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch
import yaml
from _video_helpers import moving_square, write_video

from lightrft.data import DataError, PromptDataset, SFTDataset, conversation
from lightrft.data.media import MediaOptions
from lightrft.data.preference import PreferenceCollator, PreferenceDataset
from lightrft.data.templates import IGNORE_INDEX
from lightrft.data.video import VideoOptions
from lightrft.models.multimodal import load_processor
from lightrft.rewards import Sample

QUESTION = "<video>Which way does the square move?"
# Not the defaults (2 fps): the options must reach the video reader. 56x56 frames stay 56x56.
VIDEO = {"media": MediaOptions(video=VideoOptions(fps=4.0, max_pixels=56 * 56))}


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
        proc,
        _write(tmp_path / "c.jsonl", _pairs(clips, 1)),
        media=MediaOptions(video=VideoOptions(fps=4.0, max_pixels=56 * 56, max_frames=4)),
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
    with pytest.raises(
        DataError, match=r"p\.jsonl line 1: the record has videos.*'videos'.*Qwen2-VL"
    ):
        PreferenceDataset(load_tokenizer(tiny_vlm("qwen2_vl")), path)
    with pytest.raises(DataError, match=r"line 1: field 'videos': videos need apply_chat_templ"):
        PreferenceDataset(load_processor(tiny_vlm("qwen2_vl")), path, apply_chat_template=False)
    with pytest.raises(DataError, match=r"line 1: the record has videos, but the dataset"):
        PreferenceDataset(load_processor(tiny_vlm("llava")), path)
    with pytest.raises(ValueError, match="media.video options need a Qwen2-VL or Qwen2.5-VL"):
        PreferenceDataset(
            load_processor(tiny_vlm("llava")), path, media=MediaOptions(video=VideoOptions(fps=4.0))
        )


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
        "dataset": {
            "_component_": "lightrft.data.PreferenceDataset",
            "path": data,
            "media": {"video": {"fps": 4.0, "max_pixels": 56 * 56}},
        },
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
    prompts = PromptDataset(
        proc, data, reference_required=False, media=MediaOptions(video=VideoOptions(fps=8.0))
    )
    assert prompts[0]["media"].video.video_grid_thw[0, 0] == 8  # 16 frames
    chats = [conversation(prompts[k]["messages"], prompts[k]["media"]) for k in range(2)]
    assert chats[0][0]["content"][0]["fps"] == 8.0
    rm = RewardModel(str(final), micro_batch_size=4, **VIDEO)
    texts = [prompts[k]["prompt"] for k in range(2)]
    got = rm(Sample.batch(texts * 2, ["right", "left", "left", "right"], conversations=chats * 2))
    with torch.no_grad():
        batch = PreferenceCollator(proc.tokenizer.pad_token_id)([pairs[0], pairs[1]])
        want = net(num_sequences=4, **{k: batch[k] for k in _FORWARD_KEYS if k in batch})
    # The batch's order: pair 0 (the right-moving clip) "right", "left"; pair 1 (left) "left",
    # "right"; the samples': (right, "right"), (left, "left"), (right, "left"), (left, "right").
    torch.testing.assert_close(got, want[[0, 2, 1, 3], 0], atol=1e-5, rtol=1e-5)
    # Same question, same answer, another video: another score.
    swapped = rm(Sample.batch(texts, ["right", "right"], conversations=chats))
    assert swapped[0] != swapped[1]
    # The reward model reads the videos as its options say: the defaults (2 fps) differ.
    default = RewardModel(str(final))(Sample.batch(texts, ["right"] * 2, conversations=chats))
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
    prompts = PromptDataset(
        proc,
        records=records,
        reference_required=False,
        media=MediaOptions(video=VideoOptions(fps=8.0)),
    )
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
    out = judge(
        Sample.batch(
            [p["prompt"] for p in (prompts[0], prompts[1])], ["right"] * 2, conversations=chats
        )
    )
    assert out.shape == (2,) and len(judge.last_verdicts) == 2
    with pytest.raises(
        ValueError,
        match="media.video options need a Qwen2-VL or Qwen2.5-VL model.s processor \\(a remote judge",
    ):
        GenerativeReward(
            url="http://127.0.0.1:1/v1/completions",
            fallback=0.0,
            media=MediaOptions(video=VideoOptions(fps=4)),
        )


def _served(reward_fn, **kwargs):
    """A reference reward server for ``reward_fn`` on 127.0.0.1, serving; and its URL."""
    from lightrft.rewards.server import make_server

    server = make_server(reward_fn, **kwargs)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score"


def _stop(server) -> None:
    server.shutdown()
    server.server_close()


def _video_chats(vl_dir, clips, tmp_path):
    """Prompt texts and conversations of two video prompts (right, left), sampled at 8 fps
    (every frame) as a GRPO run hands them to its rewards."""
    records = [{"prompt": QUESTION, "videos": [str(tmp_path / c)]} for c in clips]
    prompts = PromptDataset(
        load_processor(vl_dir),
        records=records,
        reference_required=False,
        media=MediaOptions(video=VideoOptions(fps=8.0)),
    )
    items = [prompts[k] for k in range(2)]
    return [it["prompt"] for it in items], [
        conversation(it["messages"], it["media"]) for it in items
    ]


def test_video_frames_cross_the_wire_frame_for_frame(tiny_vlm, clips, tmp_path):
    from lightrft.rewards.remote import wire_conversation
    from lightrft.rewards.server import decode_conversations

    _, chats = _video_chats(str(tiny_vlm("qwen2_vl")), clips, tmp_path)
    wire = json.loads(json.dumps([wire_conversation(c, i) for i, c in enumerate(chats)]))
    part = wire[0][0]["content"][0]
    assert sorted(part) == ["fps", "type", "video"] and part["fps"] == 8.0
    assert len(part["video"]) == 16
    assert all(f.startswith("data:image/png;base64,") for f in part["video"])
    back = decode_conversations(wire, 2)
    for sent, got in zip(chats, back, strict=True):
        a, b = sent[0]["content"][0], got[0]["content"][0]
        assert b["type"] == "video" and b["fps"] == a["fps"] == 8.0
        assert len(b["video"]) == len(a["video"]) == 16
        for x, y in zip(a["video"], b["video"], strict=True):
            assert y.mode == "RGB" and x.size == y.size and x.tobytes() == y.tobytes()
        assert got[0]["content"][1] == sent[0]["content"][1]  # the question's text part
    # A part without a rate travels without one (the reward model takes its own media.video.fps).
    no_rate = [{"role": "user", "content": [{**chats[0][0]["content"][0], "fps": None}]}]
    assert "fps" not in wire_conversation(no_rate, 0)[0]["content"][0]
    assert "fps" not in decode_conversations([wire_conversation(no_rate, 0)], 1)[0][0]["content"][0]
    # A video given as a file path, or without frames, is refused by the client, naming it.
    for bad in ("clip.mp4", []):
        chat = [{"role": "user", "content": [{"type": "video", "video": bad}]}]
        with pytest.raises(
            ValueError,
            match=r"conversations\[2\]\[0\]\.content\[0\]: a video part "
            r"must hold its sampled frames",
        ):
            wire_conversation(chat, 2)
    chat = [{"role": "user", "content": [{"type": "video", "video": [a["video"][0], "x.png"]}]}]
    with pytest.raises(
        ValueError, match=r"content\[0\]\.video\[1\]: a video frame must hold a PIL"
    ):
        wire_conversation(chat, 0)
    chat = [{"role": "user", "content": [{"type": "video", "video": a["video"], "fps": 0}]}]
    with pytest.raises(ValueError, match=r"content\[0\]: a video part's fps must be a positive"):
        wire_conversation(chat, 0)
    # Audio is still not carried.
    chat = [{"role": "user", "content": [{"type": "audio", "audio": {"array": [0.0]}}]}]
    with pytest.raises(ValueError, match=r"an audio part cannot be sent to a reward server"):
        wire_conversation(chat, 0)


def test_a_video_reward_model_and_judge_behind_the_server_score_as_in_process(
    tiny_vlm, clips, tmp_path
):
    from _vision_helpers import likelihood_reward_model

    from lightrft.rewards import GenerativeReward, RemoteReward, RewardModel

    vl = str(tiny_vlm("qwen2_vl"))
    texts, chats = _video_chats(vl, clips, tmp_path)
    responses = ["right", "left", "left", "right"]
    rm_path = likelihood_reward_model(tiny_vlm("qwen2_vl"), tmp_path / "rm")
    template = "{prompt}\nAnswer: {response}\nScore:"
    judge_kwargs = dict(judge=vl, template=template, fallback=-1.0, max_tokens=3, **VIDEO)
    seen = {}

    def spied(judge):
        """``judge`` keeping the engine requests it builds in ``seen[judge]``."""
        build = judge.media_requests
        seen[judge] = []

        def media_requests(*args, **kwargs):
            requests = build(*args, **kwargs)
            seen[judge].extend(requests)
            return requests

        judge.media_requests = media_requests
        return judge

    for local, served in [
        (RewardModel(rm_path, **VIDEO), RewardModel(rm_path, **VIDEO)),
        (spied(GenerativeReward(**judge_kwargs)), spied(GenerativeReward(**judge_kwargs))),
    ]:
        server, url = _served(served, token="s3cret", max_video_frames=32)
        try:
            want = torch.as_tensor(
                local(Sample.batch(texts * 2, responses, conversations=chats * 2))
            )
            # 4 videos of 16 frames: two requests of 32 frames (the server's bound).
            got = RemoteReward(url, token="s3cret", max_retries=0, batch_size=2)(
                Sample.batch(texts * 2, responses, conversations=chats * 2)
            )
            torch.testing.assert_close(torch.tensor(got), want.float(), atol=1e-6, rtol=0)
            if isinstance(local, GenerativeReward):
                # The served judge's engine requests are the local judge's: the same prompt ids
                # and the same video patches, sample for sample (and so the same verdicts).
                assert served.last_verdicts == local.last_verdicts[2:]
                assert len(seen[served]) == len(seen[local]) == 4
                for a, b in zip(seen[local], seen[served], strict=True):
                    assert a.prompt_token_ids == b.prompt_token_ids
                    assert torch.equal(
                        a.media.video.pixel_values_videos, b.media.video.pixel_values_videos
                    )
                    assert a.media.video.video_grid_thw.tolist() == [[4, 4, 4]]
                    assert torch.equal(a.media.video.video_grid_thw, b.media.video.video_grid_thw)
                assert not torch.equal(
                    seen[local][0].media.video.pixel_values_videos,
                    seen[local][1].media.video.pixel_values_videos,
                )
            else:  # the video reaches the served model: same answer, another clip, another score
                assert got[0] != got[3] and got[1] != got[2]
        finally:
            _stop(server)


class _Recorder:
    """A reward function that keeps the conversations it is given."""

    uses_conversations = True

    def __init__(self):
        self.calls = []

    def __call__(self, samples):
        responses = [s.response for s in samples]
        conversations = [s.conversation for s in samples]
        self.calls.append(conversations)
        return [float(len(r)) for r in responses]


def _video(frames, fps=4.0):
    from lightrft.rewards.remote import wire_conversation

    part = {"type": "video", "video": frames, "fps": fps}
    return wire_conversation(
        [{"role": "user", "content": [{"type": "text", "text": "q"}, part]}], 0
    )


def test_the_reward_servers_video_bounds_and_malformed_parts_are_answered_by_name(capsys):
    from PIL import Image

    from lightrft.rewards import RemoteReward
    from lightrft.rewards.server import main

    frame = Image.new("RGB", (28, 28), (9, 99, 199))
    wide = Image.new("RGB", (56, 28), (9, 99, 199))
    fn = _Recorder()
    # 784-pixel frames; at most 2 frames' worth of pixels per image, 10 per request, 8 frames.
    server, url = _served(
        fn,
        token="s3cret",
        max_image_pixels=2 * 784,
        max_request_pixels=10 * 784,
        max_video_frames=8,
    )

    def post(chats, token="s3cret"):
        body = {"responses": ["r"] * len(chats), "conversations": chats}
        req = urllib.request.Request(
            url, json.dumps(body).encode(), {"Authorization": f"Bearer {token}"}
        )
        try:
            urllib.request.urlopen(req, timeout=10)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]
        return 200, ""

    def with_part(**fields):
        return [
            {
                "role": "user",
                "content": [{"type": "text", "text": "q"}, {"type": "video", **fields}],
            }
        ]

    try:
        ok = _video([frame] * 3)
        # Frames over the request's bound: 9 frames in one video, or 5 + 5 in two.
        code, err = post([_video([frame] * 9)])
        assert code == 413, err
        assert "'conversations'[0][0].content[1]: a video of 9 frames" in err
        assert "limit of 8 video frames per request (--max-video-frames)" in err
        code, err = post([_video([frame] * 5), _video([frame] * 5)])
        assert code == 413 and "'conversations'[1][0].content[1]: a video of 5 frames" in err
        # A frame is an image: over the per-image bound, and counted against the request's.
        big = Image.new("RGB", (56, 56))
        code, err = post([_video([frame, big])])
        assert code == 413, err
        assert "'conversations'[0][0].content[1].video[1]: frame of 56x56 = 3136 pixels" in err
        assert "limit of 1568 pixels per image (--max-image-pixels)" in err
        code, err = post([_video([wide] * 4), _video([wide] * 2)])  # 6 frames, 12 frames' pixels
        assert code == 413, err
        assert "'conversations'[1][0].content[1].video[1]: the request's images and video " in err
        assert "limit of 7840 pixels per request (--max-request-pixels)" in err
        # Malformed parts: 400, naming the entry.
        url0 = ok[0]["content"][1]["video"][0]
        for fields, want in [
            ({"video": url0}, "content[1].video must be a list of frames (PNG data URLs), got str"),
            ({"video": []}, "content[1].video has no frames"),
            ({"video": [url0], "fps": 0}, "content[1].fps must be a positive number"),
            ({"video": [url0], "fps": "4"}, "content[1].fps must be a positive number"),
            ({"video": [url0], "fps": True}, "content[1].fps must be a positive number"),
            ({"video": [url0], "fps": float("nan")}, "content[1].fps must be a positive number"),
            # a 401-digit integer overflows a float: before, OverflowError dropped the connection
            ({"video": [url0], "fps": 10**400}, "content[1].fps must be a positive number"),
            ({"video": [url0, "x.png"]}, "content[1].video[1]: a frame must be a string starting"),
            (
                {"video": [url0, "data:image/png;base64,AAAA"]},
                "content[1].video[1]: not a PNG image",
            ),
            (
                {"video": [url0, _video([wide])[0]["content"][1]["video"][0]]},
                "content[1].video[1]: frame of 56x28 differs in size from the video's first frame (28x28)",
            ),
        ]:
            code, err = post([with_part(**fields)])
            assert code == 400 and "'conversations'[0][0]." + want in err, (fields, err)
        code, err = post([[{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}]])
        assert code == 400 and "an audio part is not carried by the reward server" in err
        assert post([ok], token="wrong")[0] == 401
        assert fn.calls == []  # none of them reached the reward function
        # A good client is served afterwards, the function getting the frames as in-process.
        got = RemoteReward(url, token="s3cret", max_retries=0)(
            Sample.batch(
                ["q", "q"],
                ["ab", "abc"],
                conversations=[
                    [
                        {
                            "role": "user",
                            "content": [{"type": "video", "video": [frame] * 4, "fps": 2.0}],
                        }
                    ],
                    None,
                ],
            )
        )
        assert got == [2.0, 3.0]
        (chats,) = fn.calls
        part = chats[0][0]["content"][0]
        assert chats[1] is None and part["fps"] == 2.0 and len(part["video"]) == 4
        assert all(f.tobytes() == frame.tobytes() for f in part["video"])
    finally:
        _stop(server)
    with pytest.raises(ValueError, match="max_video_frames must be >= 1"):
        _served(fn, max_video_frames=0)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--max-video-frames" in capsys.readouterr().out
