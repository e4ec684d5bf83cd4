"""A synthetic audio counting task with verifiable answers, for tiny audio-language demos.

Each clip is ``seconds`` of faint noise at ``rate`` Hz holding ``count`` beeps: short sine tones
(random pitch and loudness, smooth on/off ramps), each in its own slot of the clip (``2 *
max_count`` slots, a random subset used, with a random offset inside the slot), so beeps never
touch. The question asks how many beeps there are; the answer is the count (an integer, scored by
the math verifier's ``last_number`` extractor). Clips are generated with numpy and written as
16-bit WAV files with ``soundfile``.

Records (``train.jsonl``, ``test.jsonl``) carry ``prompt`` (with an ``<audio>`` tag), ``audios``
(a WAV path relative to the data file), ``completion`` (the answer, for SFT), ``answer`` (the
reference, for RL verifiers) and ``label``. Train and test clips come from different seeds (the
random pitches, offsets and noise make every clip distinct). :func:`ensure_beeps_dataset` writes
them only when absent or made with other settings, so a config can call it on every start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from lightrft.data.io import made_with, write_jsonl

__all__ = ["beep_clip", "ensure_beeps_dataset", "write_beeps_dataset"]

META = "meta.json"
QUESTION = "<audio>How many beeps are in the recording? Answer with a number."
_DEFAULTS = dict(
    n_train=2000,
    n_test=200,
    min_count=1,
    max_count=4,
    seconds=1.0,
    beep_ms=80,
    rate=16000,
    seed=0,
)


def _check(min_count: int, max_count: int, seconds: float, beep_ms: int, rate: int) -> None:
    if not 0 <= min_count <= max_count or max_count < 1:
        raise ValueError(
            f"need 0 <= min_count <= max_count and max_count >= 1, got min_count={min_count}, "
            f"max_count={max_count}"
        )
    if rate < 1000 or seconds <= 0:
        raise ValueError(
            f"need rate >= 1000 Hz and seconds > 0, got rate={rate}, seconds={seconds}"
        )
    slot_ms = 1000 * seconds / (2 * max_count)
    if not 10 <= beep_ms <= slot_ms:
        raise ValueError(
            f"beep_ms must be in [10, {slot_ms:g}] (a beep fits one of the 2*max_count slots of "
            f"the clip), got {beep_ms}"
        )


def beep_clip(
    rng: np.random.Generator, count: int, *, max_count: int, seconds: float, beep_ms: int, rate: int
) -> np.ndarray:
    """A float32 clip of ``seconds`` with ``count`` beeps in distinct slots (see module doc)."""
    n = int(round(seconds * rate))
    clip = rng.normal(0.0, 0.01, n).astype(np.float32)
    slots = 2 * max_count
    slot_len = n // slots
    beep_len = int(round(beep_ms * rate / 1000))
    ramp = max(1, beep_len // 8)
    envelope = np.ones(beep_len, dtype=np.float32)
    envelope[:ramp] = np.linspace(0, 1, ramp, dtype=np.float32)
    envelope[-ramp:] = np.linspace(1, 0, ramp, dtype=np.float32)
    t = np.arange(beep_len, dtype=np.float32) / rate
    for slot in sorted(rng.choice(slots, size=count, replace=False).tolist()):
        start = slot * slot_len + int(rng.integers(0, max(1, slot_len - beep_len + 1)))
        freq = float(rng.uniform(500.0, 2000.0))
        amp = float(rng.uniform(0.3, 0.8))
        clip[start : start + beep_len] += amp * envelope * np.sin(2 * np.pi * freq * t)
    return np.clip(clip, -1.0, 1.0)


def write_beeps_dataset(out_dir: str | os.PathLike, **settings: Any) -> Path:
    """Write ``audio/*.wav``, ``train.jsonl``, ``test.jsonl`` and ``meta.json``."""
    import soundfile as sf

    want = {**_DEFAULTS, **settings}
    _check(want["min_count"], want["max_count"], want["seconds"], want["beep_ms"], want["rate"])
    out = Path(out_dir)
    (out / "audio").mkdir(parents=True, exist_ok=True)
    clip = {k: want[k] for k in ("max_count", "seconds", "beep_ms", "rate")}
    for split, n, seed in (
        ("train", want["n_train"], want["seed"]),
        ("test", want["n_test"], want["seed"] + 1_000_003),
    ):
        rng = np.random.default_rng(seed)
        records = []
        for k in range(n):
            count = int(rng.integers(want["min_count"], want["max_count"] + 1))
            name = f"audio/{split}_{k:06d}.wav"
            sf.write(out / name, beep_clip(rng, count, **clip), want["rate"], subtype="PCM_16")
            answer = str(count)
            records.append(
                {
                    "prompt": QUESTION,
                    "audios": [name],
                    "completion": answer,
                    "answer": answer,
                    "label": "count",
                }
            )
        write_jsonl(out / f"{split}.jsonl", records)
    (out / META).write_text(json.dumps(want, indent=2) + "\n")
    return out


def ensure_beeps_dataset(out_dir: str | os.PathLike, **settings: Any) -> Path:
    """:func:`write_beeps_dataset` unless ``out_dir`` already holds it with these settings."""
    unknown = sorted(set(settings) - set(_DEFAULTS))
    if unknown:
        raise ValueError(
            f"ensure_beeps_dataset: unknown argument {unknown[0]!r}; valid: {sorted(_DEFAULTS)}"
        )
    want = {**_DEFAULTS, **settings}
    out = Path(out_dir)
    if made_with(out, ("train.jsonl", "test.jsonl"), want):
        return out
    return write_beeps_dataset(out, **want)
