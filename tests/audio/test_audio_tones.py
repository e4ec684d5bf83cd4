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
