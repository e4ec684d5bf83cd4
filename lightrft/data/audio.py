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
maximum duration (``media.audio.max_seconds``) is clipped (``media.audio.overlong="clip"``) or its
sample dropped (``"drop"``); both
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
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from lightrft.config import Section, option, section
from lightrft.data.io import DataError, MediaItems, local_file

# A string prompt may mark where audio goes with this tag (as <image> marks images).
AUDIO_PLACEHOLDER = "<audio>"
OverlongAudio = Literal["clip", "drop"]

# Fewer than 2 audio tokens make Qwen2-Audio take its legacy (unexpanded) merge path, which
# would misread the ids: a sample's audio must give at least this many tokens.
MIN_AUDIO_TOKENS = 2


class AudioTooLong(Exception):
    """Internal: the sample's audio is over the maximum duration and the policy drops it."""


def decode_audio(
    value: Any, *, sampling_rate: int, base_dir: Path | None, where: str, field: str
) -> np.ndarray:
    """Mono float32 samples at ``sampling_rate`` from a path, bytes or HF audio dict.

    Raises:
        DataError: naming ``where`` (file and line) and ``field`` for a missing file, data that
            is not decodable audio, an array without its sampling rate, or a rate that cannot be
            converted.
    """
    if isinstance(value, dict) and value.get("array") is not None:
        wave, rate = value["array"], value.get("sampling_rate")
        if rate is None:
            raise DataError(
                f"{where}: {field}: an audio array needs its 'sampling_rate' (HF datasets "
                "Audio values carry one)"
            )
    else:
        name = ""
        if isinstance(value, dict):
            data, path = value.get("bytes"), value.get("path")
            value = data if data is not None else path
            if value is None:
                raise DataError(f"{where}: {field}: an audio dict needs 'array', 'bytes' or 'path'")
        if isinstance(value, (str, Path)):
            path = local_file(value, base_dir, where, field, "audio")
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
        import soundfile as sf

        try:
            wave, rate = sf.read(io.BytesIO(bytes(value)), dtype="float32", always_2d=True)
        except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError
            raise DataError(f"{where}: {field}: cannot decode the audio {name}({e})") from None
        rate = int(rate)
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
    if rate == sampling_rate:
        return wave
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
        raise DataError(f"{where}: {field}: sampling rate must be a positive integer, got {rate!r}")
    import soxr

    try:
        return soxr.resample(wave, int(rate), int(sampling_rate)).astype(np.float32, copy=False)
    except Exception as e:  # soxr raises ValueError / RuntimeError for rates it cannot convert
        raise DataError(
            f"{where}: {field}: cannot resample from {rate} Hz to {sampling_rate} Hz ({e})"
        ) from None


@dataclass
class AudioInputs(MediaItems):
    """The processed audio of one sample (or, after :meth:`cat`, of a micro-batch).

    ``audios``: mono float32 waveforms at ``sampling_rate``, in placeholder order (what vLLM
    takes). ``input_features``: log-mel features ``[audios, mels, frames]`` (padded to the
    extractor's chunk). ``feature_attention_mask``: ``[audios, frames]``, 1 on real frames.
    ``num_tokens``: audio tokens per audio (placeholder copies in the ids).
    """

    kind: ClassVar[str] = "audio"
    model_keys: ClassVar[tuple[str, ...]] = ("input_features", "feature_attention_mask")

    audios: list[np.ndarray]
    input_features: torch.Tensor
    feature_attention_mask: torch.Tensor
    num_tokens: list[int]
    sampling_rate: int

    def parts(self) -> list[dict[str, Any]]:
        """Each audio as the keys of its inline content part (an HF audio value)."""
        return [{"audio": {"array": w, "sampling_rate": self.sampling_rate}} for w in self.audios]


def encoder_output_lengths(frames: torch.Tensor) -> torch.Tensor:
    """Audio tokens of ``frames`` mel frames in Qwen2-Audio's encoder: a stride-2 convolution
    then a stride-2 average pool (``Qwen2AudioEncoder._get_feat_extract_output_lengths``)."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


@section
class AudioOptions(Section):
    """How a dataset (or an audio-language reward model or judge) reads and bounds its audio:
    the ``media.audio`` keys."""

    field: str = option("audios", doc="the records' audio list (absent: inline audio parts)")
    max_seconds: float | None = option(
        None,
        gt=0,
        doc="the longest audio kept (null: the feature extractor's chunk, Whisper: 30 s)",
    )
    overlong: OverlongAudio = option(
        "clip", doc="an audio over max_seconds: clip it to them, or drop the sample (counted)"
    )


class AudioProcessor:
    """An audio-language processor plus the duration bound: decodes, resamples, bounds and
    processes a sample's audio (:class:`~lightrft.data.records.MediaSamples` expands its
    placeholders).

    Args:
        processor: the model's processor (``lightrft.models.load_processor``), which holds a
            ``feature_extractor`` and names its ``audio_token``.
        options: :class:`AudioOptions`: the longest audio kept (None: the feature extractor's
            chunk, Whisper: 30 s, past which its features would be cut) and what becomes of a
            longer one (``"clip"`` keeps its start, ``"drop"`` drops the sample).
    """

    kind, tag, inline = "audio", AUDIO_PLACEHOLDER, ("audio", "path", "url", "audio_url")
    needs = "an audio-language"

    @staticmethod
    def takes(processor) -> bool:
        """Whether a model's processor takes audio (a feature extractor: Qwen2-Audio)."""
        return getattr(processor, "feature_extractor", None) is not None

    def __init__(self, processor, options: AudioOptions) -> None:
        fe = processor.feature_extractor
        self.feature_extractor = fe
        self.sampling_rate = int(fe.sampling_rate)
        chunk = float(fe.n_samples) / self.sampling_rate
        if options.max_seconds is not None and options.max_seconds > chunk:
            raise ValueError(
                f"media.audio.max_seconds must be in (0, {chunk:g}] (the feature extractor's "
                f"chunk, past which it cuts the features), got {options.max_seconds}"
            )
        self.max_seconds = float(options.max_seconds or chunk)
        self.max_samples = int(round(self.max_seconds * self.sampling_rate))
        self.overlong = options.overlong
        self.token = processor.audio_token
        self.token_id = int(processor.audio_token_id)
        self.clipped = 0  # audio clipped to max_seconds while loading
        frames = 1  # the fewest mel frames that give MIN_AUDIO_TOKENS, then their samples
        while int(encoder_output_lengths(torch.tensor(frames))) < MIN_AUDIO_TOKENS:
            frames += 1
        self.min_samples = (frames - 1) * int(fe.hop_length) + 1

    def load(self, values: Sequence[Any], *, base_dir: Path | None, where: str, field: str):
        """Decoded audio of a record at the extractor's rate, clipped to the maximum duration.

        Raises:
            DataError: a missing, undecodable or too short audio (file, line and field named).
            AudioTooLong: an audio over the maximum with ``media.audio.overlong="drop"``.
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
