"""Packing and padding: from samples to the tensors a Hugging Face causal LM takes.

Packed rows hold several samples back to back with ``position_ids`` restarting at 0 for each,
and no ``attention_mask``. With ``use_cache=False``, transformers then derives a block-diagonal
causal mask from the position resets (``masking_utils.find_packed_sequence_indices``; flash
attention uses the resets as sequence boundaries), so no token attends to another sample and each
sample's logits equal those of the sample run alone. Padding at the end of a packed row gets its
own position run (0, 1, ...), so it is one more "sample", with labels -100.

Padded batches (no packing) are right padded, with an ``attention_mask`` and labels -100 on pads.

Every batch also carries ``num_loss_tokens`` (labels != -100), the count a token-mean loss needs.

Multimodal samples carry ``media`` (:class:`~lightrft.data.media.Media`); a packed row and a
batch carry the media of their samples joined in token order under the same key, which the forward
takes as ``media=`` (see :func:`lightrft.models.forward.causal_lm_token_logprobs`).
"""

from __future__ import annotations

import random
from bisect import bisect_left, insort
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from lightrft.config import at_least
from lightrft.data.media import Media
from lightrft.data.sft import SFTDataset
from lightrft.data.templates import IGNORE_INDEX

Item = Mapping[str, Any]


def _cat(items: Sequence[Item]) -> dict[str, Any]:
    """Items back to back: ``input_ids``, ``labels`` and ``position_ids`` (a packed row's own,
    0..L-1 for a single sample), each ``[L]``, and ``media``, the items' media joined in order,
    when any item has some."""
    out = {
        "input_ids": torch.cat([torch.as_tensor(x["input_ids"], dtype=torch.long) for x in items]),
        "labels": torch.cat([torch.as_tensor(x["labels"], dtype=torch.long) for x in items]),
        "position_ids": torch.cat(
            [
                torch.as_tensor(x["position_ids"], dtype=torch.long)
                if "position_ids" in x
                else torch.arange(len(x["input_ids"]))
                for x in items
            ]
        ),
    }
    media = Media.cat([x.get("media") for x in items])
    return out if media is None else {**out, "media": media}


# ------------------------------------------------------------------------------ bin packing


def pack_indices(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    where: Callable[[int], str] | None = None,
) -> list[list[int]]:
    """Group sample indices into rows of at most ``max_tokens`` tokens.

    Samples are visited in a seeded random order (or in order) and each goes to the fullest row
    it still fits in (best fit), else opens a new row; rows keep their samples in visit order.
    Deterministic for given lengths, ``max_tokens`` and ``seed``. A sample longer than
    ``max_tokens`` is an error that counts them and names the first (``where(i)``: where sample
    ``i`` comes from, e.g. the dataset's ``where``).
    """
    at_least("max_tokens", max_tokens, 1)
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"{len(too_long)} samples are longer than max_tokens={max_tokens}, the first is "
            f"sample {i}{f' ({where(i)})' if where else ''} with {lengths[i]} tokens: raise "
            "max_tokens or set the dataset's max_length to at most max_tokens"
        )
    order = list(range(len(lengths)))
    if shuffle:
        random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, row id), sorted
    for i in order:
        n = int(lengths[i])
        k = bisect_left(free, (n, -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            room, row = max_tokens, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            insort(free, (room - n, row))
    return rows


class PackedDataset(torch.utils.data.Dataset):
    """Rows of several samples of ``dataset`` packed up to ``max_tokens`` tokens each.

    Items: ``input_ids``, ``labels`` and ``position_ids`` (restarting at 0 per sample), each a
    LongTensor of the row's length (at most ``max_tokens``; the collator pads). The packing is
    fixed when built (``pack_indices`` with ``seed``); the dataloader shuffles rows per epoch.

    Args:
        dataset: a dataset of ``{"input_ids", "labels"}`` items with a ``lengths`` attribute
            (e.g. :class:`~lightrft.data.SFTDataset`).
        max_tokens: tokens per row.
        shuffle: shuffle samples before packing (else pack in dataset order).
        seed: seed of that shuffle.
    """

    def __init__(self, dataset, max_tokens: int, *, shuffle: bool = True, seed: int = 0) -> None:
        lengths = dataset.lengths
        where = getattr(dataset, "where", None)
        self.rows = pack_indices(lengths, max_tokens, shuffle=shuffle, seed=seed, where=where)
        self.dataset = dataset
        self.stats: dict[str, int | float] = {
            **getattr(dataset, "stats", {}),
            "packed_rows": len(self.rows),
            "pack_fill": sum(lengths) / (len(self.rows) * max_tokens),
        }

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, Any]:
        return _cat([self.dataset[i] for i in self.rows[r]])


def packed_sft_dataset(
    tokenizer, *, max_tokens: int, pack_seed: int = 0, **sft_kwargs: Any
) -> PackedDataset:
    """``PackedDataset(SFTDataset(tokenizer, **sft_kwargs), max_tokens)`` for configs.

    ``max_length`` defaults to ``max_tokens`` so that every kept sample fits a row.
    """
    sft_kwargs.setdefault("max_length", max_tokens)
    return PackedDataset(SFTDataset(tokenizer, **sft_kwargs), max_tokens, seed=pack_seed)


# ------------------------------------------------------------------------------ collators


def _rows_to_batch(
    rows: list[list[Item]], pad_id: int, pad_to_multiple_of: int | None
) -> dict[str, Any]:
    """Concatenate each row's items, right-pad rows to a common length, build the batch."""
    cat = [_cat(row) for row in rows]
    width = max(len(row["input_ids"]) for row in cat)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(cat), width), pad_id, dtype=torch.long)  # [R, T]
    labels = torch.full((len(cat), width), IGNORE_INDEX, dtype=torch.long)  # [R, T]
    # Pads form their own sequence (positions 0, 1, ...) so they never join the last sample.
    position_ids = torch.arange(width).repeat(len(cat), 1)  # [R, T]
    for r, row in enumerate(cat):
        n = len(row["input_ids"])
        input_ids[r, :n], labels[r, :n] = row["input_ids"], row["labels"]
        position_ids[r, :n], position_ids[r, n:] = row["position_ids"], torch.arange(width - n)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "num_loss_tokens": (labels != IGNORE_INDEX).sum(),
    }
    media = Media.cat([row.get("media") for row in cat])  # each row's, joined in order
    return batch if media is None else {**batch, "media": media}


