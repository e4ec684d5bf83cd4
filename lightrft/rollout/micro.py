"""The micro-batch: rows of a rollout batch laid out as one forward's model inputs, plus the
gather from the model's per-position outputs to the response-aligned ``[b, R]`` layout every
loss uses.

Packed: one row, samples back to back, ``position_ids`` restarting per sample, no attention mask
(transformers builds the block-diagonal causal mask from the position resets). Padded: one
right-padded row per sample with an attention mask. An empty row list gives a dummy micro-batch
(one scored position, mask 0), so a rank without data still runs the same forward / backward
collectives as the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightrft.data.collate import plan_micro_batches
from lightrft.data.media import Media
from lightrft.distributed import DistInfo, all_reduce_max
from lightrft.models.forward import causal_lm_token_logprobs, forward_on_hidden
from lightrft.rollout.batch import IGNORE, RolloutBatch


@dataclass
class MicroBatch:
    """One forward's inputs (``[rows, L]``) and the response gather (``[b, R]``)."""

    input_ids: torch.Tensor  # [rows, L]
    position_ids: torch.Tensor | None  # [rows, L]: packed only
    attention_mask: torch.Tensor | None  # [rows, L]: padded only
    targets: torch.Tensor  # [rows, L-1] next tokens, IGNORE off the responses
    index: torch.Tensor  # [b, R] flat position in [rows, L-1] of each response token
    mask: torch.Tensor  # [b, R] sampled response tokens (observations and padding: False)
    tokens: int = 0  # prompt + response tokens of the real rows
    media: Media | None = None  # the rows' media in row (= token) order

    def to(self, device: torch.device | str) -> MicroBatch:
        """The token tensors on ``device`` (media stay where the model's funnel moves them)."""
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return dataclasses.replace(self, **moved)

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """``[rows, L-1]`` per-position values -> ``[b, R]`` response values, 0 on padding and
        on observation tokens (as the engine's log-probs are)."""
        out = full.reshape(-1)[self.index.to(full.device)]
        return torch.where(self.mask.to(full.device), out, 0.0)

    def logprobs(
        self,
        model: Any,
        device: torch.device,
        *,
        entropy: bool,
        entropy_grad: bool = False,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``model``'s log-prob of each response token (and its entropy, ``entropy``; with a
        gradient: ``entropy_grad``), ``[b, R]``, from the fused linear log-prob kernel (never
        ``[tokens x vocab]`` logits); ``kw``: :func:`~lightrft.models.forward.causal_lm_token_logprobs`'s
        (temperature, grad_hint, sequence_parallel: this rank's slice of the row)."""
        mb = self.to(device)
        out = causal_lm_token_logprobs(
            model, mb.input_ids, targets=mb.targets, attention_mask=mb.attention_mask,
            position_ids=mb.position_ids, return_entropy=entropy, entropy_grad=entropy_grad,
            media=mb.media, **kw,
        )  # fmt: skip
        return (mb.gather(out[0]), mb.gather(out[1])) if entropy else (mb.gather(out), None)

    def values(self, critic: Any, device: torch.device) -> torch.Tensor:
        """The value head's value at each response token, ``[b, R]`` float32."""

        def head(hidden, weight, bias):
            return F.linear(hidden, weight, bias).squeeze(-1).float()  # [rows, L-1]

        mb = self.to(device)
        out = forward_on_hidden(critic, mb.input_ids, head, attention_mask=mb.attention_mask,
                                position_ids=mb.position_ids)  # fmt: skip
        return mb.gather(out)


@dataclass
class LossInputs:
    """One micro-batch as the loss sees it: ``[b, R]`` response-aligned tensors on the device
    (``mask``: sampled response tokens, observations of a multi-turn trajectory left out;
    ``loss_mask``: the tokens the policy loss trains on)."""

    logprobs: torch.Tensor  # current policy, with gradient
    mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    entropy: torch.Tensor | None = None  # with gradient only when the entropy bonus is on
    old_logprobs: torch.Tensor | None = None  # None: exactly on-policy (ratio 1)
    rollout_logprobs: torch.Tensor | None = None  # engine log-probs (TIS only)
    ref_logprobs: torch.Tensor | None = None  # reference model (KL in the loss only)
    values: torch.Tensor | None = None  # critic, with gradient (gae only)
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


@dataclass(frozen=True)
class Counts:
    """Global normalisers of one optimizer step, divided by the world size (gradients are
    averaged over ranks): ``loss`` counts the policy loss's tokens / sequences, ``response``
    every sampled response token / sequence (KL, entropy and value terms). Observation tokens
    of a multi-turn trajectory are in neither: they were not sampled."""

    loss: dict[str, float]
    response: dict[str, float]

    @classmethod
    def of(
        cls, batch: RolloutBatch, rows: list[int], world: int, loss_mask: torch.Tensor | None
    ) -> Counts:
        """The counts of ``batch``'s ``rows`` (an optimizer step's samples) over ``world`` ranks;
        ``loss_mask``: the tokens the policy loss trains on (None: every sampled one)."""
        mask = batch.response_mask[rows]  # [m, R]
        lmask = mask if loss_mask is None else loss_mask[rows]
        return cls(
            loss={
                "num_tokens": int(lmask.sum()) / world,
                "num_seqs": int(lmask.any(dim=1).sum()) / world,
            },
            response={"num_tokens": int(mask.sum()) / world, "num_seqs": len(rows) / world},
        )


def shuffled(n: int, seed: int, shuffle: bool = True) -> list[int]:
    """The order of ``n`` samples in an update: a permutation drawn from ``seed``, or as is."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def build_micro_batch(
    batch: RolloutBatch, idx: list[int], pad_id: int, *, packing: bool
) -> MicroBatch:
    """The micro-batch of rows ``idx`` of ``batch`` (module docstring): packed, one row with
    positions restarting per sample; padded, one right-padded row per sample with an attention
    mask (default positions 0..T-1). No rows: packed [pad] + [pad], one real position that
    keeps the graph connected, its mask 0."""
    prompts = [batch.prompt(i) for i in idx] or [[pad_id]]
    responses = [batch.response(i) for i in idx] or [[pad_id]]
    packing = packing or not idx
    lens = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    rows, length = (1, sum(lens)) if packing else (len(lens), max(lens))
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    pos = torch.zeros(rows, length, dtype=torch.long)
    attention_mask = torch.zeros(rows, length, dtype=torch.long)
    targets = torch.full((rows, length - 1), IGNORE, dtype=torch.long)
    resp = [len(r) for r in responses]
    index = torch.zeros(len(resp), max(resp), dtype=torch.long)  # [b, R]
    mask = torch.arange(max(resp)) < torch.tensor(resp).unsqueeze(1)  # [b, R]
    start = 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        row = 0 if packing else i
        q = p + r
        ids[row, start : start + len(q)] = torch.as_tensor(q)
        pos[row, start : start + len(q)] = torch.arange(len(q))
        attention_mask[row, : len(q)] = 1
        first = start + len(p) - 1  # position predicting response token 0
        cols = torch.arange(first, first + resp[i])
        targets[row, cols] = torch.as_tensor(r)
        index[i, : resp[i]] = row * (length - 1) + cols
        start += len(q) if packing else 0
    if packing:
        mb = MicroBatch(ids, pos, None, targets, index, mask)
    else:
        mb = MicroBatch(ids, None, attention_mask, targets, index, mask)
    if not idx:
        mb.mask[:] = False
        return mb
    # Observation tokens stay in the inputs (context) but out of the mask: no loss, no count.
    mb.mask &= batch.response_mask[idx, : mb.mask.shape[1]]
    mb.media = Media.cat([batch.media[i] for i in idx]) if batch.media else None
    mb.tokens = sum(lens)
    return mb


def rank_micro_batches(
    rows: list[int],
    lengths: list[int],
    micro_batch_size: int,
    micro_batch_tokens: int | None,
    packing: bool,
    dist: DistInfo,
) -> list[list[int]]:
    """This rank's share of ``rows`` (every world_size-th), shortest first, in micro-batches of
    ``micro_batch_size`` rows and ``micro_batch_tokens`` tokens at most (``lengths``: each
    row's prompt + response tokens). Every rank runs as many as the rank with the most (a
    collective when the token budget makes the counts differ): the others add empty ones, which
    :func:`build_micro_batch` turns into dummy passes, so the FSDP collectives of forward and
    backward pair up."""
    mine = sorted(rows[dist.rank :: dist.world_size], key=lambda i: lengths[i])
    plan = plan_micro_batches(mine, lengths, micro_batch_size, micro_batch_tokens, packing=packing)
    count = max(1, len(plan))
    if micro_batch_tokens is None:  # known on every rank without a token budget
        per_rank = -(-len(rows) // dist.world_size)
        count = max(1, -(-per_rank // micro_batch_size))
    elif dist.world_size > 1:
        count = int(all_reduce_max(count, dist.device).item())
    return plan + [[] for _ in range(count - len(plan))]
