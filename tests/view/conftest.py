"""A run directory as GRPO writes it, made by hand: metrics, three steps of trajectories with
per-token detail (single-turn groups, a dropped sample, a multi-turn sample with a tool call)
and a dataset record with an image and an audio file. Small enough for a fast page."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

PROMPTS = ["1+2=", "3+4="]


def _tokens(text: str, kept: bool, advantage: float, base: float) -> dict:
    n = len(text)
    return {
        "text": list(text),
        "engine_logprob": [-0.5 - 0.1 * i for i in range(n)],
        "logprob": [-0.5 - 0.1 * i + base for i in range(n)] if kept else None,
        "entropy": [0.2 * (i + 1) for i in range(n)] if kept else None,
        "advantage": [advantage] * n if kept else None,
    }


def _line(step: int, prompt: str, where: str, response: str, reward: float, kept: bool) -> dict:
    advantage = (reward - 0.5) * 2 if kept else None
    return {
        "step": step,
        "prompt": prompt,
        "where": where,
        "response": response,
        "reference": "3",
        "label": "arith",
        "reward": reward,
        "reward_parts": {"accuracy": reward},
        "overlong_penalty": None,
        "advantage": advantage,
        "response_length": len(response),
        "finish_reason": "stop",
        "kept": kept,
        "tokens": _tokens(response, kept, advantage or 0.0, 0.01 * step),
    }


def _multi_turn(step: int, where: str) -> dict:
    call, obs, answer = "<tool_call>1+2</tool_call>", "<tool>3</tool>", "It is 3"
    ids = list(range(len(call) + len(obs) + len(answer)))
    mask = [True] * len(call) + [False] * len(obs) + [True] * len(answer)
    rec = _line(step, "What is 1+2?", where, answer, 1.0, True)
    rec["response_length"] = len(ids)
    rec["tokens"] = _tokens(call + obs + answer, True, 1.0, 0.0)
    rec["response_ids"] = ids
    rec["sampled_mask"] = mask
    rec["episode"] = {
        "messages": [{"role": "user", "content": "What is 1+2?"}],
        "turns": [
            {
                "token_ids": ids[: len(call)],
                "text": call,
                "observation": [{"role": "tool", "name": "calculator", "content": "3"}],
                "observation_ids": ids[len(call) : len(call) + len(obs)],
                "observation_dropped": False,
                "reward": 0.0,
                "tool_calls": 1,
                "errors": {},
            },
            {
                "token_ids": ids[len(call) + len(obs) :],
                "text": answer,
                "observation": [],
                "observation_ids": [],
                "observation_dropped": False,
                "reward": 0.0,
                "tool_calls": 0,
                "errors": {},
            },
        ],
        "final_text": answer,
        "stats": {"turns": 2, "tool_calls": 1, "errors": {}, "reward": 0.0, "truncated": False},
    }
    return rec


@pytest.fixture
def fake_run(tmp_path: Path) -> Path:
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(data / "red.png")
    (data / "tone.wav").write_bytes(b"RIFF....WAVEfmt ")  # bytes only: embedded, not decoded
    records = [
        {"prompt": PROMPTS[0], "answer": "3", "images": ["red.png"], "audios": "tone.wav"},
        {"prompt": PROMPTS[1], "answer": "7", "images": ["gone.png"]},
    ]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    where = [f"{data / 'train.jsonl'} line {i + 1}" for i in range(2)]

    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    rows = []
    for step in (1, 2, 3):
        lines = []
        # step 1 and 3 hold prompt 0 (a later epoch), step 2 prompt 1; 4 samples each
        p = 0 if step != 2 else 1
        for k in range(4):
            reward = 1.0 if k < step % 3 + 1 else 0.0
            lines.append(_line(step, PROMPTS[p], where[p], "3" * (k + 1), reward, kept=k != 3))
        lines.append(_multi_turn(step, where[p]))
        (run / "trajectories" / f"step_{step:06d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in lines)
        )
        rows.append(
            {
                "step": step,
                "reward/total/mean": sum(r["reward"] for r in lines) / len(lines),
                "reward/accuracy/mean": 0.5,
                "train/kl": 0.01 * step,
                "train/entropy": 1.0 - 0.1 * step,
                "train/clip_frac": math.nan if step == 2 else 0.1,
                "rollout/response_length/mean": 2.0 + step,
            }
        )
    rows.insert(0, {"step": 0, "eval/accuracy": 0.25, "eval/reward": 0.3})
    rows.append({"step": 3, "eval/accuracy": 0.75, "eval/reward": 0.8})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(text + '{"step": 4, "reward/to')  # a torn last line
    return run


@pytest.fixture
def video_helpers():
    """tests/vision/_video_helpers.py (moving squares, PyAV encoding), by its path."""
    import importlib.util

    pytest.importorskip("av")
    path = Path(__file__).resolve().parent.parent / "vision" / "_video_helpers.py"
    spec = importlib.util.spec_from_file_location("_video_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def video_run(fake_run: Path, video_helpers) -> Path:
    """``fake_run`` whose records have videos: the first a frame list, an H.264 .mp4 (browsers
    play it) and an MPEG-4 Part 2 .avi (no browser does: shown as frames); the second, in a
    video part of its messages, a missing file, and an unreadable one in its field."""
    from PIL import Image

    helpers = video_helpers
    data = fake_run.parent / "data"
    frames = helpers.moving_square(6)
    for k in range(3):
        Image.fromarray(frames[k]).save(data / f"frame_{k}.png")
    helpers.write_video(data / "square.mp4", frames, codec="h264")
    helpers.write_video(data / "square.avi", frames, codec="mpeg4")
    (data / "broken.webm").write_bytes(b"not a video at all")
    records = [
        {
            "prompt": PROMPTS[0],
            "answer": "3",
            "videos": [[f"frame_{k}.png" for k in range(3)], "square.mp4", "square.avi"],
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video", "video": "gone.mp4"},
                        {"type": "text", "text": PROMPTS[1]},
                    ],
                }
            ],
            "answer": "7",
            "video": "broken.webm",
        },
    ]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return fake_run
