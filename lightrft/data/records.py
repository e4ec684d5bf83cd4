"""The records-and-media layer the SFT, prompt and preference datasets share: opening records
(files or an in-memory list), the truncation policy, and a sample's media (:class:`MediaSamples`
finds, loads, processes and expands them, one generic path for every kind in
:data:`~lightrft.data.media.PROCESSORS`).

Reading files lives one level lower, in :mod:`lightrft.data.io`, which the image and audio
processors import too (for :class:`~lightrft.data.io.DataError`): this module imports those
processors, so the two cannot be one module without a cycle.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightrft.data import media as registry
from lightrft.data.io import DataError, PathLike, Records, load_records
from lightrft.data.media import Media, MediaOptions
from lightrft.data.templates import IGNORE_INDEX

Truncation = Literal["truncate", "drop"]


def check_truncation(truncation: str, allowed: Sequence[str] = ("truncate", "drop")) -> None:
    """Raise a ``ValueError`` naming the ``allowed`` values (a :data:`Truncation` unless given)
    unless ``truncation`` is one of them."""
    if truncation not in allowed:
        names = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"truncation must be {names}, got {truncation!r}")


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


# A sample's media as loaded, before processing into a Media: kind -> its decoded items (PIL
# images, waveforms, sampled videos) in placeholder order; None for a sample without media.
DecodedMedia = dict[str, list[Any]]


def _kind(name: str):
    """The processor class of a kind (read from :data:`~lightrft.data.media.PROCESSORS` at each
    call: the one list of kinds)."""
    return next(p for p in registry.PROCESSORS if p.kind == name)


def _a(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


class MediaSamples:
    """The media side of a dataset (and of a multimodal reward model or judge): finds a record's
    media of every kind, loads them (failing at load with file, line and field), processes them
    and expands the placeholders of its ids, one path for all kinds.

    Which kinds it takes follows the processor (each kind's ``takes``: an ``image_processor``
    takes images, a Qwen2-VL / Qwen2.5-VL processor videos too, a ``feature_extractor`` audio);
    ``options``: the ``media`` section (:class:`~lightrft.data.media.MediaOptions`; None: the
    defaults), whose options of a kind the processor does not take are refused, naming the
    key (``given``: what the model is, for that message).
    """

    def __init__(self, processor, options: MediaOptions | None = None, given: str = "") -> None:
        options = (options or registry.MediaOptions()).checked("media.")
        model = "a tokenizer" if processor is None else type(processor).__name__
        options.check_model(processor, given or f"the dataset was given {model}")
        self.processors = {
            p.kind: p(processor, getattr(options, p.kind))
            for p in registry.PROCESSORS
            if p.takes(processor)
        }
        self.fields = {p.kind: getattr(options, p.kind).field for p in registry.PROCESSORS}
        self.kinds = list(self.processors)
        self.audio = self.processors.get("audio")
        self.video = self.processors.get("video")

    def check_record(self, src: Records, i: int) -> None:
        """Refuse a record whose field holds media of a kind the model does not take."""
        for kind, field in self.fields.items():
            if kind not in self.processors and src[i].get(field):
                model = (
                    "a tokenizer"
                    if not self.kinds
                    else f"a processor for {' and '.join(k + 's' for k in self.kinds)} only"
                )
                raise DataError(
                    f"{src.where(i)}: the record has {kind}s, but the dataset was built with "
                    f"{model} (field {field!r}): {_kind(kind).needs} model's processor is needed"
                )

    def messages(self, src: Records, i: int, msgs: list[dict[str, Any]]):
        """``(messages with media parts, its DecodedMedia or None)`` of record ``i``.

        Raises:
            AudioTooLong: the record's audio is over the maximum and
                ``media.audio.overlong="drop"``.
        """
        where = src.where(i)
        self.check_record(src, i)
        if not self.kinds:
            # Text models: "<image>" in a string is just text, but content parts are an error.
            if any(not isinstance(m["content"], str) for m in msgs):
                raise DataError(
                    f"{where}: content parts (lists) need a multimodal model's processor"
                )
            return msgs, None
        msgs, raw = record_media(src[i], msgs, {k: self.fields[k] for k in self.kinds}, where)
        if not any(raw.values()):
            return msgs, None
        # Messages name where a kind's media came from: its field, or inline "content" parts.
        label = {k: f if src[i].get(f) else "content" for k, f in self.fields.items()}
        base = src.base_dir(i)
        return msgs, {
            kind: self.processors[kind].load(values, base_dir=base, where=where, field=label[kind])
            for kind, values in raw.items()
            if values
        }

    def raw_mode(self, src: Records, i: int) -> None:
        """Raw (template-free) records cannot place media tokens: refuse their media."""
        for kind, field in self.fields.items():
            if src[i].get(field):
                raise DataError(
                    f"{src.where(i)}: field {field!r}: {kind}s need apply_chat_template=true "
                    f"(the chat template places the {kind} tokens)"
                )

    def process(self, media: DecodedMedia) -> Media:
        """Pixel values / video patches / audio features of a sample's decoded media."""
        return registry.Media(**{k: self.processors[k].process(v) for k, v in media.items() if v})

    def with_media(self, item: dict[str, Any], media: DecodedMedia | None) -> dict[str, Any]:
        """A dataset item with its media processed under ``"media"`` (``item`` itself without
        media). Datasets process on access: the pixel values and audio features of a whole
        dataset would not fit in memory."""
        return item if media is None else {**item, "media": self.process(media)}

    def expand(
        self, ids: list[int], labels, media: DecodedMedia | None, where: str
    ) -> tuple[list[int], Any, Media | None]:
        """Process the sample's media and expand its placeholders; a multimodal sample without
        media of a kind must hold no placeholder of that kind (the forward would find none)."""
        done = self.process(media) if media is not None else registry.Media()
        for kind, proc in self.processors.items():
            inputs = getattr(done, kind)
            counts = inputs.num_tokens if inputs is not None else []
            ids, labels = expand_placeholders(ids, labels, proc, counts, where, self.fields[kind])
        return ids, labels, done if media is not None else None

    def kept_all(self, full: list[int], cut: list[int]) -> bool:
        """Whether ``cut`` (a truncation of ``full``) still holds every media token of
        ``full``: a sample that lost some cannot be forwarded (the model finds fewer tokens
        than its images and audio give)."""
        ids = {p.token_id for p in self.processors.values()}
        return sum(t in ids for t in cut) == sum(t in ids for t in full)

    def report(
        self, log: logging.Logger, source: str, stats: dict, noun: str, audio_dropped, cut=None
    ):
        """Add the video and audio counts to a dataset's ``stats`` (``video_clipped`` with a
        video processor, ``audio_clipped`` and ``audio_dropped`` with an audio one) and warn on
        the dataset's ``log`` of the clipped videos, the ``noun``s (prompts, samples) dropped for
        audio and, given ``cut`` (``"max_length=N truncated"``), those cut at the length limit,
        as ``stats`` counts them."""
        if self.video is not None:
            stats["video_clipped"] = self.video.clipped
            if self.video.clipped:
                log.warning(
                    "%s: clipped %d video(s) to media.video.max_frames=%d",
                    source,
                    self.video.clipped,
                    self.video.max_frames,
                )
        if self.audio is not None:
            stats.update(audio_clipped=self.audio.clipped, audio_dropped=audio_dropped)
            if audio_dropped:
                why = f"with audio over media.audio.max_seconds={self.audio.max_seconds:g}"
                log.warning("%s: dropped %d %s %s", source, audio_dropped, noun, why)
        if cut is not None and (stats["truncated"] or stats["dropped"]):
            counts = (stats["truncated"], stats["dropped"], stats["records"])
            log.warning("%s: %s %d and dropped %d of %d %s", source, cut, *counts, noun)


