"""A synthetic motion task with verifiable answers, for tiny video demos: which way does the
square move?

Each video is ``frames`` frames of ``size x size`` pixels, written as an mp4 file with PyAV: a
square (of one of the first ``n_colours`` palette colours, drawn at random) on a white
background, starting at a random place and moving ``step`` pixels a frame left, right, up or
down. The start position is drawn (uniformly) from the places from which every direction stays
in the frame, independently of the direction, so the first frame says nothing about the answer:
the motion does (a late frame's position alone hints at it near the borders). With
``start_grid=g`` the starts are only the places ``start_offset + g * i`` (each axis): the square
then always starts at the same place within a ``g``-pixel grid (28 px is Qwen2-VL's merged
token), which is what makes the direction readable from a bag of video tokens (docs/vision.md,
"Video", has the measurements).
The question asks for the direction; the answer is one word (``left``, ``right``, ``up``,
``down``), scored by exact match.

Records (``train.jsonl``, ``test.jsonl``, and ``rl.jsonl`` with ``n_rl > 0``) carry ``prompt``
(with a ``<video>`` tag), ``videos`` (an mp4 path relative to the data file), ``completion`` (for
SFT), ``answer`` (for RL verifiers) and ``label``. :func:`ensure_motion_dataset` writes them only
when absent or made with other settings, so a config can call it on every start.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np

from lightrft.tasks.made import ensure_made, write_made

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
QUESTION = "<video>Which way does the square move? Answer left, right, up or down."
_COLOURS = [(220, 30, 30), (30, 170, 60), (40, 70, 220), (230, 200, 20), (140, 50, 170)]


def motion_frames(
    direction: str,
    *,
    x: int,
    y: int,
    colour,
    frames: int,
    size: int,
    side: int,
    step: int,
    background: int = 255,
) -> np.ndarray:
    """``[frames, size, size, 3]`` uint8 frames of a ``side``-pixel square whose top-left corner
    starts at ``(x, y)`` and moves ``step`` pixels a frame in ``direction``, on a ``background``
    grey level (255: white)."""
    dx, dy = DIRECTIONS[direction]
    out = np.full((frames, size, size, 3), background, dtype=np.uint8)
    for k in range(frames):
        px, py = x + dx * step * k, y + dy * step * k
        if not (0 <= px <= size - side and 0 <= py <= size - side):
            raise ValueError(f"the square leaves the frame at frame {k} ({direction} from {x},{y})")
        out[k, py : py + side, px : px + side] = colour
    return out


def _write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}  # near-lossless: the tiny square must stay sharp
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())


def write_motion_dataset(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 2000,
    n_test: int = 200,
    n_rl: int = 0,
    frames: int = 4,
    size: int = 56,
    side: int = 14,
    step: int = 4,
    fps: int = 4,
    n_colours: int = 5,
    start_grid: int = 0,
    start_offset: int = 0,
    background: int = 255,
    seed: int = 0,
) -> Path:
    """Write ``videos/*.mp4``, ``train.jsonl``, ``test.jsonl``, ``meta.json`` (and ``rl.jsonl``
    with ``n_rl > 0``); each split draws its own videos from its own seed.

    ``n_colours``: the squares take the first ``n_colours`` colours of the palette (1 to 5).
    ``start_grid``: 0 draws a start from every place where each direction stays in the frame;
    ``g > 0`` only from ``start_offset + g * i`` on each axis."""
    settings = {k: v for k, v in locals().items() if k != "out_dir"}  # what meta.json records
    travel = step * (frames - 1)
    if side < 2 or size < side + 2 * travel + 1:
        raise ValueError(
            f"a {side}-pixel square moving {travel} pixels each way needs size >= "
            f"{side + 2 * travel + 1}, got size={size}"
        )
    if not 1 <= n_colours <= len(_COLOURS):
        raise ValueError(f"n_colours must be 1 to {len(_COLOURS)}, got {n_colours}")
    if start_grid < 0 or start_offset < 0:
        raise ValueError(
            f"start_grid and start_offset must be >= 0, got {start_grid}, {start_offset}"
        )
    # Starts from which every direction stays in the frame (on each axis), on the grid if any.
    starts = range(travel, size - side - travel + 1)
    if start_grid:
        starts = [s for s in starts if s >= start_offset and (s - start_offset) % start_grid == 0]
    if not starts:
        raise ValueError(
            f"no start on the {start_grid}-pixel grid (offset {start_offset}) keeps a {side}-pixel "
            f"square moving {travel} pixels each way inside {size} pixels"
        )
    colours = _COLOURS[:n_colours]
    shape = dict(frames=frames, size=size, side=side, step=step, background=background)
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    names = sorted(DIRECTIONS)
    splits = []
    for k, (split, n) in enumerate((("train", n_train), ("test", n_test), ("rl", n_rl))):
        if split == "rl" and not n:
            continue
        rng = random.Random(seed * 3 + k)
        records = []
        for j in range(n):
            direction = rng.choice(names)
            x, y = rng.choice(starts), rng.choice(starts)
            video = motion_frames(direction, x=x, y=y, colour=rng.choice(colours), **shape)
            name = f"videos/{split}_{j:06d}.mp4"
            _write_mp4(out / name, video, fps)
            records.append(
                {
                    "prompt": QUESTION,
                    "videos": [name],
                    "completion": direction,
                    "answer": direction,
                    "label": "motion",
                }
            )
        splits.append((split, records))
    return write_made(out, splits, settings)


def ensure_motion_dataset(out_dir: str | os.PathLike, **settings: Any) -> Path:
    """:func:`write_motion_dataset` unless ``out_dir`` already holds it with these settings."""
    return ensure_made(write_motion_dataset, out_dir, ("train.jsonl", "test.jsonl"), settings)
