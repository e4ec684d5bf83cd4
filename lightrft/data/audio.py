"""Audio for audio-language samples: decode, resample, bound the duration, extract features,
and place audio tokens.

A record's audio comes from an ``audios`` field (a list; a single value is a list of one) or
inline in HF content parts (``{"type": "audio", "audio" | "path" | "url" | "audio_url": ...}``);
a string content may mark where audio goes with ``<audio>`` tags. Each audio may be

- a path (wav / flac / ogg / mp3: whatever libsndfile decodes), relative to the data file's
  directory (or absolute);
- bytes of such a file;
- an HF ``datasets`` audio value: ``{"array": ..., "sampling_rate": ...}`` (decoded) or
  ``{"bytes": ..., "path": ...}`` (as stored in parquet).

Files are decoded with ``soundfile``, mixed down to mono and resampled with ``soxr`` to the
feature extractor's rate (``WhisperFeatureExtractor``: 16 kHz), when the dataset is built: a
missing or undecodable file fails there, naming the file, line and field. Audio longer than the
maximum duration is clipped (``overlong_audio="clip"``) or its sample dropped (``"drop"``); both
are counted in the dataset's ``stats``.

Per sample, the processed audio travels as one :class:`AudioInputs` (the counterpart of
:class:`~lightrft.data.vision.ImageInputs`): the waveforms (what vLLM takes), the log-mel
``input_features`` ``[audios, mels, frames]``, the ``feature_attention_mask`` ``[audios, frames]``
and the audio tokens per audio. :meth:`AudioInputs.cat` joins several samples' audio in order.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lightrft.data.io import DataError

__all__ = [
    "AUDIO_PLACEHOLDER",
    "AudioInputs",
    "AudioProcessor",
    "OverlongAudio",
    "decode_audio",
]

# A string prompt may mark where audio goes with this tag (as <image> marks images).
AUDIO_PLACEHOLDER = "<audio>"
OverlongAudio = Literal["clip", "drop"]

# Fewer than 2 audio tokens make Qwen2-Audio take its legacy (unexpanded) merge path, which
# would misread the ids: a sample's audio must give at least this many tokens.
MIN_AUDIO_TOKENS = 2


class AudioTooLong(Exception):
    """Internal: the sample's audio is over the maximum duration and the policy drops it."""


def _resample(wave: np.ndarray, rate: int, target: int, where: str, field: str) -> np.ndarray:
    if rate == target:
        return wave
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
        raise DataError(f"{where}: {field}: sampling rate must be a positive integer, got {rate!r}")
    import soxr

    try:
        return soxr.resample(wave, int(rate), int(target)).astype(np.float32, copy=False)
    except Exception as e:  # soxr raises ValueError / RuntimeError for rates it cannot convert
        raise DataError(
            f"{where}: {field}: cannot resample from {rate} Hz to {target} Hz ({e})"
        ) from None


def _mono(wave: np.ndarray, where: str, field: str) -> np.ndarray:
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim == 2:  # soundfile's [frames, channels]
        wave = wave.mean(axis=1)
    if wave.ndim != 1:
        raise DataError(
            f"{where}: {field}: audio must be 1-D samples or [frames, channels], got shape "
            f"{tuple(wave.shape)}"
        )
    if wave.size == 0:
        raise DataError(f"{where}: {field}: the audio is empty (0 samples)")
    if not np.isfinite(wave).all():
        raise DataError(f"{where}: {field}: the audio holds NaN or infinite samples")
    return wave


def _read_file(data: bytes, where: str, field: str, name: str) -> tuple[np.ndarray, int]:
    import soundfile as sf

    try:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError
        raise DataError(f"{where}: {field}: cannot decode the audio {name}({e})") from None
    return wave, int(rate)