@dataclass
class PackCollator:
    """Pack a micro-batch of samples into rows; already packed rows stay rows of their own.

    Samples (items without ``position_ids``) fill rows in order, a new row opening when the next
    sample would pass ``max_tokens``; with ``max_tokens=None`` they all share one row. Items that
    are packed rows (from :class:`PackedDataset`) are kept as they are, one row each. Output:
    ``input_ids``, ``labels``, ``position_ids`` (each ``[R, T]``) and ``num_loss_tokens``; no
    ``attention_mask``, which is what makes transformers build the per-sample mask.
    """

    pad_id: int
    max_tokens: int | None = None
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        at_least("max_tokens", self.max_tokens, 1)

    def __call__(self, items: Sequence[Item]) -> dict[str, Any]:
        rows: list[list[Item]] = [[x] for x in items if "position_ids" in x]
        samples = [x for x in items if "position_ids" not in x]
        lengths = [len(x["input_ids"]) for x in samples]
        plan = pack_in_order(lengths, self.max_tokens, "the collator's max_tokens")
        rows += [[samples[i] for i in row] for row in plan]
        return _rows_to_batch(rows, self.pad_id, self.pad_to_multiple_of)


@dataclass
class PadCollator:
    """Right-pad samples to the longest one; ``attention_mask`` marks real tokens.

    Output: ``input_ids``, ``labels`` (-100 on pads), ``attention_mask``, ``position_ids``
    (each ``[B, T]``) and ``num_loss_tokens``. Packed rows are refused: with an attention mask
    transformers would let their samples attend to each other.
    """

    pad_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, items: Sequence[Item]) -> dict[str, Any]:
        if any("position_ids" in x for x in items):
            raise ValueError(
                "PadCollator got packed rows (items with position_ids): use packing=true "
                "(PackCollator) so that samples in a row stay separate"
            )
        batch = _rows_to_batch([[x] for x in items], self.pad_id, self.pad_to_multiple_of)
        lengths = torch.tensor([[len(x["input_ids"])] for x in items])  # [B, 1]
        mask = (torch.arange(batch["input_ids"].shape[1]) < lengths).long()  # [B, T]
        batch.update(attention_mask=mask, position_ids=batch["position_ids"] * mask)
        return batch