def expand_placeholders(
    ids: list[int], labels: list[int] | None, proc, counts: Sequence[int], where: str, field: str
) -> tuple[list[int], list[int] | None]:
    """Repeat the k-th placeholder token of ``proc``'s kind (its ``token_id``) ``counts[k]``
    times (labels: -100), the layout the model's forward expects for its k-th item of that kind.

    Raises:
        DataError: the rendered ids hold more or fewer placeholders than there are media items,
            or a placeholder sits in a trained (assistant) position.
    """
    kind, token_id = proc.kind, proc.token_id
    found = sum(1 for t in ids if t == token_id)
    if found != len(counts):
        raise DataError(
            f"{where}: {field}: {len(counts)} {kind}(s) but the rendered prompt has {found} "
            f"{kind} placeholder(s) ({proc.token!r}); give one {kind} part "
            f'({{"type": "{kind}"}}) or {proc.tag} tag per {kind}'
        )
    given = labels if labels is not None else [IGNORE_INDEX] * len(ids)  # a prompt: no labels
    out_ids: list[int] = []
    out_labels: list[int] = []
    copies = iter(counts)  # the k-th placeholder's copies
    for t, lab in zip(ids, given, strict=True):
        if t == token_id and lab != IGNORE_INDEX:
            raise DataError(
                f"{where}: {field}: {_a(kind)} {kind} in an assistant turn; {kind} parts go in "
                "user turns"
            )
        n = next(copies) if t == token_id else 1
        out_ids += [t] * n
        out_labels += [lab] * n
    return out_ids, out_labels if labels is not None else None