def decode_audio(
    value: Any, *, sampling_rate: int, base_dir: Path | None, where: str, field: str
) -> np.ndarray:
    """Mono float32 samples at ``sampling_rate`` from a path, bytes or HF audio dict.

    Raises:
        DataError: naming ``where`` (file and line) and ``field`` for a missing file, data that
            is not decodable audio, an array without its sampling rate, or a rate that cannot be
            converted.
    """
    name = ""
    if isinstance(value, dict):
        if value.get("array") is not None:
            rate = value.get("sampling_rate")
            if rate is None:
                raise DataError(
                    f"{where}: {field}: an audio array needs its 'sampling_rate' (HF datasets "
                    "Audio values carry one)"
                )
            wave = _mono(value["array"], where, field)
            return _resample(wave, rate, sampling_rate, where, field)
        data, path = value.get("bytes"), value.get("path")
        value = data if data is not None else path
        if value is None:
            raise DataError(f"{where}: {field}: an audio dict needs 'array', 'bytes' or 'path'")
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise DataError(f"{where}: {field}: audio file not found: {path}")
        name = f"file {path} "
        value = path.read_bytes()
    if isinstance(value, np.ndarray):
        raise DataError(
            f"{where}: {field}: a bare audio array has no sampling rate; give "
            '{"array": ..., "sampling_rate": ...}'
        )
    if not isinstance(value, (bytes, bytearray)):
        raise DataError(
            f"{where}: {field}: expected an audio path, bytes or HF audio dict, got "
            f"{type(value).__name__}"
        )
    wave, rate = _read_file(bytes(value), where, field, name)
    return _resample(_mono(wave, where, field), rate, sampling_rate, where, field)


@dataclass
class AudioInputs:
    """The processed audio of one sample (or, after :meth:`cat`, of a micro-batch).

    ``audios``: mono float32 waveforms at ``sampling_rate``, in placeholder order (what vLLM
    takes). ``input_features``: log-mel features ``[audios, mels, frames]`` (padded to the
    extractor's chunk). ``feature_attention_mask``: ``[audios, frames]``, 1 on real frames.
    ``num_tokens``: audio tokens per audio (placeholder copies in the ids).
    """

    audios: list[np.ndarray]
    input_features: torch.Tensor
    feature_attention_mask: torch.Tensor
    num_tokens: list[int]
    sampling_rate: int

    def __len__(self) -> int:
        return len(self.audios)

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The model's keyword arguments: ``input_features`` and ``feature_attention_mask``."""
        feats, mask = self.input_features, self.feature_attention_mask
        if device is not None:
            feats, mask = feats.to(device), mask.to(device)
        return {"input_features": feats, "feature_attention_mask": mask}

    @staticmethod
    def cat(items: Sequence[AudioInputs | None]) -> AudioInputs | None:
        """The audio of several samples, in order (None entries, samples without audio,
        skipped)."""
        present = [x for x in items if x is not None and len(x)]
        if not present:
            return None
        if len(present) == 1:
            return present[0]
        return AudioInputs(
            audios=[a for x in present for a in x.audios],
            input_features=torch.cat([x.input_features for x in present]),
            feature_attention_mask=torch.cat([x.feature_attention_mask for x in present]),
            num_tokens=[n for x in present for n in x.num_tokens],
            sampling_rate=present[0].sampling_rate,
        )


