"""What a GRPO-family step logs about its rollouts: rewards per function and head, lengths,
truncation, groups without signal, phase times and throughput, and the per-sample trajectory
files. Pure functions of the step's :class:`~lightrft.rollout.batch.RolloutBatch` es, so a
copied recipe keeps its loop short and the numbers stay the same across recipes."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lightrft.distributed import all_gather_objects
from lightrft.rollout.batch import RolloutBatch
from lightrft.training.metrics import peak_memory, reduce_metrics

PHASES = ("rollout", "scoring", "old_logprobs", "reference", "values", "training", "weight_sync")


class RewardSideMetrics:
    """What reward calls report beside the rewards, kept over a step: every head of a
    multi-head reward model (``out.heads``, over the samples its function scored) and the
    functions' own metrics (``out.extra``, e.g. a judge's parse failures)."""

    def __init__(self) -> None:
        self._side: dict[str, tuple] = {}

    def add(self, out) -> None:
        side = self._side
        for key, scores in out.heads.items():
            vals = scores[out.applied[key.split("/")[0]]].double()
            s, q, c = side.get(key, (0.0, 0.0, 0))
            side[key] = (s + float(vals.sum()), q + float((vals**2).sum()), c + vals.numel())
        for key, value in out.extra.items():
            total, calls = side.get(f"extra:{key}", (0.0, 0))
            side[f"extra:{key}"] = (total + float(value), calls + 1)

    def reduce(self) -> dict[str, float]:
        """The step's reward-head means / stds and function metrics (averaged over the calls of
        the step: one per rank and draw), merged over ranks (collective); then forgotten."""
        merged: dict[str, tuple] = {}
        for part in all_gather_objects(self._side):
            for key, vals in part.items():
                old = merged.get(key, (0,) * len(vals))
                merged[key] = tuple(a + b for a, b in zip(old, vals, strict=True))
        self._side = {}
        m: dict[str, float] = {}
        for key, vals in sorted(merged.items()):
            if key.startswith("extra:"):
                m[f"reward/{key[len('extra:') :]}"] = vals[0] / max(vals[1], 1)
            elif vals[2]:
                mean = vals[0] / vals[2]
                m[f"reward/{key}/mean"] = mean
                m[f"reward/{key}/std"] = max(vals[1] / vals[2] - mean * mean, 0.0) ** 0.5
        return m


def rollout_metrics(
    drawn: RolloutBatch, batch: RolloutBatch, reward_names: list[str]
) -> dict[str, float]:
    """Rewards (total, per function), lengths, truncation and signal-less groups of every drawn
    sample; ``batch``: the samples kept for training."""
    m: dict[str, float] = {}
    totals = drawn.reward_raw.float()
    m["reward/total/mean"] = float(totals.mean())
    m["reward/total/std"] = float(totals.std(unbiased=False))
    for name in reward_names:
        vals = drawn.reward_parts[name][drawn.reward_applied[name]].float()
        if vals.numel():
            m[f"reward/{name}/mean"] = float(vals.mean())
            m[f"reward/{name}/std"] = float(vals.std(unbiased=False))
        m[f"reward/{name}/count"] = float(vals.numel())
    if drawn.overlong is not None:
        m["reward/overlong/mean"] = sum(drawn.overlong.tolist()) / len(drawn)
    lengths = drawn.response_lens.float()
    m["rollout/response_length/mean"] = float(lengths.mean())
    m["rollout/response_length/max"] = float(lengths.max())
    m["rollout/response_length/min"] = float(lengths.min())
    m["rollout/truncated_frac"] = drawn.finish_reasons.count("length") / len(drawn)
    m["rollout/prompt_length/mean"] = sum(drawn.prompt_lens.tolist()) / len(drawn)
    m["rollout/samples"] = float(len(drawn))
    m["rollout/train_samples"] = float(len(batch))
    # Groups whose rewards are all equal carry no group-relative signal.
    groups: dict[tuple, set] = {}
    for g, r in zip(drawn.groups, drawn.rewards.tolist(), strict=True):
        groups.setdefault(tuple(g), set()).add(r)
    flat = sum(len(v) == 1 for v in groups.values())
    m["rollout/solved_or_failed_groups_frac"] = flat / len(groups)
    return m


def step_metrics(
    drawn: RolloutBatch,
    phases: dict[str, float],
    elapsed: float,
    metrics: dict[str, float],
    device: torch.device,
) -> dict[str, float]:
    """Phase times, throughput and peak memory of a step (pops ``train/tokens`` from
    ``metrics``); ``phases``: a :class:`PhaseTimer` summary."""
    gen_tokens = int(drawn.response_lens.sum())
    all_tokens = gen_tokens + int(drawn.prompt_lens.sum())
    out = {"time/step": elapsed}
    for phase in PHASES:
        out[f"time/{phase}"] = phases.get(f"time/{phase}", 0.0)
    # Asynchronous: the generating process's own time (``time/generate``), not the wait.
    gen_time = metrics.get("time/generate", out["time/rollout"])
    out["perf/rollout_tokens_per_s"] = gen_tokens / max(gen_time, 1e-9)
    if "train/tokens" in metrics:
        train_tokens = metrics.pop("train/tokens")
        out["perf/train_tokens_per_s"] = train_tokens / max(out["time/training"], 1e-9)
    out["perf/tokens_per_s"] = all_tokens / max(elapsed, 1e-9)
    out.update(reduce_metrics(peak_memory(device), "max"))
    return out


def update_metrics(
    reduced: dict[str, float],
    terms: Sequence[str],
    grad_norms: list[float],
    critic_norms: list[float],
    world: int,
    sp: int,
) -> dict[str, float]:
    """``train/*`` (and ``critic/grad_norm``) of an update from its reduced accumulator
    (``loss``, ``tokens``, the loss ``terms``, token-weighted means), the gradient norms of its
    optimizer steps, the world size and the sequence-parallel degree ``sp``."""
    metrics = {f"train/{k}": v for k, v in reduced.items()}
    # Each rank's loss is its part of sum / (global count / world): the sum over ranks is
    # world x the loss of the whole mini-batch (x the SP degree: an SP group's ranks all
    # compute their micro-batch's loss, from the gathered log-probs).
    per = world * sp * len(grad_norms)
    metrics["train/loss"] = reduced["loss"] / per
    for k in terms:
        if k in reduced:
            metrics[f"train/{k}"] = reduced[k] / per
    metrics["train/tokens"] = reduced["tokens"] / sp
    metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["train/grad_norm_max"] = max(grad_norms)
    metrics["train/optimizer_steps"] = float(len(grad_norms))
    if critic_norms:
        metrics["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
    return metrics


# Decimals kept of each per-token float: a ratio exp(a - b) of two rounded log-probs is off by at
# most ~1e-4, invisible in a colour, and the token lines stay about half as long.
TOKEN_DECIMALS = 4


def _rounded(values: torch.Tensor) -> list[float]:
    return [round(v, TOKEN_DECIMALS) for v in values.tolist()]


def token_pieces(
    decode: Callable[[list[list[int]]], list[str]], ids: Sequence[int], window: int = 6
) -> list[str]:
    """The text each token adds to the decoded response, one string per id; they join to the
    decoded response. ``decode`` decodes a list of id lists at once (a tokenizer's
    ``batch_decode``). Decoding ids one by one would drop SentencePiece's leading spaces and
    break characters split across tokens, so each token is decoded after up to ``window``
    tokens of context and the context's text is cut off; a token that ends inside a
    character (its text ends in U+FFFD) gets ``""`` and the one completing it the whole
    character."""
    ids = list(ids)
    n = len(ids)
    # One batched call for the common case (every token completes its text).
    texts = decode([ids[max(0, i - window) : i + k] for k in (0, 1) for i in range(n)])
    heads, fulls = texts[:n], texts[n:]
    pieces: list[str] = []
    start = 0  # the first id whose text is not yet in ``pieces``
    for i in range(n):
        if start == i:
            head, full = heads[i], fulls[i]
        else:  # continuing a split character: decode ids[start : i + 1] after its context
            lo = max(0, start - window)
            head, full = decode([ids[lo:start], ids[lo : i + 1]])
        if full.endswith("\ufffd") and i + 1 < n and i + 1 - start < window:
            pieces.append("")
            continue
        if full.startswith(head):
            pieces.append(full[len(head) :])
        else:
            pieces.append(decode([ids[start : i + 1]])[0])
        start = i + 1
    return pieces


def write_trajectories(
    folder: Path,
    step: int,
    drawn: RolloutBatch,
    batch: RolloutBatch,
    *,
    advantages: torch.Tensor | None = None,
    decode: Callable[[list[list[int]]], list[str]] | None = None,
    token_stats: dict[str, torch.Tensor] | None = None,
) -> None:
    """Every drawn sample of ``step`` as one JSON line of ``folder/step_<step>.jsonl``: prompt
    (and its record: file and line), response, rewards, advantage, length, finish reason, and
    whether it was kept for training (``batch`` holds the kept rows, in order; ``advantages``
    theirs, ``[len(batch), R]``). A multi-turn
    sample adds its response ids, their sampled mask and its episode (every turn's sampled ids
    and text, observation messages and ids, reward, tool calls, errors; its stats).

    With ``decode`` (the tokenizer's ``batch_decode``, special tokens kept; GRPO's
    ``trajectory_tokens``) each
    line adds ``tokens``: per response token its text piece (:func:`token_pieces`), the engine's
    log-prob, and, for a kept sample, the trainer's log-prob and entropy before the update
    (``token_stats["logprobs"]`` / ``["entropy"]``, ``[len(batch), R]``) and its advantage;
    ``null`` lists for a sample dynamic sampling dropped (the trainer never saw it)."""
    folder.mkdir(exist_ok=True)
    kept = iter(range(len(batch)))
    # A kept sample's trainer-side per-token values (its row ``j`` in ``batch``); None for a
    # sample dynamic sampling dropped, or a value not given.
    token_stats = token_stats or {}
    trainer = {
        "logprob": token_stats.get("logprobs"),
        "entropy": token_stats.get("entropy"),
        "advantage": advantages,
    }
    with open(folder / f"step_{step:06d}.jsonl", "w") as f:
        for i in range(len(drawn)):
            r = int(drawn.response_lens[i])
            advantage = None
            j = None
            if drawn.kept[i]:
                j = next(kept)
                if advantages is not None:
                    # the mean over sampled tokens (observations carry none), summed in order
                    mine = advantages[j, :r][batch.response_mask[j, :r]].tolist()
                    advantage = sum(mine) / len(mine) if mine else None
            record = {
                "step": step,
                "prompt": drawn.prompts[i],
                "where": drawn.wheres[i],
                "response": drawn.texts[i],
                "reference": drawn.references[i],
                "label": drawn.labels[i],
                "reward": float(drawn.rewards[i]),
                "reward_parts": {k: float(v[i]) for k, v in drawn.reward_parts.items()},
                "overlong_penalty": None if drawn.overlong is None else float(drawn.overlong[i]),
                "advantage": advantage,
                "response_length": r,
                "finish_reason": drawn.finish_reasons[i],
                "kept": bool(drawn.kept[i]),
            }
            if drawn.episodes is not None:  # multi-turn: every turn, its ids and the mask
                record["response_ids"] = drawn.response(i)
                record["sampled_mask"] = drawn.response_mask[i, :r].tolist()
                record["episode"] = drawn.episodes[i].record()
            if decode is not None:  # sample i's per-token detail
                record["tokens"] = {
                    "text": token_pieces(decode, drawn.response(i)),
                    "engine_logprob": _rounded(drawn.rollout_logprobs[i, :r]),
                    **{
                        k: None if j is None or t is None else _rounded(t[j, :r])
                        for k, t in trainer.items()
                    },
                }
            f.write(json.dumps(record) + "\n")
