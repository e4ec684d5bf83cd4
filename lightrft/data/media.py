"""A sample's media as one typed object, from the dataset to the model's forward.

:class:`Media` holds the processed inputs of each kind a sample has: its images
(:class:`~lightrft.data.vision.ImageInputs`), its audio (:class:`~lightrft.data.audio.AudioInputs`)
and its videos (:class:`~lightrft.data.video.VideoInputs`), each in the order of its placeholder runs in the token ids. The same object is a dataset item's
``"media"``, a collated batch's ``"media"`` (its samples' media joined in token order), one entry
per row of a rollout batch, an engine request's ``media`` and a micro-batch's ``media``; the
forward funnel (:func:`lightrft.kernels.forward_on_hidden`) takes it as ``media=``.

Adding a modality is a field here, its reader in :mod:`lightrft.data.records` and its inputs in
the model funnel (:func:`lightrft.kernels.hf.media_forward_kwargs`); nothing between them
changes. Video was added that way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import torch

from lightrft.data.audio import AudioInputs
from lightrft.data.video import VideoInputs
from lightrft.data.vision import ImageInputs

__all__ = ["Media", "MediaInputs"]

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
            value, want = getattr(self, f.name), _TYPES[f.name]
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
            **{k: cls.cat([getattr(m, k) for m in present]) for k, cls in _TYPES.items()}
        )
        return joined if any(True for _ in joined.kinds()) else None

    def model_inputs(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Every kind's keyword arguments for the model's forward, on ``device``; floating
        features (pixel values, log-mels) cast to ``dtype`` when given."""
        out: dict[str, torch.Tensor] = {}
        for _, inputs in self.kinds():
            out.update(inputs.model_inputs(device))
        if dtype is not None:
            out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
        return out


_TYPES: dict[str, type] = {"image": ImageInputs, "audio": AudioInputs, "video": VideoInputs}
