"""The typed rollout batch: what one RL step knows about its samples, as padded tensors.

Built once, complete, after rollout (one row per sample, groups of ``n`` consecutive rows), moved
between ranks with tensor collectives and cut into micro-batches; what the trainer computes of it
is its own (:class:`Precomputed`, :class:`Advantages`). Recipes (GRPO today; reward-model and vision recipes
next) share it, so a field means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightrft.distributed import all_gather_objects

if TYPE_CHECKING:
    from lightrft.data.media import Media


IGNORE = -100  # target id of positions without a loss

# Per-sample media: a list with one Media per row (None for a row without), or None for a text
# batch. Not row tensors: Qwen-VL's pixel values are a flat [patches, D] tensor with a different
# patch count per image, so row indexing would cut patches, not samples.


def pad_rows(rows: Sequence[Sequence[float]], *, dtype=torch.float32, fill=0) -> Tensor:
    """Per-sample vectors -> ``[B, max_len]`` tensor right-padded with ``fill`` (width >= 1)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def _select(value: Any, idx: Tensor) -> Any:
    if isinstance(value, Tensor):
        return value[idx]
    if isinstance(value, dict):  # reward_parts / reward_applied: name -> [B] tensor
        return {k: v[idx] for k, v in value.items()}
    return None if value is None else [value[i] for i in idx.tolist()]


@dataclasses.dataclass
class RolloutBatch:
    """``B`` samples; ``R`` = the longest response, ``P`` = the longest prompt.

    Sampled (set when built):
        prompt_ids: ``[B, P]`` long, right-padded with 0; ``prompt_lens`` ``[B]`` long.
        response_ids: ``[B, R]`` long, right-padded with 0: everything after the prompt, in a
        multi-turn trajectory the assistant turns and the observations between them.
        response_lens: ``[B]`` long, the tokens of each response (observations included: the
        forward pass sees them as context; lengths and micro-batch sizes come from here).
        response_mask: ``[B, R]`` bool, True on sampled (assistant) tokens: what the loss, the
        KL, the entropy, the advantages and every normalising count see. Single-turn: the first
        ``response_lens`` tokens; multi-turn: observation tokens are False.
        rollout_logprobs: ``[B, R]`` float32, the engine's log-prob of each sampled token (0 on
        observations).
    Rewards (``[B]`` float64, python-float exact):
        reward_raw: the reward function's total; overlong: the DAPO overlong penalty (None when
        off); rewards: reward_raw + overlong, what the advantages use.
        reward_parts / reward_applied: name -> ``[B]`` float64 / bool, one per reward function.
    Per-sample metadata (lists of length B):
        prompts, references, labels, wheres (dataset file:line), texts (decoded response),
        finish_reasons ("stop" | "length"), groups (a tuple naming the prompt: samples with the
        same group share a prompt; groups are consecutive rows).
        kept: ``[B]`` bool, the sample is in the train batch (dynamic sampling drops groups).
    media: None for a text batch; else one :class:`~lightrft.data.media.Media` per sample (None
        for a sample without); a micro-batch's forward takes ``Media.cat`` of its rows', in order.
    episodes: None for a single-turn batch; else one
        :class:`~lightrft.environments.episode.Episode` per sample (its turns, observations and
        stats, for the ``env/*`` metrics and the trajectory files).
    """

    prompt_ids: Tensor
    prompt_lens: Tensor
    response_ids: Tensor
    response_lens: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    reward_raw: Tensor
    rewards: Tensor
    reward_parts: dict[str, Tensor]
    reward_applied: dict[str, Tensor]
    prompts: list[str]
    references: list[Any]
    labels: list[Any]
    wheres: list[str]
    texts: list[str]
    finish_reasons: list[str]
    groups: list[tuple]
    overlong: Tensor | None = None
    kept: Tensor | None = None
    media: list[Media | None] | None = None
    episodes: list[Any] | None = None

    @classmethod
    def from_completions(
        cls,
        completions: Sequence[Any],
        prompts: dict[str, list],
        *,
        groups: list[tuple],
        **rewards: Any,
    ) -> RolloutBatch:
        """One draw's batch: the engine's completions (a row each), with the fields of the
        prompt each came from (``prompts``: the prompt loader's batch, indexed by each
        completion's ``request_index``, with its ``media`` when it has any), each row's group
        key and the rewards (``reward_raw``, ``rewards``, ``overlong``, ``reward_parts``,
        ``reward_applied``). A multi-turn completion's ``sampled_mask`` becomes the row's
        ``response_mask``; a single-turn one (None) masks its whole response."""
        rows = [c.request_index for c in completions]
        responses = [list(c.token_ids) for c in completions]
        sampled = [c.sampled_mask or [True] * len(c.token_ids) for c in completions]
        meta = {
            f"{k}s": [prompts[k][i] for i in rows]
            for k in ("prompt", "reference", "label", "where")
        }
        return cls(
            prompt_ids=pad_rows([list(c.prompt_token_ids) for c in completions], dtype=torch.long),
            prompt_lens=torch.tensor([len(c.prompt_token_ids) for c in completions]),
            response_ids=pad_rows(responses, dtype=torch.long),
            response_lens=torch.tensor([len(r) for r in responses], dtype=torch.long),
            response_mask=pad_rows(sampled, dtype=torch.bool, fill=False),
            rollout_logprobs=pad_rows([list(c.logprobs) for c in completions]),
            texts=[c.text or "" for c in completions],
            finish_reasons=[c.finish_reason for c in completions],
            groups=groups,
            media=[prompts["media"][i] for i in rows] if prompts.get("media") else None,
            **meta,
            **rewards,
        )

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def prompt(self, i: int) -> list[int]:
        return self.prompt_ids[i, : int(self.prompt_lens[i])].tolist()

    def response(self, i: int) -> list[int]:
        return self.response_ids[i, : int(self.response_lens[i])].tolist()

    def select(self, idx: Sequence[int]) -> RolloutBatch:
        """The rows ``idx`` (in that order), trimmed to their longest prompt and response."""
        t = torch.as_tensor(list(idx), dtype=torch.long)
        fields = {f.name: _select(getattr(self, f.name), t) for f in dataclasses.fields(self)}
        return RolloutBatch(**fields)._trim()

    def _trim(self) -> RolloutBatch:
        r = max(int(self.response_lens.max()) if len(self) else 0, 1)
        p = max(int(self.prompt_lens.max()) if len(self) else 0, 1)
        self.prompt_ids = self.prompt_ids[:, :p]
        for name in ("response_ids", "response_mask", "rollout_logprobs"):
            setattr(self, name, getattr(self, name)[:, :r])
        return self

    @staticmethod
    def cat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Rows of ``batches`` one after the other (fields None in one are None in all, except
        ``media`` and ``episodes``: a batch without gives None entries)."""
        first = batches[0]
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(first):
            values = [getattr(b, f.name) for b in batches]
            if any(isinstance(v, list) for v in values):
                # Per-sample objects that only some batches have (None: none in the batch), media
                # and episodes: a text batch may join a multimodal one, its rows get None entries.
                values = [v or [None] * len(b) for v, b in zip(values, batches, strict=True)]
            if values[0] is None:
                fields[f.name] = None
            elif isinstance(values[0], Tensor):
                fields[f.name] = _cat_padded(values)
            elif isinstance(values[0], dict):
                fields[f.name] = {k: _cat_padded([v[k] for v in values]) for k in values[0]}
            else:
                fields[f.name] = [x for v in values for x in v]
        return RolloutBatch(**fields)

    def all_gather(self) -> RolloutBatch:
        """Every rank's rows, in rank order, on every rank (this batch in one process).

        Each rank's batch travels whole by ``all_gather_object`` (tensors, the per-sample
        metadata and media alike) and the parts are joined by :meth:`cat`, padded to the widest
        rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self
        return RolloutBatch.cat(all_gather_objects(self))._trim()


