"""Shared helpers for the audio-language tests: tones written with numpy + soundfile."""

import numpy as np


def tone(seconds: float, rate: int = 16000, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    """A sine tone, float32 ``[frames]`` (or ``[frames, channels]``)."""
    t = np.arange(int(round(seconds * rate))) / rate
    wave = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return wave if channels == 1 else np.stack([wave] * channels, axis=1)


def write(path, wave: np.ndarray, rate: int) -> str:
    import soundfile as sf

    sf.write(path, wave, rate)
    return path.name
