"""A synthetic audio task with verifiable answers, for tiny audio-language demos: how high is
the tone?

Each clip is ``seconds`` of faint noise at ``rate`` Hz holding one sine tone (random length
between a fifth and three fifths of the clip, random start, loudness and smooth on/off ramps) at
a pitch drawn log-uniformly from ``low_hz`` to ``low_hz * 2**bands``. The question asks how high
the tone is; the answer is its octave band, ``1`` (lowest) to ``bands`` (highest), an integer
scored by the math verifier's ``last_number`` extractor. Pitches near a band edge are the hard
cases, so accuracy climbs gradually as a model sharpens its band boundaries. Clips are generated
with numpy and written as 16-bit WAV files with ``soundfile``.

``top_heard_lower`` makes a sloppy teacher for SFT: that share of the top-band training clips
get the band below as their completion, drawn at random (their ``answer``, what RL verifiers
use, stays right, and so does every rl and test record). An SFT model trained to convergence on
such data settles where the habit puts it, whatever the seed, and RL against the answers has
something to correct.

Three splits: ``train.jsonl`` (SFT), ``rl.jsonl`` (RL prompts the SFT step never saw) and
``test.jsonl`` (held out), each from its own seed. Records carry ``prompt`` (with an ``<audio>``
tag), ``audios`` (a WAV path relative to the data file), ``completion`` (the answer, for SFT),
``answer`` (the reference, for RL verifiers) and ``label``. :func:`ensure_tones_dataset` writes
them only when absent or made with other settings, so a config can call it on every start.

(Counting beeps, the other task the audio issue suggests, was tried first: a tiny Qwen2-Audio
stayed at chance after 300 SFT steps, while this per-tone question is learnt in ~100.)
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from lightrft.tasks.made import ensure_made, write_made

SPLITS = ("train", "rl", "test")


def tone_band(freq: float, low_hz: float, bands: int) -> int:
    """The octave band (1..bands) of ``freq``."""
    return min(bands, max(1, 1 + int(math.floor(math.log2(freq / low_hz)))))


def tone_clip(rng: np.random.Generator, freq: float, *, seconds: float, rate: int) -> np.ndarray:
    """A float32 clip of ``seconds``: faint noise and one tone at ``freq`` (see module doc)."""
    n = int(round(seconds * rate))
    clip = rng.normal(0.0, 0.02, n).astype(np.float32)
    length = int(rng.uniform(0.2, 0.6) * n)
    start = int(rng.integers(0, n - length + 1))
    ramp = max(1, length // 16)
    envelope = np.ones(length, dtype=np.float32)
    envelope[:ramp] = np.linspace(0, 1, ramp, dtype=np.float32)
    envelope[-ramp:] = np.linspace(1, 0, ramp, dtype=np.float32)
    t = np.arange(length, dtype=np.float32) / rate
    amp = float(rng.uniform(0.2, 0.7))
    clip[start : start + length] += amp * envelope * np.sin(2 * np.pi * freq * t)
    return np.clip(clip, -1.0, 1.0)


def write_tones_dataset(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 2000,
    n_rl: int = 2000,
    n_test: int = 200,
    bands: int = 4,
    low_hz: float = 250.0,
    seconds: float = 1.0,
    rate: int = 16000,
    top_heard_lower: float = 0.0,
    seed: int = 0,
) -> Path:
    """Write ``audio/*.wav``, ``train.jsonl``, ``rl.jsonl``, ``test.jsonl`` and ``meta.json``."""
    settings = {k: v for k, v in locals().items() if k != "out_dir"}  # what meta.json records
    import soundfile as sf

    bands, low, rate = int(bands), float(low_hz), int(rate)
    if bands < 2:
        raise ValueError(f"bands must be >= 2, got {bands}")
    if seconds <= 0 or rate < 1000:
        raise ValueError(f"need seconds > 0 and rate >= 1000 Hz, got {seconds}, {rate}")
    top = low * 2**bands
    if low <= 0 or top >= rate / 2:
        raise ValueError(
            f"the top band edge low_hz * 2**bands = {top:g} Hz must be below the Nyquist "
            f"frequency rate / 2 = {rate / 2:g} Hz (and low_hz > 0)"
        )
    question = f"<audio>How high is the tone? Answer with a number from 1 (low) to {bands} (high)."
    sloppy = float(top_heard_lower)
    if not 0.0 <= sloppy <= 1.0:
        raise ValueError(f"top_heard_lower must be in [0, 1], got {sloppy}")
    out = Path(out_dir)
    (out / "audio").mkdir(parents=True, exist_ok=True)
    splits = []
    for k, split in enumerate(SPLITS):
        rng = np.random.default_rng([int(seed), k])
        # Its own stream, so the clips are the same whatever the teacher's habit.
        teacher = np.random.default_rng([int(seed), k, 1])
        records = []
        for i in range(int(settings[f"n_{split}"])):
            freq = float(np.exp(rng.uniform(math.log(low), math.log(low * 2**bands))))
            name = f"audio/{split}_{i:06d}.wav"
            clip = tone_clip(rng, freq, seconds=seconds, rate=rate)
            sf.write(out / name, clip, rate, subtype="PCM_16")
            band = tone_band(freq, low, bands)
            answer, said = str(band), band
            if split == "train" and band == bands and teacher.random() < sloppy:
                said = bands - 1  # the sloppy teacher's habit (see the module doc)
            records.append(
                {
                    "prompt": question,
                    "audios": [name],
                    "completion": str(said),
                    "answer": answer,
                    "label": "pitch",
                }
            )
        splits.append((split, records))
    return write_made(out, splits, settings)


def ensure_tones_dataset(out_dir: str | os.PathLike, **settings: Any) -> Path:
    """:func:`write_tones_dataset` unless ``out_dir`` already holds it with these settings."""
    return ensure_made(write_tones_dataset, out_dir, (f"{s}.jsonl" for s in SPLITS), settings)
