"""Preference data for reward models: a preferred response and one or more rejected ones.

Record format (field names configurable)::

    {"prompt": str | [messages] (optional),
     "chosen": str | [messages],
     "rejected": str | [messages] | [str | [messages], ...],   # a list: several candidates
     "margin": float (optional), "head": str (optional),
     "chosen_safe": bool (optional), "rejected_safe": bool | [bool, ...] (optional),
     "images": [...] (optional: vision-language reward models; shown with the prompt),
     "audios": [...] (optional: audio-language reward models; heard with the prompt),
     "videos": [...] (optional: Qwen2-VL / Qwen2.5-VL reward models; shown with the prompt)}

Each (prompt, response) is rendered exactly as :class:`lightrft.rewards.RewardModel` renders it
when scoring (:func:`render_for_scoring`), so a trained reward model reads the same tokens in RL.

Bad input follows the rules of the other datasets: a missing or mistyped field names the file,
the line and the field (a missing or undecodable image, audio or video file too); a rejected
response identical to the chosen one is dropped and counted (``stats["identical"]``); sequences longer than
``max_length`` are truncated (keep the start) or dropped, as configured, and counted. A pair that
truncation makes identical, or whose cut would cut media tokens, is dropped too; audio over
``media.audio.max_seconds`` is clipped or its record dropped, as configured, and counted; a video
over ``media.video.max_frames`` is clipped (counted) or refused, as configured.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import torch
from torch.nn.utils.rnn import pad_sequence

from lightrft.config import Bound, check_args
from lightrft.data.audio import AudioTooLong
from lightrft.data.collate import pack_in_order
from lightrft.data.io import DataError, PathLike, Records, require_field
from lightrft.data.media import Media, MediaOptions, as_processor
from lightrft.data.records import (
    DecodedMedia,
    MediaSamples,
    Truncation,
    check_truncation,
    open_records,
)
from lightrft.data.templates import IGNORE_INDEX, check_messages, encode_chat, prompt_turns

log = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, Any]]


def render_for_scoring(
    tokenizer, prompt: Prompt | None, response: Prompt, *, chat_template: bool = True
) -> str:
    """The text a reward model reads for one (prompt, response).

    With the chat template, a string prompt is one user turn (a list is the conversation so far)
    and a string response the assistant turn (a list is appended as messages). Without it, the
    texts are concatenated as given (string prompts and responses only).
    """
    if not chat_template:
        if not isinstance(prompt, (str, type(None))) or not isinstance(response, str):
            raise ValueError("chat_template=False needs string prompts and responses")
        return (prompt or "") + response
    messages = prompt_turns(prompt)
    if isinstance(response, str):
        messages.append({"role": "assistant", "content": response})
    else:
        messages.extend(dict(m) for m in response)
    return tokenizer.apply_chat_template(messages, tokenize=False)


def response_start(
    tokenizer, prompt: Prompt | None, ids: Sequence[int], *, chat_template: bool = True
) -> int:
    """Index of the first response token in ``ids``, the tokens of
    :func:`render_for_scoring` (``tokenizer, prompt, <response>``): the length of the longest
    common prefix of ``ids`` and the rendered prompt's tokens (the prompt alone, or with the chat
    template its turns and the assistant header), at least 1 (the first token has nothing to be
    predicted from). The ``likelihood`` reward pooling scores the tokens from here on.
    """
    prefix = prompt or ""  # without the template a string, as render_for_scoring requires
    if prompt is not None and chat_template:
        prefix = tokenizer.apply_chat_template(
            prompt_turns(prompt), tokenize=False, add_generation_prompt=True
        )
    head = tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
    return max(len(os.path.commonprefix([list(head), list(ids)])), 1)


def encode_with_media(
    tokenizer, media: MediaSamples, src: Records, i: int, prompt: Prompt | None, responses: list
) -> tuple[list[list[int]], list[int], DecodedMedia | None]:
    """Record ``i``'s candidates for a multimodal model: the token ids of ``prompt`` (its images,
    audio and videos from the record's media fields or inline in its media parts) followed by each
    response as the assistant turn, media placeholders expanded; each response's start (its
    first label, after the labels of the prompt's own assistant turns); and the decoded media
    every candidate shares (``None`` without). Preference data and
    :class:`~lightrft.rewards.RewardModel` encode through this one function, so a reward model
    scores what it was trained on.

    Raises:
        AudioTooLong: the record's audio is over the maximum and ``media.audio.overlong="drop"``.
    """
    where = src.where(i)
    turns, decoded = media.messages(src, i, prompt_turns(prompt))
    # Every assistant turn is one run of labels; the prompt's own come before the response's.
    earlier = sum(1 for m in turns if m["role"] == "assistant")
    ids, starts = [], []
    for r in responses:
        reply = [{"role": "assistant", "content": r}] if isinstance(r, str) else list(r)
        seq, labels = encode_chat(tokenizer, [*turns, *reply], where)
        seq, labels, _ = media.expand(seq, labels, decoded, where)
        runs = [
            k
            for k, lab in enumerate(labels)
            if lab != IGNORE_INDEX and (k == 0 or labels[k - 1] == IGNORE_INDEX)
        ]
        ids.append(seq)
        starts.append(max(runs[earlier] if len(runs) > earlier else len(seq), 1))
    return ids, starts, decoded


def _text_or_messages(value: Any, where: str, field: str, optional: bool = False) -> Prompt | None:
    """A record's prompt or response (``field``): a string or a checked message list (None for
    an ``optional`` one that is absent), else a :class:`DataError` naming the field."""
    if isinstance(value, str) or (value is None and optional):
        return value
    if isinstance(value, list):
        return check_messages(value, where, field)
    raise DataError(
        f"{where}: field {field!r} must be a string or a message list, got {type(value).__name__}"
    )


def _required(src: Records, i: int, field: str) -> Prompt:
    """Record ``i``'s response ``field``, which must be there: :func:`_text_or_messages`."""
    value = require_field(src, i, field, (str, list))
    return _text_or_messages(value, src.where(i), field)  # type: ignore[return-value]


