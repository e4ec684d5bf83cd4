"""A sample's media as one typed object, from the dataset to the model's forward.

:class:`Media` holds the processed inputs of each kind a sample has: its images
(:class:`~lightrft.data.vision.ImageInputs`), its audio (:class:`~lightrft.data.audio.AudioInputs`)
and its videos (:class:`~lightrft.data.video.VideoInputs`), each in the order of its placeholder runs in the token ids. The same object is a dataset item's
``"media"``, a collated batch's ``"media"`` (its samples' media joined in token order), one entry
per row of a rollout batch, an engine request's ``media`` and a micro-batch's ``media``; the
forward funnel (:func:`lightrft.models.forward.forward_on_hidden`) takes it as ``media=``.

:class:`MediaOptions` is the ``media`` section every dataset, reward model and judge takes: one
sub-section per kind (:class:`~lightrft.data.vision.ImageOptions`,
:class:`~lightrft.data.audio.AudioOptions`, :class:`~lightrft.data.video.VideoOptions`).

A kind is its module (its inputs, options and processor, which names its placeholder tag, its
inline part keys and which model processors take it) plus three lines here: a field of
:class:`Media`, a field of :class:`MediaOptions` and its processor in :data:`PROCESSORS`. The
datasets' generic path (:class:`~lightrft.data.records.MediaSamples`) finds, loads, processes and
expands every kind listed there; docs/architecture.md lists the files a new kind touches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from typing import Any, get_args, get_type_hints

import torch

from lightrft.config import Section, option, section
from lightrft.data.audio import AudioInputs, AudioOptions, AudioProcessor
from lightrft.data.video import VideoInputs, VideoOptions, VideoProcessor
from lightrft.data.vision import ImageInputs, ImageOptions, ImageProcessor

MediaInputs = ImageInputs | AudioInputs | VideoInputs


@dataclass(frozen=True)
class Media:
    """The processed media of one sample or, after :meth:`cat`, of a batch: one field per kind
    (named as vLLM names the kind), None for a kind it lacks."""

    image: ImageInputs | None = None
    audio: AudioInputs | None = None
    video: VideoInputs | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value, want = getattr(self, f.name), _inputs_types(type(self))[f.name]
            if value is not None and not isinstance(value, want):
                raise TypeError(
                    f"Media.{f.name} must be the processed {want.__name__} the datasets give "
                    f"(lightrft.data), got {type(value).__name__}"
                )

    def kinds(self) -> Iterator[tuple[str, MediaInputs]]:
        """``(kind, inputs)`` of each kind present (with at least one item), in field order."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and len(value):
                yield f.name, value

    @staticmethod
    def cat(items: Sequence[Media | None]) -> Media | None:
        """The media of several samples joined kind by kind, in order (None entries, samples
        without media, skipped); None when none has any."""
        present = [m for m in items if m is not None]
        joined = Media(
            **{k: t.cat([getattr(m, k) for m in present]) for k, t in _inputs_types(Media).items()}
        )
        return joined if any(True for _ in joined.kinds()) else None

    def model_inputs(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Every kind's keyword arguments for the model's forward, on ``device``; floating
        features (pixel values, log-mels) cast to ``dtype`` when given."""
        out = {k: v for _, inputs in self.kinds() for k, v in inputs.model_inputs(device).items()}
        if dtype is not None:
            out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
        return out


@cache
def _inputs_types(cls: type) -> dict[str, type]:
    """Each field of ``cls`` (:class:`Media` or a subclass) and its inputs class, read from the
    field's annotation (``ImageInputs | None``): the field is the kind's one registration."""
    hints = get_type_hints(cls)
    return {
        f.name: next(t for t in get_args(hints[f.name]) if t is not type(None)) for f in fields(cls)
    }


# Each kind's processor (its ``kind``, ``tag``, ``inline`` keys, ``needs``, ``takes``), in the
# order a record's media are found, loaded and expanded.
PROCESSORS = (ImageProcessor, VideoProcessor, AudioProcessor)
MEDIA_KINDS = tuple(p.kind for p in PROCESSORS)


@section
class MediaOptions(Section):
    """The ``media`` section of a dataset, reward model or judge: how it reads and bounds each
    kind of media. A kind's keys other than ``field`` need a model whose processor takes that
    kind (:meth:`check_model`)."""

    image: ImageOptions = option(default_factory=ImageOptions, doc="images")
    audio: AudioOptions = option(default_factory=AudioOptions, doc="audio")
    video: VideoOptions = option(default_factory=VideoOptions, doc="videos")

    # The flat keys this section replaced: ``lightrft validate`` names the new key.
    moved = {
        "images_field": "image.field",
        "min_pixels": "image.min_pixels",
        "max_pixels": "image.max_pixels",
        "audios_field": "audio.field",
        "max_audio_seconds": "audio.max_seconds",
        "overlong_audio": "audio.overlong",
        "videos_field": "video.field",
        "video_fps": "video.fps",
        "video_num_frames": "video.num_frames",
        "max_video_frames": "video.max_frames",
        "overlong_video": "video.overlong",
        "video_min_pixels": "video.min_pixels",
        "video_max_pixels": "video.max_pixels",
    }

    def resolve(self, at: str) -> MediaOptions:
        for f in fields(self):
            getattr(self, f.name).checked(f"{at}{f.name}.")
        return self

    def check_model(self, processor, given: str) -> None:
        """Refuse options of a kind the model's ``processor`` (None: a text model) does not
        take, naming the key and saying what the model is (``given``). The one place this rule
        is written: datasets, reward models and judges all build their media through
        :class:`~lightrft.data.records.MediaSamples`, which calls it."""
        for proc in PROCESSORS:
            opts = getattr(self, proc.kind)
            default = type(opts)()
            if not proc.takes(processor) and replace(opts, field=default.field) != default:
                raise ValueError(
                    f"media.{proc.kind} options need {proc.needs} model's processor ({given})"
                )


def as_processor(tokenizer_or_processor) -> tuple[Any, Any | None]:
    """``(tokenizer, processor or None)`` from what a recipe passes a dataset as its first
    argument: a tokenizer (text models) or a multimodal processor (one that a kind ``takes``)."""
    obj = tokenizer_or_processor
    if hasattr(obj, "tokenizer") and any(p.takes(obj) for p in PROCESSORS):
        return obj.tokenizer, obj
    return obj, None