def encoder_output_lengths(frames: torch.Tensor) -> torch.Tensor:
    """Audio tokens of ``frames`` mel frames in Qwen2-Audio's encoder: a stride-2 convolution
    then a stride-2 average pool (``Qwen2AudioEncoder._get_feat_extract_output_lengths``)."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


class AudioProcessor:
    """An audio-language processor plus the duration bound: decodes, resamples, bounds and
    processes a sample's audio and expands the audio placeholders of its token ids.

    Args:
        processor: the model's processor (``lightrft.models.load_processor``), which holds a
            ``feature_extractor`` and names its ``audio_token``.
        max_audio_seconds: the longest audio kept; None: the feature extractor's chunk
            (Whisper: 30 s), past which its features would be cut.
        overlong_audio: ``"clip"`` keeps the first ``max_audio_seconds``, ``"drop"`` drops the
            sample.
    """

    def __init__(
        self,
        processor,
        *,
        max_audio_seconds: float | None = None,
        overlong_audio: OverlongAudio = "clip",
    ) -> None:
        fe = processor.feature_extractor
        self.processor = processor
        self.feature_extractor = fe
        self.sampling_rate = int(fe.sampling_rate)
        chunk = float(fe.n_samples) / self.sampling_rate
        if overlong_audio not in ("clip", "drop"):
            raise ValueError(f"overlong_audio must be 'clip' or 'drop', got {overlong_audio!r}")
        if max_audio_seconds is not None:
            if isinstance(max_audio_seconds, bool) or not isinstance(
                max_audio_seconds, (int, float)
            ):
                raise ValueError(
                    f"max_audio_seconds must be a number of seconds or None, got "
                    f"{max_audio_seconds!r}"
                )
            if not 0 < max_audio_seconds <= chunk:
                raise ValueError(
                    f"max_audio_seconds must be in (0, {chunk:g}] (the feature extractor's chunk, "
                    f"past which it cuts the features), got {max_audio_seconds}"
                )
        self.max_seconds = float(max_audio_seconds) if max_audio_seconds is not None else chunk
        self.max_samples = int(round(self.max_seconds * self.sampling_rate))
        self.overlong = overlong_audio
        self.audio_token = processor.audio_token
        self.audio_token_id = int(processor.audio_token_id)
        self.clipped = 0  # audio clipped to max_audio_seconds while loading
        self.min_samples = self._min_samples()

    def _min_samples(self) -> int:
        hop = int(self.feature_extractor.hop_length)
        frames = 1
        while int(encoder_output_lengths(torch.tensor(frames))) < MIN_AUDIO_TOKENS:
            frames += 1
        return (frames - 1) * hop + 1

    def load(self, values: Sequence[Any], *, base_dir: Path | None, where: str, field: str):
        """Decoded audio of a record at the extractor's rate, clipped to the maximum duration.

        Raises:
            DataError: a missing, undecodable or too short audio (file, line and field named).
            AudioTooLong: an audio over the maximum with ``overlong_audio="drop"``.
        """
        out = []
        for j, v in enumerate(values):
            f = f"{field}[{j}]"
            wave = decode_audio(
                v, sampling_rate=self.sampling_rate, base_dir=base_dir, where=where, field=f
            )
            if wave.size > self.max_samples:
                if self.overlong == "drop":
                    raise AudioTooLong(where)
                wave = wave[: self.max_samples]
                self.clipped += 1
            if wave.size < self.min_samples:
                raise DataError(
                    f"{where}: {f}: the audio is {wave.size / self.sampling_rate * 1000:.1f} ms "
                    f"long; at least {self.min_samples / self.sampling_rate * 1000:.1f} ms is "
                    f"needed for {MIN_AUDIO_TOKENS} audio tokens"
                )
            out.append(wave)
        return out

    def process(self, audios: Sequence[np.ndarray]) -> AudioInputs:
        """Log-mel features, frame masks and audio-token counts of decoded audio."""
        out = self.feature_extractor(
            list(audios),
            sampling_rate=self.sampling_rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        mask = out["attention_mask"].long()  # [N, frames]
        counts = [int(n) for n in encoder_output_lengths(mask.sum(-1)).tolist()]
        return AudioInputs(list(audios), out["input_features"], mask, counts, self.sampling_rate)

    def expand(
        self, ids: list[int], labels: list[int] | None, inputs: AudioInputs, where: str, field: str
    ) -> tuple[list[int], list[int] | None]:
        """Repeat the k-th audio placeholder ``inputs.num_tokens[k]`` times (labels: -100)."""
        from lightrft.data.vision import expand_placeholders

        return expand_placeholders(
            ids,
            labels,
            token_id=self.audio_token_id,
            token=self.audio_token,
            counts=inputs.num_tokens,
            kind="audio",
            where=where,
            field=field,
        )