def pack_or_pad_collator(
    tokenizer_or_pad_id: Any,
    packing: bool = False,
    *,
    max_tokens: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> Callable[[Sequence[Item]], dict[str, Any]]:
    """The collator a recipe needs: :class:`PackCollator` if ``packing`` else :class:`PadCollator`.

    Args:
        tokenizer_or_pad_id: a tokenizer (its pad id, else its eos id, pads) or the pad id.
        packing: pack the micro-batch into rows with per-sample positions.
        max_tokens: packing only: tokens per row (``None``: one row per micro-batch).
        pad_to_multiple_of: round the padded length up (e.g. 8 or 64 for tensor cores).
    """
    pad = tokenizer_or_pad_id
    if not isinstance(pad, int):
        pad = pad.pad_token_id if pad.pad_token_id is not None else pad.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither pad_token nor eos_token to pad with")
    if packing:
        return PackCollator(pad, max_tokens=max_tokens, pad_to_multiple_of=pad_to_multiple_of)
    if max_tokens is not None:
        raise ValueError("max_tokens applies only with packing=true")
    return PadCollator(pad, pad_to_multiple_of=pad_to_multiple_of)


def plan_micro_batches(
    rows: Sequence[int],
    lengths: Sequence[int],
    max_rows: int,
    max_tokens: int | None = None,
    *,
    packing: bool = False,
) -> list[list[int]]:
    """Split ``rows`` (sample indices, in the order given) into micro-batches of at most
    ``max_rows`` samples and, with ``max_tokens``, at most that many model tokens: the sum of the
    lengths when packed, rows x the longest length when padded (padding costs compute too).
    Sort ``rows`` by length first and the budget turns padding into more, fuller micro-batches.
    A sample longer than ``max_tokens`` on its own forms a micro-batch by itself."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = total = 0
    for i in rows:
        n = int(lengths[i])
        size = total + n if packing else (len(cur) + 1) * max(longest, n)
        if not cur or len(cur) >= max_rows or (max_tokens is not None and size > max_tokens):
            cur, longest, total = [], 0, 0  # open the next micro-batch (the first at the start)
            out.append(cur)
        cur.append(i)
        longest, total = max(longest, n), total + n
    return out


def pack_in_order(lengths: Sequence[int], max_tokens: int | None, key: str) -> list[list[int]]:
    """Rows of the samples packed in order, a new row opening when the next would pass
    ``max_tokens`` (None: one row); a sample longer than ``max_tokens`` is an error naming
    ``key`` (the setting), for :class:`PackCollator` and the preference collator."""
    for n in lengths:
        if max_tokens is not None and n > max_tokens:
            raise ValueError(
                f"an item has {n} tokens, more than {key}={max_tokens}: raise it or lower the "
                "dataset's max_length"
            )
    return plan_micro_batches(range(len(lengths)), lengths, len(lengths), max_tokens, packing=True)


@dataclass
class StepCollator:
    """Collate one optimizer step's samples into its micro-batches (a list of batches).

    Without a token budget: consecutive groups of ``max_rows`` samples, in the loader's order.
    With ``max_tokens``: the samples sorted by length, then cut by :func:`plan_micro_batches`,
    so that padding (or, packed, the quadratic attention over one long row) shrinks and each
    micro-batch holds about the same number of tokens. ``collate`` builds each micro-batch
    (:func:`pack_or_pad_collator`'s result, or a preference collator); ``length`` gives a
    sample's model tokens (default: ``len(item["input_ids"])``).
    """

    collate: Callable[[Sequence[Item]], dict[str, Any]]
    max_rows: int
    max_tokens: int | None = None
    _: KW_ONLY
    packing: bool = False
    length: Callable[[Item], int] | None = None

    def __post_init__(self) -> None:
        at_least("max_rows", self.max_rows, 1)
        at_least("max_tokens", self.max_tokens, 1)

    def __call__(self, items: Sequence[Item]) -> list[dict[str, Any]]:
        lengths = [self.length(x) if self.length else len(x["input_ids"]) for x in items]
        # By length under a token budget (a stable sort), else in the loader's order.
        order = sorted(range(len(items)), key=lengths.__getitem__ if self.max_tokens else None)
        plan = plan_micro_batches(
            order, lengths, self.max_rows, self.max_tokens, packing=self.packing
        )
        return [self.collate([items[i] for i in idx]) for idx in plan]


def collate_prompts(items: Sequence[Item]) -> dict[str, list[Any]]:
    """Keep RL prompt items as lists per key (variable-length ids, strings, None references)."""
    if not items:
        return {}
    return {k: [x[k] for x in items] for k in items[0]}