def record_media(
    rec: Mapping[str, Any],
    messages: list[dict[str, Any]],
    fields: dict[str, str],
    where: str,
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The messages with media parts, and the record's raw media per kind in placeholder order.

    ``fields`` maps each kind the model's processor takes (``"image"``, ``"video"``,
    ``"audio"``) to the record field holding that kind's list. Media come from that field (a
    list, or one value) or inline in parts (``{"type": "image", "image": ...}``,
    ``{"type": "video", "video": ...}``, ``{"type": "audio", "audio": ...}``: each kind's
    ``inline`` keys), not both. String contents are split at the kinds' tags (``<image>``,
    ``<video>``, ``<audio>``) into parts.

    Raises:
        DataError: media both in the field and inline, a different number of media than parts,
            or a part of a kind the model does not take.
    """
    every = [p.kind for p in registry.PROCESSORS]
    taken = [k for k in every if k in fields]
    inline: dict[str, list[Any]] = {k: [] for k in taken}
    n_parts = dict.fromkeys(taken, 0)
    tags = {_kind(k).tag: k for k in taken}
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            if not any(t in content for t in tags):
                out.append(m)
                continue
            # Text parts split at the kinds' tags, each tag a part of its kind.
            pieces = re.split("(" + "|".join(map(re.escape, tags)) + ")", content)
            content = [
                {"type": tags[p]} if p in tags else {"type": "text", "text": p} for p in pieces if p
            ]
        parts = []
        for part in content:
            kind = part.get("type")
            if kind in every and kind not in taken:
                takes = " and ".join(f"{k}s" for k in taken)
                raise DataError(
                    f"{where}: {_a(kind)} {kind} part, but the model's processor takes {takes} only"
                )
            if kind in taken:
                n_parts[kind] += 1
                keys = _kind(kind).inline
                src = next((part[k] for k in keys if part.get(k) is not None), None)
                if src is not None and kind == "video" and part.get("fps") is not None:
                    src = {"video": src, "fps": part["fps"]}  # a frame list's own rate
                if src is not None:
                    inline[kind].append(src)
                part = {"type": kind}
            parts.append(part)
        out.append({**m, "content": parts})
    media: dict[str, list[Any]] = {}
    for kind in taken:
        field = fields[kind]
        raw = rec.get(field)  # a list, or one value
        raw = [] if raw is None else list(raw) if isinstance(raw, (list, tuple)) else [raw]
        if raw and inline[kind]:
            raise DataError(
                f"{where}: {kind}s both in field {field!r} and inline in {kind} parts; "
                "give them one way"
            )
        found = raw or inline[kind]
        if len(found) != n_parts[kind]:
            raise DataError(
                f"{where}: field {field!r}: {len(found)} {kind}(s) but the messages have "
                f"{n_parts[kind]} {kind} part(s) (or {_kind(kind).tag} tags); give one per {kind}"
            )
        media[kind] = found
    return out, media
