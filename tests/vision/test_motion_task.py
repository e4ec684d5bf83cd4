"""The motion task's videos (lightrft.tasks.motion): the square moves ``step`` pixels a frame in
the labelled direction; ``start_grid`` puts every start at the same place within the grid and
``n_colours=1`` paints every square the palette's first colour (the video demo's settings)."""

import json

import numpy as np
import pytest

from lightrft.data.video import decode_video
from lightrft.tasks.motion import _COLOURS, DIRECTIONS, motion_frames, write_motion_dataset


def _box(frame):
    ys, xs = np.nonzero((np.abs(frame.astype(int) - 255).sum(-1)) > 150)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def test_grid_starts_one_colour_and_the_labelled_motion(tmp_path):
    out = write_motion_dataset(
        tmp_path, n_train=12, n_test=4, frames=2, size=84, side=14, step=7,
        n_colours=1, start_grid=28, start_offset=7,
    )  # fmt: skip
    starts = set()
    for line in (out / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        frames, _ = decode_video(
            rec["videos"][0], base_dir=out, frames_fps=4.0, where="train.jsonl", field="videos"
        )
        assert len(frames) == 2
        (x0, y0, x1, y1), (u0, v0, _, _) = _box(frames[0]), _box(frames[1])
        assert (x1 - x0, y1 - y0) == (14, 14)
        assert x0 in (7, 35, 63) and y0 in (7, 35, 63)
        starts.add((x0, y0))
        dx, dy = DIRECTIONS[rec["answer"]]
        assert (u0 - x0, v0 - y0) == (7 * dx, 7 * dy), rec
        centre = frames[0][y0 + 7, x0 + 7].astype(int)
        assert np.abs(centre - np.array(_COLOURS[0])).max() < 40, centre
    assert len(starts) > 1


def test_bad_motion_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="n_colours"):
        write_motion_dataset(tmp_path, n_train=1, n_test=1, n_colours=0)
    with pytest.raises(ValueError, match="no start on the 28-pixel grid"):
        write_motion_dataset(
            tmp_path, n_train=1, n_test=1, frames=2, size=84, side=14, step=7,
            start_grid=28, start_offset=70,
        )  # fmt: skip


def test_background_grey_level():
    frames = motion_frames(
        "up", x=7, y=35, colour=_COLOURS[0], frames=2, size=84, side=14, step=7, background=118
    )
    assert (frames[:, 0, 0] == 118).all() and (frames[1, 28, 7] == _COLOURS[0]).all()
