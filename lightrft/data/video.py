"""Video for vision-language samples (Qwen2-VL, Qwen2.5-VL): decode, sample, resize, patch, and
place video tokens.

A record's videos come from a ``videos`` field (a list of videos; a single path is a list of one)
or inline in HF content parts (``{"type": "video", "video" | "path" | "url": ...}``); a string
content may mark where a video goes with ``<video>`` tags. Each video is

- a path to a video file (whatever FFmpeg decodes: mp4, webm, avi, ...), relative to the data
  file's directory (or absolute), decoded with PyAV (FFmpeg bindings whose wheels bundle
  FFmpeg; no torchvision, which does not import beside the torch 2.13 CPU wheel);
- or a list of frame images (paths, base64, PIL images: anything an image part takes), the HF
  content format's other form, taken as frames at ``media.video.fps`` frames per second (an inline
  part may give their rate as ``"fps"``: ``{"type": "video", "video": [...], "fps": 4}``).

Frames are sampled when the dataset is built: at ``media.video.fps`` frames per second of the video's
own clock (all frames when the video is slower), or ``num_frames`` frames spread evenly
over the video. More than ``max_frames`` sampled frames is a video over the limit: its
first ``max_frames`` are kept (``overlong="clip"``, counted in the dataset's stats)
or the dataset is refused (``"refuse"``), naming the file, line and field, as a missing file, an
undecodable one and one without frames are.

Each frame is resized (bicubic, aspect kept) to a multiple of ``patch_size * merge_size`` on both
sides with its area within ``[min_pixels, max_pixels]`` (default: the image
processor's bounds), then turned into the model's temporal patches by :func:`video_patches`:
frames grouped by ``temporal_patch_size`` (the last frame repeated when the count is odd), each
group cut into ``patch_size`` squares ordered by ``merge_size`` blocks, as the image patches are
(an image is a video of one frame repeated). ``video_grid_thw`` is ``[t, h, w]`` in patches;
Qwen2.5-VL also gets ``second_per_grid_ts`` (``temporal_patch_size / fps``) for the time axis of
its M-RoPE positions.

Per sample, the processed videos travel as one :class:`VideoInputs` in the sample's
:class:`~lightrft.data.media.Media`, beside its images and audio.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from lightrft.config import Section, option, section
from lightrft.data.io import DataError, MediaItems, local_file

VIDEO_PLACEHOLDER = "<video>"
OverlongVideo = Literal["clip", "refuse"]


def sample_indices(
    count: int, native_fps: float, *, fps: float | None, num_frames: int | None
) -> tuple[list[int], float]:
    """Which of ``count`` frames (at ``native_fps``) to keep, and the rate they are at.

    ``fps``: one frame every ``1 / fps`` seconds from the first (every frame when the video is
    not faster than ``fps``). ``num_frames``: that many frames (at most ``count``) spread
    evenly from the first to the last.
    """
    if num_frames is not None:
        k = min(num_frames, count)
        idx = [round(j * (count - 1) / (k - 1)) for j in range(k)] if k > 1 else [0]
        duration = count / native_fps
        return idx, k / duration
    assert fps is not None
    if fps >= native_fps:
        return list(range(count)), native_fps
    step = native_fps / fps
    k = int(math.floor((count - 1) / step + 1e-9)) + 1
    return [min(count - 1, round(j * step)) for j in range(k)], fps


def video_patches(
    frames: torch.Tensor, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Qwen-VL's flat patches of normalised frames ``[T, C, H, W]`` (H and W multiples of
    ``patch_size * merge_size``): ``([t * h * w, C * temporal_patch_size * patch_size ** 2],
    (t, h, w))`` with ``t = ceil(T / temporal_patch_size)`` (the last frame repeated to fill the
    last group) and ``h, w`` the patch rows and columns.

    Patch order: time group, then ``merge_size x merge_size`` blocks row by row, then the
    patches inside a block row by row (what the vision tower's merger joins into one token);
    each patch flattened as ``(channel, frame in group, row, column)``.
    """
    n, c, height, width = frames.shape
    unit = patch_size * merge_size
    if height % unit or width % unit:
        raise ValueError(f"frames of {height}x{width} are not multiples of {unit} pixels")
    if pad := -n % temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t = frames.shape[0] // temporal_patch_size
    gh, gw = height // patch_size, width // patch_size
    x = frames.reshape(
        t,
        temporal_patch_size,
        c,
        gh // merge_size,
        merge_size,
        patch_size,
        gw // merge_size,
        merge_size,
        patch_size,
    )
    # -> (t, block row, block col, row in block, col in block, C, frame, patch row, patch col)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, c * temporal_patch_size * patch_size**2), (t, gh, gw)


