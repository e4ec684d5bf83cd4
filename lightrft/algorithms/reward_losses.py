"""Reward-model losses on candidate scores, as small pure functions.

Every loss reads ``scores [B, K]``: the reward of each item's candidates, the chosen one in
column 0 and rejected ones after it, with ``valid [B, K]`` marking real candidates (an item may
have fewer than K). Each returns one loss per item ``[B]``; the recipe sums and normalises.

- Bradley-Terry (Ouyang et al. 2022, InstructGPT; margin: Touvron et al. 2023, Llama 2):
  ``-logsigmoid(r_c - r_r - m)``, averaged over the item's rejected candidates.
- log-exp (OpenRLHF's ``LogExpLoss``): ``log(1 + exp(r_r - r_c))``. It is the same function as
  Bradley-Terry without a margin (``softplus(-x) = -logsigmoid(x)``), kept under its own name for
  users who know it; it refuses margins.
- HPS (Wu et al. 2023, Human Preference Score v2): cross-entropy of a softmax over all candidates
  with the chosen one as the target. Over a pair it equals Bradley-Terry; over a list it differs.
- centring (TRL's ``center_rewards_coefficient``, Eisenstein et al. 2023):
  ``coef * mean((r_c + r_r)^2)``, which pins the reward's offset near 0.
- safety sign (Dai et al. 2023, Safe-RLHF cost model): ``-logsigmoid(s * c)`` with ``s = +1`` for
  an unsafe response and ``-1`` for a safe one, so a cost head's sign says safe or unsafe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rejected_mean(per: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean of ``per [B, K]`` over each item's valid rejected candidates (every column but
    the first). ``[B]``"""
    rej = valid.clone()
    rej[:, 0] = False
    return (per * rej).sum(-1) / rej.sum(-1).clamp(min=1)


def bradley_terry_loss(
    scores: torch.Tensor, valid: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean_k -logsigmoid(r_0 - r_k - m)`` over each item's valid rejected candidates. ``[B]``"""
    diff = scores[:, :1] - scores  # [B, K], r_c - r_k
    if margin is not None:
        diff = diff - margin[:, None]
    return _rejected_mean(-F.logsigmoid(diff), valid)


def log_exp_loss(
    scores: torch.Tensor, valid: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean_k log(1 + exp(r_k - r_0))``: Bradley-Terry without a margin. ``[B]``"""
    if margin is not None and bool((margin != 0).any()):
        raise ValueError("the log_exp loss takes no margin; use bradley_terry for margins")
    return _rejected_mean(F.softplus(scores - scores[:, :1]), valid)  # stable log(1 + exp(.))


def hps_loss(
    scores: torch.Tensor, valid: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of ``softmax(scores)`` over valid candidates, target column 0. ``[B]``

    A margin is subtracted from the chosen logit (as in Bradley-Terry, to which this reduces
    for a pair)."""
    logits = scores.masked_fill(~valid, float("-inf"))  # [B, K]
    if margin is not None:
        logits = torch.cat([logits[:, :1] - margin[:, None], logits[:, 1:]], dim=1)
    return -torch.log_softmax(logits, dim=-1)[:, 0]  # [B]


def center_loss(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``mean_k (r_0 + r_k)^2`` over each item's valid rejected candidates. ``[B]``"""
    return _rejected_mean((scores[:, :1] + scores).pow(2), valid)


def safety_sign_loss(costs: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """``sum_k -logsigmoid(s_k * c_k)`` with ``s = -1`` for safe (``safe == 1``), ``+1`` for
    unsafe (``safe == -1``), 0 where unlabelled: safe responses are pushed to negative cost.
    ``[B]``"""
    sign = -safe.to(costs.dtype)  # [B, K]
    return (-F.logsigmoid(sign * costs) * (safe != 0)).sum(-1)  # [B]


LOSSES = {"bradley_terry": bradley_terry_loss, "log_exp": log_exp_loss, "hps": hps_loss}


def preference_loss(
    scores: torch.Tensor,
    valid: torch.Tensor,
    *,
    kind: str = "bradley_terry",
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """The configured loss plus the optional centring term, per item. ``[B]``"""
    if kind not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {kind!r}")
    loss = LOSSES[kind](scores, valid, margin)
    if center_coef:
        loss = loss + center_coef * center_loss(scores, valid)
    return loss


@torch.no_grad()
def pairwise_stats(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per item: the fraction of rejected candidates scored below the chosen one (ties count a
    half) and the mean margin ``r_0 - r_k``. Each ``[B]``."""
    diff = scores[:, :1] - scores  # [B, K]
    wins = (diff > 0).float() + 0.5 * (diff == 0).float()
    return _rejected_mean(wins, valid), _rejected_mean(diff, valid)


class PreferenceStats:
    """A reward model's held-out statistics per head, accumulated over batches: pairwise
    accuracy, mean margin, and the mean / std of its scores. :attr:`sums` (``[6, heads]``,
    float64: items, correct, margin sum, scored sequences, score sum, sum of squares) can be
    summed over ranks before :meth:`metrics`."""

    def __init__(self, heads: list[str] | tuple[str, ...]):
        self.heads = list(heads)
        self.sums = torch.zeros(6, len(self.heads), dtype=torch.float64)

    def add(
        self, raw: torch.Tensor, signed: torch.Tensor, valid: torch.Tensor, head: torch.Tensor
    ) -> None:
        """One batch: raw scores, signed scores (higher = preferred) and the valid mask, each
        ``[B, K]``; ``head`` ``[B]``: the head each item is scored by."""
        acc, margin = pairwise_stats(signed.float(), valid)  # [B] each
        acc, margin, valid = acc.cpu(), margin.cpu(), valid.cpu()
        vals = raw.float().cpu() * valid
        head = head.cpu()
        for h in range(len(self.heads)):
            sel = head == h
            for row, part in enumerate((sel, acc[sel], margin[sel], valid[sel], vals[sel])):
                self.sums[row, h] += part.sum()
            self.sums[5, h] += vals[sel].pow(2).sum()

    def metrics(self, sums: torch.Tensor | None = None) -> tuple[dict[str, float], dict]:
        """``eval/*`` metrics per head and overall, and per head ``{mean, std, pairs}`` (what
        an export records for score normalisation). ``sums``: e.g. summed over ranks."""
        sums = self.sums if sums is None else sums
        out: dict[str, float] = {}
        stats: dict[str, dict[str, float]] = {}
        for h, name in enumerate(self.heads):
            n, m = sums[0, h].item(), sums[3, h].item()
            if n == 0:
                continue
            mean = sums[4, h].item() / m
            std = max(sums[5, h].item() / m - mean * mean, 0.0) ** 0.5
            out[f"eval/accuracy/{name}"] = sums[1, h].item() / n
            out[f"eval/margin/{name}"] = sums[2, h].item() / n
            out[f"eval/reward_mean/{name}"] = mean
            out[f"eval/reward_std/{name}"] = std
            stats[name] = {"mean": mean, "std": std, "pairs": int(n)}
        out["eval/accuracy"] = sums[1].sum().item() / max(sums[0].sum().item(), 1.0)
        return out, stats