def _need_template(tokenizer, apply_chat_template: bool, what: str) -> None:
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: set apply_chat_template=false to score "
            f"prompt + {what} as plain text"
        )


class PreferenceDataset(torch.utils.data.Dataset):
    """Tokenised preference records.

    Item ``i``: ``{"sequences": [LongTensor chosen, LongTensor rejected_1, ...], "margin": float,
    "head": str | None, "safe": [int per sequence], "starts": [int per sequence]}`` with ``safe``
    +1 (safe), -1 (unsafe) or 0 (unlabelled), used by cost heads, and ``starts`` each sequence's
    first response token (:func:`response_start`).

    Args:
        tokenizer: a Hugging Face tokenizer (the recipe passes its own as first argument).
        path, split, records: the data, as for :class:`~lightrft.data.SFTDataset`.
        prompt_field, chosen_field, rejected_field, margin_field, head_field: field names.
        chosen_safe_field, rejected_safe_field: safety labels (Safe-RLHF style cost models).
        media: the pair's images, audio and videos (:class:`~lightrft.data.media.MediaOptions`,
            as for :class:`~lightrft.data.SFTDataset`), shown with the prompt to every
            candidate. They need a model's processor that takes them as ``tokenizer`` and the
            chat template; a text tokenizer refuses them with the file and line. Give the reward
            model in RL the same options (:class:`~lightrft.rewards.RewardModel`), so it sees
            media as in training.
        apply_chat_template: render with the tokenizer's chat template (as the reward model
            will score in RL); ``False`` concatenates prompt and response.
        max_length: longest sequence in tokens; ``None`` for no limit.
        truncation: ``"truncate"`` (keep the first ``max_length`` tokens) or ``"drop"``.
    """

    def __init__(
        self,
        tokenizer,
        path: PathLike | Sequence[PathLike] | None = None,
        *,
        split: str | None = None,
        records: Sequence[Mapping[str, Any]] | None = None,
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        margin_field: str = "margin",
        head_field: str = "head",
        chosen_safe_field: str = "chosen_safe",
        rejected_safe_field: str = "rejected_safe",
        media: MediaOptions | None = None,
        apply_chat_template: bool = True,
        max_length: Annotated[int | None, Bound(ge=1)] = None,
        truncation: Truncation = "truncate",
    ) -> None:
        check_truncation(truncation)
        tokenizer, processor = as_processor(tokenizer)
        self.media = MediaSamples(processor, media)
        check_args(PreferenceDataset.__init__, max_length=max_length)
        _need_template(tokenizer, apply_chat_template, "response")
        self.tokenizer = tokenizer
        self.chat_template = apply_chat_template
        src = open_records(path, records, split)
        self.source = src.name
        self._items: list[dict[str, Any]] = []
        self._media: list[DecodedMedia | None] = []  # each item's decoded images, audio, videos
        self._origins: list[str] = []
        identical = truncated = dropped = audio_dropped = 0
        for i in range(len(src)):
            rec, where = src[i], src.where(i)
            self.media.check_record(src, i)
            if not apply_chat_template:
                self.media.raw_mode(src, i)  # media tokens need the template
            prompt = _text_or_messages(rec.get(prompt_field), where, prompt_field, optional=True)
            chosen = _required(src, i, chosen_field)
            raw_rej = require_field(src, i, rejected_field, (str, list))
            # Several candidates: a list of strings or of message lists (not one message list).
            many = isinstance(raw_rej, list) and raw_rej and not isinstance(raw_rej[0], Mapping)
            rejected = raw_rej if many else [raw_rej]
            rejected = [_text_or_messages(r, where, rejected_field) for r in rejected]
            margin = rec.get(margin_field)
            if margin is not None and (
                isinstance(margin, bool) or not isinstance(margin, (int, float))
            ):
                raise DataError(f"{where}: field {margin_field!r} must be a number, got {margin!r}")
            head = rec.get(head_field)
            if head is not None and not isinstance(head, str):
                raise DataError(f"{where}: field {head_field!r} must be a string, got {head!r}")
            safe = [_safe_sign(rec.get(chosen_safe_field), where, chosen_safe_field)]
            raw_safe = rec.get(rejected_safe_field)
            safe_list = raw_safe if isinstance(raw_safe, list) else [raw_safe] * len(rejected)
            if len(safe_list) != len(rejected):
                raise DataError(
                    f"{where}: field {rejected_safe_field!r} has {len(safe_list)} labels for "
                    f"{len(rejected)} rejected responses"
                )
            safe += [_safe_sign(s, where, rejected_safe_field) for s in safe_list]

            media = None
            if self.media.kinds:  # a multimodal processor: media ride the chat path
                try:
                    ids, starts, media = encode_with_media(
                        self.tokenizer, self.media, src, i, prompt, [chosen, *rejected]
                    )
                except AudioTooLong:
                    audio_dropped += 1
                    continue
            else:
                texts = [
                    render_for_scoring(tokenizer, prompt, r, chat_template=apply_chat_template)
                    for r in [chosen, *rejected]
                ]
                ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
                starts = [
                    response_start(tokenizer, prompt, s, chat_template=apply_chat_template)
                    for s in ids
                ]
            # A rejected response the model would read as the chosen one is dropped.
            keep = [0] + [k for k in range(1, len(ids)) if ids[k] != ids[0]]
            ids, starts = [ids[k] for k in keep], [starts[k] for k in keep]
            identical += 1 + len(rejected) - len(keep)
            if len(keep) == 1:
                continue
            if any(len(s) == 0 for s in ids):
                raise DataError(f"{where}: a response renders to no tokens")
            if max_length is not None and any(len(s) > max_length for s in ids):
                if truncation == "drop":
                    dropped += 1
                    continue
                n_long = sum(len(s) > max_length for s in ids)
                full, ids = ids, [s[:max_length] for s in ids]
                if all(s == ids[0] for s in ids[1:]) or not all(
                    self.media.kept_all(f, s) for f, s in zip(full, ids, strict=True)
                ):
                    # They differ only after max_length (nothing to learn), or media is cut.
                    dropped += 1
                    continue
                truncated += n_long
            self._items.append(
                {
                    "sequences": [torch.tensor(s, dtype=torch.long) for s in ids],
                    "starts": starts,
                    "margin": float(margin or 0.0),
                    "head": head,
                    "safe": [safe[k] for k in keep],
                }
            )
            self._media.append(media)
            self._origins.append(where)
        if not self._items:
            audio = (
                f", {audio_dropped} with audio over media.audio.max_seconds"
                if audio_dropped
                else ""
            )
            raise DataError(
                f"empty dataset: all {len(src)} records of {self.source} were dropped "
                f"({identical} identical responses, {dropped} too long with max_length="
                f"{max_length}, truncation={truncation!r}{audio})"
            )
        self.stats: dict[str, int] = {
            "records": len(src),
            "pairs": len(self._items),
            "identical": identical,
            "truncated": truncated,
            "dropped": dropped,
        }
        n_videos = sum(len(m.get("video") or ()) for m in self._media if m)
        if n_videos:
            self.stats["videos"] = n_videos
        if identical:
            why = "rejected responses identical to the chosen one"
            log.warning("%s: dropped %d %s", self.source, identical, why)
        cut = f"max_length={max_length} truncated (sequences)"
        self.media.report(log, self.source, self.stats, "records", audio_dropped, cut)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        # Every candidate is shown the same images and videos and hears the same audio.
        return self.media.with_media(self._items[i], self._media[i])

    @property
    def heads(self) -> list[str | None]:
        """The head label of every item (``None``: unlabelled)."""
        return [it["head"] for it in self._items]

    def where(self, i: int) -> str:
        """The file and line (or row) item ``i`` came from."""
        return self._origins[i]