_LOCAL = threading.local()


def decode_video(
    value: Any, *, base_dir: Path | None, frames_fps: float, where: str, field: str
) -> tuple[list[np.ndarray], float]:
    """``(RGB frames [H, W, 3] uint8, frame rate)`` of a video file path or a list of frame
    images (taken at ``frames_fps``, or at the ``fps`` of a ``{"video": frames, "fps": rate}``
    dict: an inline video part that gives its rate, as
    :func:`~lightrft.data.prompts.conversation` writes the frames a prompt was sampled to).

    Raises:
        DataError: naming ``where`` (file and line) and ``field`` for a missing file, an
            undecodable one, a video without frames, or frames of different sizes.
    """
    if isinstance(value, dict):
        rate = value.get("fps")
        if rate is not None:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
                raise DataError(f"{where}: {field}: fps must be a positive number, got {rate!r}")
            frames_fps = float(rate)
        value = value.get("path", value.get("video"))
    if isinstance(value, (list, tuple)):
        from lightrft.data.vision import decode_image

        if not value:
            raise DataError(f"{where}: {field}: the video has no frames (an empty frame list)")
        frames = [
            np.asarray(decode_image(v, base_dir=base_dir, where=where, field=f"{field}[{k}]"))
            for k, v in enumerate(value)
        ]
        if len({f.shape for f in frames}) > 1:
            sizes = sorted({f"{f.shape[1]}x{f.shape[0]}" for f in frames})
            raise DataError(f"{where}: {field}: the frames differ in size ({', '.join(sizes)})")
        return frames, frames_fps
    if not isinstance(value, (str, Path)):
        raise DataError(
            f"{where}: {field}: expected a video file path or a list of frame images, got "
            f"{type(value).__name__}"
        )
    # A file: all its RGB frames and its frame rate (PyAV).
    path = local_file(value, base_dir, where, field, "video")
    try:
        import av
    except ImportError:
        raise DataError(
            f"{where}: {field}: decoding video files needs PyAV: pip install av (or lightrft's "
            "'video' extra)"
        ) from None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DataError(f"{where}: {field}: {path} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            # A per-thread PyAV reformatter: it keeps its swscale context between frames of one
            # size (a frame's own ``to_ndarray(format=...)`` sets one up per frame, 6x slower).
            if getattr(_LOCAL, "reformatter", None) is None:
                _LOCAL.reformatter = av.video.reformatter.VideoReformatter()
            convert = _LOCAL.reformatter
            frames = [
                convert.reformat(f, format="rgb24").to_ndarray() for f in container.decode(stream)
            ]
    except DataError:
        raise
    except Exception as e:  # PyAV raises FFmpegError subclasses, and ValueError for odd input
        raise DataError(f"{where}: {field}: cannot decode the video file {path} ({e})") from None
    if not frames:
        raise DataError(f"{where}: {field}: the video file {path} has no frames")
    if not rate or float(rate) <= 0:
        raise DataError(f"{where}: {field}: the video file {path} gives no frame rate")
    return frames, float(rate)


@dataclass
class VideoInputs(MediaItems):
    """The processed videos of one sample (or, after :meth:`cat`, of a micro-batch).

    ``videos``: the sampled, resized RGB frames ``[T, H, W, 3]`` uint8 of each video, in
    placeholder order (what vLLM takes). ``fps``: each video's sampling rate.
    ``pixel_values_videos``: the flat patches ``[patches, D]``. ``video_grid_thw``:
    ``[videos, 3]``. ``second_per_grid_ts``: ``[videos]`` seconds per temporal patch (Qwen2.5-VL's
    time positions) or None (Qwen2-VL). ``num_tokens``: video tokens per video.
    ``processor_kwargs``: the frame bounds used (vLLM re-processes the frames with them).
    """

    kind: ClassVar[str] = "video"
    model_keys: ClassVar[tuple[str, ...]] = (
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    )

    videos: list[np.ndarray]
    fps: list[float]
    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor | None
    num_tokens: list[int]
    processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def parts(self) -> list[dict[str, Any]]:
        """Each video as the keys of its inline content part: its sampled frames (PIL images)
        under ``"video"`` and their rate under ``"fps"``."""
        from PIL import Image

        return [
            {"video": [Image.fromarray(f) for f in v], "fps": r}
            for v, r in zip(self.videos, self.fps, strict=True)
        ]


@section
class VideoOptions(Section):
    """How a dataset (or a Qwen2-VL / Qwen2.5-VL reward model or judge) samples and sizes its
    videos: the ``media.video`` keys, checked when read (the message names the key)."""

    field: str = option("videos", doc="the records' video list (absent: inline video parts)")
    fps: float = option(
        2.0,
        gt=0,
        doc="frames sampled per second of video (frame lists: the rate they were taken at)",
    )
    num_frames: int | None = option(
        None, ge=1, doc="sample this many frames evenly instead of by fps"
    )
    max_frames: int = option(32, ge=1, doc="the most frames a video may give after sampling")
    overlong: OverlongVideo = option(
        "clip", doc="a video over max_frames: keep its first frames (counted), or refuse the data"
    )
    min_pixels: int | None = option(
        None, ge=1, doc="least area of a frame (null: the image processor's)"
    )
    max_pixels: int | None = option(
        None, ge=1, doc="most area of a frame (null: the image processor's)"
    )

    def resolve(self, at: str) -> VideoOptions:
        if self.num_frames is not None and self.num_frames > self.max_frames:
            raise ValueError(
                f"{at}num_frames={self.num_frames} is over {at}max_frames={self.max_frames}"
            )
        return self


class VideoProcessor:
    """A Qwen-VL processor plus the sampling and size bounds: decodes, samples, resizes and
    patches a sample's videos (:class:`~lightrft.data.records.MediaSamples` expands their
    placeholders).

    Args:
        processor: the model's processor (:meth:`takes`).
        options: the sampling and size bounds (:class:`VideoOptions`).
    """

    kind, tag, inline = "video", VIDEO_PLACEHOLDER, ("video", "path", "url")
    needs = "a Qwen2-VL or Qwen2.5-VL"

    @staticmethod
    def takes(processor) -> bool:
        """Whether a processor places video tokens we can fill: a Qwen2-VL / Qwen2.5-VL
        processor (a ``video_token`` and a patching image processor). Qwen3-VL, which
        interleaves frame timestamps with the video tokens, is not among them."""
        ip = getattr(processor, "image_processor", None)
        if getattr(processor, "video_token", None) is None or ip is None:
            return False
        if not all(hasattr(ip, k) for k in ("temporal_patch_size", "merge_size", "patch_size")):
            return False
        return "Qwen3" not in type(processor).__name__

    def __init__(self, processor, options: VideoOptions) -> None:
        ip = processor.image_processor
        self.patch_size = int(ip.patch_size)
        self.merge_size = int(ip.merge_size)
        self.temporal_patch_size = int(ip.temporal_patch_size)
        size = dict(getattr(ip, "size", None) or {})
        self.min_pixels = int(options.min_pixels or size.get("shortest_edge") or ip.min_pixels)
        self.max_pixels = int(options.max_pixels or size.get("longest_edge") or ip.max_pixels)
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"media.video.min_pixels ({self.min_pixels}) must be <= media.video.max_pixels "
                f"({self.max_pixels})"
            )
        self.mean = torch.tensor(ip.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(ip.image_std, dtype=torch.float32).view(1, -1, 1, 1)
        self.rescale = float(ip.rescale_factor) if ip.do_rescale else 1.0
        self.normalize = bool(ip.do_normalize)
        self.fps, self.num_frames = float(options.fps), options.num_frames
        self.max_frames, self.overlong = options.max_frames, options.overlong
        self.token = processor.video_token
        self.token_id = int(processor.video_token_id)
        # Qwen2.5-VL's forward takes seconds per temporal patch; Qwen2-VL's does not.
        self.time_positions = "Qwen2_5" in type(processor).__name__
        self.clipped = 0  # videos clipped to max_frames while loading

    def load(
        self, values: Sequence[Any], *, base_dir: Path | None, where: str, field: str
    ) -> list[tuple[np.ndarray, float]]:
        """Decoded, sampled, resized videos of a record (fails at load, naming file, line and
        field): each video's sampled, resized RGB frames ``[T, H, W, 3]`` uint8 and the rate
        they were sampled at (frames per second)."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        out = []
        for j, v in enumerate(values):
            f = f"{field}[{j}]"
            frames, rate = decode_video(
                v, base_dir=base_dir, frames_fps=self.fps, where=where, field=f
            )
            idx, fps = sample_indices(len(frames), rate, fps=self.fps, num_frames=self.num_frames)
            if len(idx) > self.max_frames:
                if self.overlong == "refuse":
                    raise DataError(
                        f"{where}: {f}: the video gives {len(idx)} frames at {fps:g} fps, over "
                        f"media.video.max_frames={self.max_frames} (media.video.overlong="
                        "'refuse'); lower media.video.fps, raise media.video.max_frames or set "
                        "media.video.overlong='clip'"
                    )
                idx = idx[: self.max_frames]
                self.clipped += 1
            h, w = frames[0].shape[:2]
            try:  # Qwen-VL's own rule: sides multiples of the unit, area within the bounds
                th, tw = smart_resize(
                    h, w, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
                )
            except (ValueError, ZeroDivisionError) as e:  # sides 200x apart, or a side of 0
                raise DataError(f"{where}: {f}: cannot size a {w}x{h} frame ({e})") from None
            picked = []
            for k in idx:
                img = Image.fromarray(frames[k])
                if (h, w) != (th, tw):
                    img = img.resize((tw, th), Image.Resampling.BICUBIC)
                picked.append(np.asarray(img))
            out.append((np.stack(picked), fps))
        return out

    def process(self, videos: Sequence[tuple[np.ndarray, float]]) -> VideoInputs:
        """Patches, grid rows, seconds per temporal patch and video-token counts of loaded
        ``(frames, fps)`` videos."""
        patches, grids, counts = [], [], []
        frames, fps = map(list, zip(*videos, strict=True))
        for v in frames:
            x = torch.from_numpy(np.ascontiguousarray(v)).permute(0, 3, 1, 2).float()
            x = x * self.rescale  # [T, 3, H, W]
            if self.normalize:
                x = (x - self.mean) / self.std
            p, grid = video_patches(
                x,
                patch_size=self.patch_size,
                merge_size=self.merge_size,
                temporal_patch_size=self.temporal_patch_size,
            )
            patches.append(p)
            grids.append(grid)
            counts.append(grid[0] * grid[1] * grid[2] // self.merge_size**2)
        seconds = (
            torch.tensor([self.temporal_patch_size / f for f in fps], dtype=torch.float32)
            if self.time_positions
            else None
        )
        return VideoInputs(
            frames,
            fps,
            torch.cat(patches),
            torch.tensor(grids, dtype=torch.long),
            seconds,
            counts,
            {"size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}},
        )
