"""What offline preference training (recipes/dpo.py) shares with any copy of it: the items with
their index, the collator (with KTO's mismatched pairs), sequence log-probs through the fused
kernel, and the reference log-probs precomputed once for a data set and cached with a key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightrft.data.preference import PreferenceCollator
from lightrft.distributed import DistInfo, all_reduce_sum
from lightrft.models.forward import causal_lm_token_logprobs


class IndexedPreferences(torch.utils.data.Dataset):
    """A :class:`~lightrft.data.PreferenceDataset`'s items with their ``index`` (the row of a
    precomputed reference) and, with ``eos``, that token appended to every sequence (plain-text
    data has no end-of-turn: the policy must learn where the answer ends)."""

    def __init__(self, ds: Any, eos: int | None = None):
        self.ds, self.eos = ds, eos

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = dict(self.ds[i], index=i)
        if self.eos is not None:
            end = torch.tensor([self.eos])
            item["sequences"] = [torch.cat([s, end]) for s in item["sequences"]]
        return item

    def tokens(self, i: int) -> tuple[list[torch.Tensor], list[int]]:
        """Item ``i``'s sequences and response starts without loading its media."""
        it = self.ds._items[i] if hasattr(self.ds, "_items") else self.ds[i]
        return list(it["sequences"]), list(it["starts"])


class PairCollator:
    """:class:`~lightrft.data.preference.PreferenceCollator` plus ``index [B]``, ``n_items``
    and ``desirable [B(+extra), K]`` (a pair's chosen, an unpaired example's label); with ``mismatched`` (KTO's reference point) one more sequence per candidate
    after the items': its prompt with the response of the next item's chosen one (the media of
    its own prompt). Those come as extra rows of ``candidates`` after the first ``n_items``."""

    def __init__(
        self, pad_id: int, *, packing: bool = False, max_tokens: int | None = None,
        mismatched: bool = False,
    ) -> None:  # fmt: skip
        self.inner = PreferenceCollator(pad_id, packing=packing, max_tokens=max_tokens)
        self.mismatched = mismatched

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        extra = []
        for b, it in enumerate(items if self.mismatched else ()):
            nxt = items[(b + 1) % len(items)]
            answer = nxt["sequences"][0][nxt["starts"][0] :]
            seqs = [
                torch.cat([s[: it["starts"][k]], answer]) for k, s in enumerate(it["sequences"])
            ]
            extra.append({**it, "sequences": seqs})
        batch = self.inner([{**it, "head": None} for it in (*items, *extra)])  # DPO: no heads
        des = torch.zeros(batch["candidates"].shape, dtype=torch.bool)  # [B(+extra), K]
        for b, it in enumerate(items):  # pairs: the chosen; unpaired (KTO): the label
            flags = it.get("desirable", [True] + [False] * (len(it["sequences"]) - 1))
            des[b, : len(flags)] = torch.tensor(flags)
        batch["desirable"] = des
        batch["n_items"] = len(items)
        batch["index"] = torch.tensor([it["index"] for it in items], dtype=torch.long)  # [B]
        return batch


def sequence_logprobs(
    model: torch.nn.Module, batch: dict[str, Any], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of every sequence's response tokens and their counts, ``[N]`` each
    (fp32), from a :class:`PairCollator` batch; the logits never materialise."""
    ids, seg = batch["input_ids"].to(device), batch["segment_ids"].to(device)  # [R, T]
    targets = torch.where(batch["scored"][:, 1:].to(device), ids[:, 1:], -100)  # [R, T-1]
    mask = batch.get("attention_mask")
    lp = causal_lm_token_logprobs(
        model,
        ids,
        targets=targets,
        position_ids=batch["position_ids"].to(device),
        attention_mask=None if mask is None else mask.to(device),
        media=batch.get("media"),
    )  # [R, T-1]
    n = int(batch["candidates"].max()) + 1
    keep = targets != -100  # [R, T-1]
    owner = seg[:, 1:][keep]  # the sequence of each scored token
    sums = torch.zeros(n, device=lp.device, dtype=lp.dtype).index_add(0, owner, lp[keep])  # [N]
    counts = torch.zeros(n, device=lp.device).index_add(0, owner, torch.ones_like(lp[keep]))
    return sums, counts


def reference_cache_key(model_path: str | Path, ds: IndexedPreferences, *extra: Any) -> str:
    """A key that changes with the reference checkpoint's files (names, sizes, mtimes), the
    data set's tokens and response starts, and ``extra`` (e.g. dtype, LoRA)."""
    h = hashlib.sha256(repr(extra).encode())
    root = Path(model_path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else ():
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    for i in range(len(ds)):
        seqs, starts = ds.tokens(i)
        for s, start in zip(seqs, starts, strict=True):
            h.update(s.numpy().tobytes() + int(start).to_bytes(4, "little"))
    return h.hexdigest()


@torch.no_grad()
def precompute_reference(
    ds: IndexedPreferences,
    collate: PairCollator,
    ref_fn: Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]],
    *,
    batch_size: int,
    dist: DistInfo,
    path: Path,
    key: str,
) -> torch.Tensor:
    """``[items, K, 2]`` (summed log-prob, token count) of every sequence of ``ds`` under the
    reference (``ref_fn(batch) -> (sums, counts)``), read from ``path`` when its key matches.
    Each rank of ``dist`` computes its share in the same number of forwards (FSDP is
    collective); the shares are summed over ranks; the main rank writes the file."""
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("key") == key:
            return saved["table"]
    n = len(ds)
    table = torch.zeros(n, max(len(ds.tokens(i)[0]) for i in range(n)), 2, dtype=torch.float64)
    mine = list(range(dist.rank, n, dist.world_size))
    per_rank = -(-n // dist.world_size)
    padded = mine + mine[-1:] * (per_rank - len(mine))
    for lo in range(0, per_rank, batch_size):
        idx = padded[lo : lo + batch_size]
        batch = collate([ds[i] for i in idx])
        sums, counts = (x.double().cpu() for x in ref_fn(batch))
        for b, i in enumerate(idx[: len(mine) - lo]):  # the padding repeats an item: once
            c = batch["candidates"][b]
            c = c[c >= 0]
            table[i, : len(c), 0], table[i, : len(c), 1] = sums[c], counts[c]
    table = all_reduce_sum(table).float()
    if dist.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "table": table}, path)
    return table


def kto_reference_point(
    policy: torch.Tensor, ref: torch.Tensor, mismatched: torch.Tensor
) -> torch.Tensor:
    """KTO's ``z`` over all ranks: the mean of ``policy - ref`` (sequence log-probs ``[N]``) of
    the mismatched sequences (``mismatched``: their indices, -1 where none; any shape), detached
    and clamped at 0. 0-dim."""
    idx = mismatched[mismatched >= 0]
    local = torch.stack(
        [
            (policy[idx] - ref[idx]).detach().sum().double(),
            torch.tensor(float(len(idx)), dtype=torch.float64, device=policy.device),
        ]
    )
    total = all_reduce_sum(local, device=policy.device)
    return (total[0] / total[1].clamp(min=1)).clamp(min=0).to(policy.dtype)