def _safe_sign(value: Any, where: str, field: str) -> int:
    if value is None:
        return 0
    if not isinstance(value, bool):
        raise DataError(f"{where}: field {field!r} must be true or false, got {value!r}")
    return 1 if value else -1


def pad_sequences(
    seqs: Sequence[torch.Tensor],
    pad_id: int,
    side: str = "right",
    starts: Sequence[int] | None = None,
    rows: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """One sequence per row, padded on ``side``: ``input_ids``, ``attention_mask``,
    ``position_ids`` (from the mask, so both sides give the same positions) and ``segment_ids``
    (the row index on real tokens, -1 on padding), each ``[N, T]``; with ``starts`` (each
    sequence's first response token) also ``scored`` (true on response tokens).

    With ``rows`` (lists of sequence indices), each row instead holds its sequences back to back
    (``segment_ids``: the sequence index), positions restarting at 0 for each, right-padded, and
    no ``attention_mask``: transformers keeps packed sequences apart by their position resets."""
    packed = rows is not None
    rows = rows if rows is not None else [[n] for n in range(len(seqs))]
    width = max(sum(len(seqs[n]) for n in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [R, T]
    seg = torch.full((len(rows), width), -1, dtype=torch.long)  # [R, T]
    positions = torch.zeros((len(rows), width), dtype=torch.long)  # [R, T]
    for r, row in enumerate(rows):
        col = 0 if side == "right" else width - sum(len(seqs[n]) for n in row)
        for n in row:
            L = len(seqs[n])
            ids[r, col : col + L] = torch.as_tensor(seqs[n], dtype=torch.long)
            seg[r, col : col + L] = n
            positions[r, col : col + L] = torch.arange(L)
            col += L
        # Padding is its own position run, so it never joins the last sequence.
        positions[r, col:] = torch.arange(width - col)
    out = {"input_ids": ids, "position_ids": positions, "segment_ids": seg}
    if not packed:
        mask = (seg >= 0).long()  # [N, T]
        out["attention_mask"] = mask
        out["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)  # 0 at each first real token
    if starts is not None:  # a real token at or after its sequence's start
        first = torch.as_tensor(starts, dtype=torch.long)[seg.clamp(min=0)]  # [R, T]
        out["scored"] = (seg >= 0) & (positions >= first)
    return out


def item_tokens(item: Mapping[str, Any], padded: bool = False) -> int:
    """A preference item's tokens in a micro-batch: all its sequences when packed; ``padded``,
    its sequences x its longest (per item; the micro-batch's rows are then padded to the longest
    of all)."""
    lens = [len(s) for s in item["sequences"]]
    return len(lens) * max(lens) if padded else sum(lens)


class PreferenceCollator:
    """Flatten a micro-batch of preference items into sequences, padded or packed.

    Output (``N`` sequences in ``R`` rows of ``T`` tokens, ``B`` items of at most ``K``
    candidates, the chosen one first):

    - ``input_ids``, ``position_ids``, ``segment_ids`` ``[R, T]``: ``segment_ids`` is the
      sequence index of each token, -1 on padding; pooling reads it.
    - ``attention_mask`` ``[R, T]``, padded batches only (packed rows have none: transformers
      then keeps packed sequences apart by their position resets).
    - ``scored`` ``[R, T]``: true on response tokens (what the ``likelihood`` pooling scores).
    - ``media``: the sequences' media joined in sequence order (a
      :class:`~lightrft.data.media.Media`), when any item has some.
    - ``candidates`` ``[B, K]``: sequence index of each candidate, -1 where an item has fewer.
    - ``margin`` ``[B]``, ``safe`` ``[B, K]`` (+1 / -1 / 0), ``head`` ``[B]`` (index into
      ``heads``; unlabelled items go to the first head).

    Args:
        pad_id: the padding token id.
        heads: head names, in the order of the model's outputs.
        packing: pack sequences into rows of at most ``max_tokens`` (``None``: one row);
            otherwise one sequence per row, right-padded.
    """

    def __init__(
        self,
        pad_id: int,
        heads: Sequence[str] = ("reward",),
        *,
        packing: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        if not packing and max_tokens is not None:
            raise ValueError("max_tokens applies only with packing=true")
        self.pad_id = int(pad_id)
        self.heads = {name: k for k, name in enumerate(heads)}
        self.packing = packing
        self.max_tokens = max_tokens

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        for it in items:
            if it["head"] is not None and it["head"] not in self.heads:
                raise ValueError(
                    f"a pair is labelled for head {it['head']!r}; heads are {list(self.heads)}"
                )
        seqs = [s for it in items for s in it["sequences"]]
        rows = None
        if self.packing:
            rows = pack_in_order([len(s) for s in seqs], self.max_tokens, "max_tokens_per_row")
        starts = [x for it in items for x in it["starts"]]
        batch = pad_sequences(seqs, self.pad_id, starts=starts, rows=rows)
        # An item's sequences are consecutive: their indices, -1 where an item has fewer.
        indices = torch.arange(len(seqs)).split([len(it["sequences"]) for it in items])
        safe = [torch.tensor(it["safe"], dtype=torch.long) for it in items]
        batch.update(
            candidates=pad_sequence(list(indices), batch_first=True, padding_value=-1),  # [B, K]
            safe=pad_sequence(safe, batch_first=True),  # [B, K]
            margin=torch.tensor([float(it["margin"]) for it in items]),  # [B]
            head=torch.tensor([self.heads.get(it["head"], 0) for it in items]),  # [B]
        )
        # In sequence order, as the rows hold them.
        joined = Media.cat([it.get("media") for it in items for _ in it["sequences"]])
        if joined is not None:
            batch["media"] = joined
        return batch


class UnpairedPreferenceDataset(PreferenceDataset):
    """Unpaired preference data for KTO: one response per record, labelled desirable or not.

    Record: ``{"prompt": str | [messages] (optional), "completion": str | [messages],
    "label": true | false}``. A record without a boolean label is refused with the file, the line
    and the field, before any model loads. Items look like :class:`PreferenceDataset`'s with one
    sequence and ``"desirable": [label]``. Text only (records with media are refused); rendered
    as :class:`PreferenceDataset` renders a candidate, truncated (kept start) or dropped past
    ``max_length``. Its length, ``where`` and ``heads`` are :class:`PreferenceDataset`'s.
    """

    def __init__(  # builds its own items (no super().__init__); shares the accessors
        self,
        tokenizer,
        path: PathLike | Sequence[PathLike] | None = None,
        *,
        split: str | None = None,
        records: Sequence[Mapping[str, Any]] | None = None,
        prompt_field: str = "prompt",
        completion_field: str = "completion",
        label_field: str = "label",
        apply_chat_template: bool = True,
        max_length: Annotated[int | None, Bound(ge=1)] = None,
        truncation: Truncation = "truncate",
    ) -> None:
        check_truncation(truncation)
        check_args(UnpairedPreferenceDataset.__init__, max_length=max_length)
        tokenizer, _ = as_processor(tokenizer)
        _need_template(tokenizer, apply_chat_template, "completion")
        self.tokenizer, self.chat_template = tokenizer, apply_chat_template
        src = open_records(path, records, split)
        self.source = src.name
        self._items: list[dict[str, Any]] = []
        self._origins: list[str] = []
        truncated = dropped = 0
        for i in range(len(src)):
            rec, where = src[i], src.where(i)
            for field in ("images", "audios", "videos"):
                if rec.get(field):
                    raise DataError(f"{where}: field {field!r}: unpaired data is text only")
            label = rec.get(label_field)
            if not isinstance(label, bool):
                raise DataError(
                    f"{where}: field {label_field!r} must be true (desirable) or false "
                    f"(undesirable), got {label!r}: KTO needs every row labelled"
                )
            prompt = _text_or_messages(rec.get(prompt_field), where, prompt_field, optional=True)
            completion = _required(src, i, completion_field)
            text = render_for_scoring(
                tokenizer, prompt, completion, chat_template=apply_chat_template
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            start = response_start(tokenizer, prompt, ids, chat_template=apply_chat_template)
            if max_length is not None and len(ids) > max_length:
                if truncation == "drop" or start >= max_length:
                    dropped += 1
                    continue
                ids, truncated = ids[:max_length], truncated + 1
            self._items.append(
                {"sequences": [torch.tensor(ids, dtype=torch.long)], "starts": [start],
                 "margin": 0.0, "head": None, "safe": [0], "desirable": [label]}
            )  # fmt: skip
            self._origins.append(where)
        if not self._items:
            raise DataError(f"empty dataset: all {len(src)} records of {self.source} were dropped")
        n_good = sum(it["desirable"][0] for it in self._items)
        self.stats: dict[str, int] = {
            "records": len(src),
            "pairs": len(self._items),  # examples; the name the recipes log
            "desirable": n_good,
            "undesirable": len(self._items) - n_good,
            "truncated": truncated,
            "dropped": dropped,
        }

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._items[i]
