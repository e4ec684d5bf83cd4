"""Video files for the video tests, written with PyAV itself."""

import numpy as np


def moving_square(n: int, size: int = 56, step: int = 4, direction: int = 1) -> np.ndarray:
    """``[n, size, size, 3]`` uint8 frames of a white square moving ``step`` pixels a frame
    (``direction`` 1: right, -1: left)."""
    frames = np.zeros((n, size, size, 3), dtype=np.uint8)
    side = size // 4
    for k in range(n):
        x = (size - side) // 2 + direction * step * (k - n // 2)
        x = max(0, min(size - side, x))
        frames[k, side : 2 * side, x : x + side] = 255
    return frames


def write_video(path, frames: np.ndarray, fps: int = 4, codec: str = "mpeg4"):
    """Encode ``frames`` ``[T, H, W, 3]`` uint8 into ``path`` (container from its suffix)."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        if not len(frames):
            out.start_encoding()
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
