"""Shared fixtures for the audio-language tests: a tiny Qwen2-Audio and audio files."""

import pytest
from _audio_helpers import tone, write


@pytest.fixture(scope="session")
def tiny_alm(tmp_path_factory):
    """A tiny Qwen2-Audio dir (Whisper feature extractor: 16 kHz, 16 mels, 2 s chunks)."""
    from lightrft.tasks.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2_audio", arch="qwen2_audio")


@pytest.fixture(scope="session")
def audio_processor(tiny_alm):
    from lightrft.models import load_processor

    return load_processor(tiny_alm)


@pytest.fixture
def audio_files(tmp_path):
    """Three audio files beside the data files of a test: 16 kHz wav, 22.05 kHz stereo flac,
    8 kHz ogg (resampled to 16 kHz when loaded)."""
    return [
        write(tmp_path / "a.wav", tone(0.5, 16000, 440), 16000),
        write(tmp_path / "b.flac", tone(0.8, 22050, 660, channels=2), 22050),
        write(tmp_path / "c.ogg", tone(0.3, 8000, 330), 8000),
    ]
