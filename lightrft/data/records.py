"""The records-and-media layer the SFT, prompt and preference datasets share: opening records
(files or an in-memory list), the truncation policy, and a sample's images and audio
(:class:`MediaSamples` finds, loads, processes and expands them).

Reading files lives one level lower, in :mod:`lightrft.data.io`, which the image and audio
processors import too (for :class:`~lightrft.data.io.DataError`): this module imports those
processors, so the two cannot be one module without a cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightrft.data.audio import AudioInputs, AudioProcessor, OverlongAudio
from lightrft.data.io import DataError, PathLike, Records, load_records
from lightrft.data.media import Media
from lightrft.data.templates import has_parts
from lightrft.data.video import (
    DecodedVideo,
    VideoInputs,
    VideoOptions,
    VideoProcessor,
    takes_video,
)
from lightrft.data.vision import ImageInputs, ImageProcessor, record_media

__all__ = [
    "DecodedMedia",
    "MediaSamples",
    "Truncation",
    "check_truncation",
    "open_records",
]

_NO_IMAGES = ImageInputs([], torch.empty(0), None, [], {})
_NO_AUDIO = AudioInputs([], torch.empty(0), torch.empty(0), [], 0)
_NO_VIDEO = VideoInputs([], [], torch.empty(0), torch.empty(0, 3, dtype=torch.long), None, [])
Truncation = Literal["truncate", "drop"]


def check_truncation(truncation: str, name: str = "truncation") -> None:
    """Raise a ``ValueError`` unless ``truncation`` (option ``name``) is a :data:`Truncation`."""
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"{name} must be 'truncate' or 'drop', got {truncation!r}")


def open_records(
    path: PathLike | Sequence[PathLike] | None,
    records: Sequence[Mapping[str, Any]] | None,
    split: str | None,
) -> Records:
    """Records from files (``path``) or given in memory (``records``); exactly one of them."""
    if (path is None) == (records is None):
        raise ValueError("give exactly one of path (data files) or records (in-memory list)")
    if records is not None:
        if len(records) == 0:
            raise DataError("empty dataset: records is an empty list")
        return Records.from_list(records)
    return load_records(path, split=split)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DecodedMedia:
    """A sample's media as loaded (lists of PIL images / waveforms / sampled frames), before
    processing into :class:`~lightrft.data.media.Media`. A kind the sample does not have is
    None."""

    image: list | None = None
    audio: list | None = None
    video: list[DecodedVideo] | None = None


class MediaSamples:
    """The media side of a dataset: finds a record's images and audio, loads them (failing at
    load with file, line and field) and expands the placeholders of its ids. Shared by the SFT
    and prompt datasets so that images and audio ride the same path as text.

    Which kinds a dataset takes follows the processor: an ``image_processor`` takes images, a
    Qwen2-VL / Qwen2.5-VL processor videos too (:func:`~lightrft.data.video.takes_video`), a
    ``feature_extractor`` (Whisper features: Qwen2-Audio) takes audio. ``videos_field``: the
    records' video list; ``video``: its sampling and size bounds
    (:class:`~lightrft.data.video.VideoOptions`; None: the defaults).
    """

    def __init__(
        self,
        processor,
        images_field: str | None,
        min_pixels,
        max_pixels,
        audios_field: str | None = "audios",
        max_audio_seconds: float | None = None,
        overlong_audio: OverlongAudio = "clip",
        videos_field: str | None = "videos",
        video: VideoOptions | None = None,
    ) -> None:
        video = video or VideoOptions()
        has_images = getattr(processor, "image_processor", None) is not None
        has_audio = getattr(processor, "feature_extractor", None) is not None
        self.images = (
            ImageProcessor(processor, min_pixels=min_pixels, max_pixels=max_pixels)
            if has_images
            else None
        )
        if self.images is None and (min_pixels is not None or max_pixels is not None):
            raise ValueError(
                "min_pixels / max_pixels need a vision-language processor (the dataset was "
                f"given {'a tokenizer' if processor is None else type(processor).__name__})"
            )
        self.audio = (
            AudioProcessor(
                processor, max_audio_seconds=max_audio_seconds, overlong_audio=overlong_audio
            )
            if has_audio
            else None
        )
        if self.audio is None and (max_audio_seconds is not None or overlong_audio != "clip"):
            raise ValueError(
                "max_audio_seconds / overlong_audio need an audio-language processor (the "
                f"dataset was given {'a tokenizer' if processor is None else type(processor).__name__})"
            )
        self.video = VideoProcessor(processor, video) if takes_video(processor) else None
        if self.video is None and video != VideoOptions():
            raise ValueError(
                "video options (video_fps, video_num_frames, max_video_frames, ...) need a "
                "Qwen2-VL or Qwen2.5-VL processor (the dataset was given "
                f"{'a tokenizer' if processor is None else type(processor).__name__})"
            )
        self.fields: dict[str, str | None] = {}
        if self.images is not None:
            self.fields["image"] = images_field
        if self.video is not None:
            self.fields["video"] = videos_field
        if self.audio is not None:
            self.fields["audio"] = audios_field
        self._all_fields = {"image": images_field, "video": videos_field, "audio": audios_field}
        self._token_ids = {
            kind: proc.video_token_id if kind == "video" else proc.image_token_id
            for kind, proc in (("image", self.images), ("video", self.video))
            if proc is not None
        }
        if self.audio is not None:
            self._token_ids["audio"] = self.audio.audio_token_id
        self.kinds = list(self.fields)

    @property
    def clipped(self) -> int:
        """Audio clipped to ``max_audio_seconds`` so far."""
        return self.audio.clipped if self.audio is not None else 0

    @property
    def videos_clipped(self) -> int:
        """Videos clipped to ``max_video_frames`` so far."""
        return self.video.clipped if self.video is not None else 0

    def messages(self, src: Records, i: int, msgs: list[dict[str, Any]]):
        """``(messages with media parts, its DecodedMedia or None)`` of record ``i``.

        Raises:
            AudioTooLong: the record's audio is over the maximum and ``overlong_audio="drop"``.
        """
        where = src.where(i)
        for kind, field in self._all_fields.items():
            if kind not in self.fields and field and src[i].get(field):
                model = (
                    "a tokenizer"
                    if not self.kinds
                    else f"a processor for {' and '.join(k + 's' for k in self.kinds)} only"
                )
                need = {
                    "image": "a vision-language",
                    "video": "a Qwen2-VL or Qwen2.5-VL",
                    "audio": "an audio-language",
                }[kind]
                raise DataError(
                    f"{where}: the record has {kind}s, but the dataset was built with {model} "
                    f"(field {field!r}): {need} model's processor is needed"
                )
        if not self.kinds:
            # Text models: "<image>" in a string is just text, but content parts are an error.
            if has_parts(msgs):
                raise DataError(
                    f"{where}: content parts (lists) need a multimodal model's processor"
                )
            return msgs, None
        msgs, raw = record_media(src[i], msgs, self.fields, where)
        if not any(raw.values()):
            return msgs, None
        base = src.base_dir(i)
        images = audios = videos = None
        if raw.get("image"):
            assert self.images is not None
            field = self.fields["image"] or "content"
            images = self.images.load(raw["image"], base_dir=base, where=where, field=field)
        if raw.get("video"):
            assert self.video is not None
            field = self.fields["video"] or "content"
            videos = self.video.load(raw["video"], base_dir=base, where=where, field=field)
        if raw.get("audio"):
            assert self.audio is not None
            field = self.fields["audio"] or "content"
            audios = self.audio.load(raw["audio"], base_dir=base, where=where, field=field)
        return msgs, DecodedMedia(images, audios, videos)

    def raw_mode(self, src: Records, i: int) -> None:
        """Raw (template-free) records cannot place media tokens: refuse their media."""
        for kind, field in self._all_fields.items():
            if field and src[i].get(field):
                raise DataError(
                    f"{src.where(i)}: field {field!r}: {kind}s need apply_chat_template=true "
                    f"(the chat template places the {kind} tokens)"
                )

    def process(self, media: DecodedMedia) -> Media:
        """Pixel values / video patches / audio features of a sample's decoded media."""
        images = audios = videos = None
        if media.image:
            assert self.images is not None
            images = self.images.process(media.image)
        if media.video:
            assert self.video is not None
            videos = self.video.process(media.video)
        if media.audio:
            assert self.audio is not None
            audios = self.audio.process(media.audio)
        return Media(images, audios, videos)

    def expand(
        self, ids: list[int], labels, media: DecodedMedia | None, where: str
    ) -> tuple[list[int], Any, Media | None]:
        """Process the sample's media and expand its placeholders; a multimodal sample without
        media of a kind must hold no placeholder of that kind (the forward would find none)."""
        if not self.kinds:
            return ids, labels, None
        done = self.process(media) if media is not None else Media()
        if self.images is not None:
            field = self.fields["image"] or "content"
            ids, labels = self.images.expand(ids, labels, done.image or _NO_IMAGES, where, field)
        if self.video is not None:
            field = self.fields["video"] or "content"
            ids, labels = self.video.expand(ids, labels, done.video or _NO_VIDEO, where, field)
        if self.audio is not None:
            field = self.fields["audio"] or "content"
            ids, labels = self.audio.expand(ids, labels, done.audio or _NO_AUDIO, where, field)
        return ids, labels, done if media is not None else None

    def intact(self, ids: list[int], media: Media | None) -> bool:
        """Whether truncated ``ids`` still hold every media token of the sample."""
        if media is None:
            return True
        for kind, inputs in media.kinds():
            tok = self._token_ids[kind]
            if sum(1 for t in ids if t == tok) != sum(inputs.num_tokens):
                return False
        return True

    def kept_all(self, full: list[int], cut: list[int]) -> bool:
        """Whether ``cut`` (a prefix of ``full``) still holds every media token of ``full``:
        a sample that lost some cannot be forwarded (the model finds fewer tokens than its
        images and audio give)."""
        ids = set(self._token_ids.values())
        return sum(t in ids for t in cut) == sum(t in ids for t in full)

    def report_videos(self, log: logging.Logger, source: str, stats: dict) -> None:
        """Add ``video_clipped`` (datasets with a video processor only) to a dataset's ``stats``
        and warn of the clipped videos."""
        if self.video is None:
            return
        stats["video_clipped"] = self.videos_clipped
        if self.videos_clipped:
            log.warning(
                "%s: clipped %d video(s) to max_video_frames=%d",
                source,
                self.videos_clipped,
                self.video.max_frames,
            )

    def report(self, log: logging.Logger, source: str, stats: dict, noun: str, audio_dropped, cut):
        """Add the audio counts to a dataset's ``stats`` and warn on the dataset's ``log`` of the
        ``noun``s (prompts, samples) dropped for audio or ``cut`` (``"max_length=N truncated"``)
        at the length limit, as ``stats`` counts them."""
        self.report_videos(log, source, stats)
        if self.audio is not None:
            stats.update(audio_clipped=self.clipped, audio_dropped=audio_dropped)
            if audio_dropped:
                why = f"with audio over max_audio_seconds={self.audio.max_seconds:g}"
                log.warning("%s: dropped %d %s %s", source, audio_dropped, noun, why)
        if stats["truncated"] or stats["dropped"]:
            counts = (stats["truncated"], stats["dropped"], stats["records"])
            log.warning("%s: %s %d and dropped %d of %d %s", source, cut, *counts, noun)