@dataclasses.dataclass(frozen=True)
class Precomputed:
    """What the trainer computes of a step's samples before its update, ``[B, R]`` float32
    (None when the step needs none): ``old_logprobs`` (the trainer's; None: exactly on-policy,
    ratio 1), ``ref_logprobs`` (reference model, with a KL), ``teacher_logprobs`` (on-policy
    distillation's teacher), ``values`` (critic), ``entropy`` (for high-entropy selection),
    ``keep`` (bool: the tokens ``algorithm.mismatch``'s corrections keep)."""

    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    values: Tensor | None = None
    entropy: Tensor | None = None
    keep: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Advantages:
    """A step's advantages, ``[B, R]`` float32, 0 off the sampled tokens; ``returns``: the value
    targets (gae only); ``loss_mask``: the tokens the policy loss trains on (None: every
    sampled token)."""

    advantages: Tensor
    returns: Tensor | None = None
    loss_mask: Tensor | None = None


class TrainBatch(NamedTuple):
    """What an update reads: the step's samples and what the trainer computed of them."""

    batch: RolloutBatch
    precomputed: Precomputed
    advantages: Advantages


def _cat_padded(values: list[Tensor]) -> Tensor:
    if values[0].dim() == 1:
        return torch.cat(values)
    width = max(v.shape[1] for v in values)
    return torch.cat([F.pad(v, (0, width - v.shape[1])) for v in values])  # zeros on the right
