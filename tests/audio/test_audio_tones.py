"""The synthetic tone-pitch task: splits, answers that match the written audio, settings."""

import json

import numpy as np
import pytest
import soundfile as sf

from lightrft.tasks import ensure_tones_dataset
from lightrft.tasks.tones import tone_band


def _pitch(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[spectrum.argmax()])


def test_tones_answers_are_the_band_of_the_written_tone(tmp_path):
    out = ensure_tones_dataset(tmp_path / "t", n_train=12, n_rl=4, n_test=6, seed=3)
    splits = {
        s: [json.loads(x) for x in (out / f"{s}.jsonl").read_text().splitlines()]
        for s in ("train", "rl", "test")
    }
    assert [len(v) for v in splits.values()] == [12, 4, 6]
    names = [r["audios"][0] for v in splits.values() for r in v]
    assert len(set(names)) == len(names)
    checked = 0
    for rec in splits["train"] + splits["test"]:
        wave, rate = sf.read(out / rec["audios"][0], dtype="float32")
        assert rate == 16000 and wave.shape == (16000,)
        f = _pitch(wave, rate)
        # The FFT peak is the pitch to 1 Hz; skip the rare tone within 2 Hz of a band edge.
        if min(abs(f - 250 * 2**k) for k in range(5)) > 2:
            assert rec["answer"] == rec["completion"] == str(tone_band(f, 250.0, 4))
            checked += 1
        assert rec["prompt"].startswith("<audio>How high is the tone?")
    assert checked >= 16
    # The same settings are reused, other settings rewrite.
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    ensure_tones_dataset(tmp_path / "t", n_train=12, n_rl=4, n_test=6, seed=3)
    assert (out / "train.jsonl").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="unknown argument 'max_count'"):
        ensure_tones_dataset(tmp_path / "t", max_count=3)
    with pytest.raises(ValueError, match="must be below the Nyquist"):
        ensure_tones_dataset(tmp_path / "u", low_hz=1000.0, bands=4)


def test_the_sloppy_teacher_hears_the_top_band_as_the_one_below(tmp_path):
    sizes = dict(n_train=24, n_rl=4, n_test=4, seed=3)
    plain = ensure_tones_dataset(tmp_path / "plain", **sizes)
    sloppy = ensure_tones_dataset(tmp_path / "sloppy", top_heard_lower=1.0, **sizes)
    moved = 0
    for split in ("train", "rl", "test"):
        a, b = ((d / f"{split}.jsonl").read_text().splitlines() for d in (plain, sloppy))
        for x, y in zip(map(json.loads, a), map(json.loads, b), strict=True):
            # The same clips and references; only the training completions of the top band move.
            assert (plain / x["audios"][0]).read_bytes() == (sloppy / y["audios"][0]).read_bytes()
            assert x["answer"] == y["answer"]
            top = x["answer"] == "4" and split == "train"
            assert y["completion"] == ("3" if top else x["completion"])
            moved += top
    assert moved > 0  # the rule was exercised
    with pytest.raises(ValueError, match=r"top_heard_lower must be in \[0, 1\], got 1.5"):
        ensure_tones_dataset(tmp_path / "bad", top_heard_lower=1.5)
