"""Cross-check ``policy_loss`` (+ ``kl_in_loss``) against Liger-Kernel's chunked GRPO loss.

``LigerFusedLinearGRPOLoss`` takes hidden states and the LM head, computes the sampled tokens'
log-probs itself (in fp32) and applies TRL's GRPO loss. We compute the same log-probs naively in
float64, apply our loss, and compare loss, clip fraction and the gradients of the hidden states
and the LM head within 1e-6. Loss types shared with Liger:

    liger loss_type   importance_sampling_level   ours
    grpo              token / sequence            ppo / gspo, agg seq_mean_token_mean
    bnpo              token / sequence            ppo / gspo, agg token_mean
    dr_grpo           token / sequence            ppo / gspo, agg seq_mean_token_sum_norm
    dapo              token / sequence            ppo / gspo, agg token_mean + num_tokens
    beta > 0          (k3 KL added per token)     + kl_in_loss(estimate(k3)) with the same agg
    delta             (INTELLECT-2 upper clamp)   dual_clip
    vllm_is_ratio     (per-token weights)         rollout_logprobs + tis_weights
"""

import pytest
import torch
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

from lightrft.algorithms import kl, policy_loss, tis_weights

D = torch.float64
B, T, H, V = 5, 7, 8, 24
LENGTHS = [7, 3, 5, 1, 6]  # every row non-empty: Liger's "grpo" divides by all rows

AGG = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
}


def _batch(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=D)
    weight = 0.5 * torch.randn(V, H, generator=g, dtype=D)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    adv = torch.randn(B, generator=g, dtype=D)
    with torch.no_grad():
        logp = _logprobs(hidden, weight, ids)
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    return hidden, weight, ids, mask, adv, old, ref, rollout


def _logprobs(hidden, weight, ids):
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, ids[..., None])[..., 0]


@pytest.mark.parametrize("extra", ["plain", "kl", "dual_clip", "tis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_matches_liger_grpo_loss(loss_type, level, extra):
    hidden, weight, ids, mask, adv, old, ref, rollout = _batch()
    eps_low, eps_high = (0.2, 0.28) if level == "token" else (0.02, 0.03)
    beta = 0.04 if extra == "kl" else 0.0
    delta = 1.5 if extra == "dual_clip" else None
    max_len = T + 3
    num_items = 2 * int(mask.sum()) if loss_type == "dapo" else None
    # Sequence level: per-sequence weights. With weights that vary within a sequence, Liger (like
    # TRL) differentiates exp(mean log-ratio) through every token, so each token's gradient gets
    # the sequence's mean weight; our GSPO-token form (as verl's) gives each token its own weight.
    # The loss values agree either way; the gradients agree when the weight is per sequence.
    tis_mode = "token" if level == "token" else "sequence_mask"
    is_weights = tis_weights(old, rollout, mask, mode=tis_mode, cap=2.0) if extra == "tis" else None

    liger = LigerFusedLinearGRPOLoss(
        beta=beta,
        compiled=False,
        use_ref_model=beta > 0,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        loss_type=loss_type,
        max_completion_length=max_len,
        importance_sampling_level=level,
        delta=delta,
    )
    h_l = hidden.clone().requires_grad_()
    w_l = weight.clone().requires_grad_()
    loss_l, metrics_l = liger(
        h_l,
        w_l,
        ids,
        mask,
        adv,
        ref_per_token_logps=ref if beta > 0 else None,
        old_per_token_logps=old,
        vllm_is_ratio=is_weights,
        num_items_in_batch=num_items,
    )
    loss_l.backward()

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp = _logprobs(h, w, ids)
    agg = AGG[loss_type]
    counts = dict(norm_len=max_len, num_tokens=num_items)
    loss, metrics = policy_loss(
        logp,
        old,
        adv,
        mask,
        objective="ppo" if level == "token" else "gspo",
        clip_low=eps_low,
        clip_high=eps_high,
        dual_clip=delta,
        agg=agg,
        rollout_logprobs=rollout if extra == "tis" else None,
        tis_mode=tis_mode,
        tis_cap=2.0,
        **counts,
    )
    if beta > 0:
        kl_term, _ = kl.kl_in_loss(kl.estimate(logp, ref, "k3"), mask, beta, agg=agg, **counts)
        loss = loss + kl_term
    loss.backward()

    assert abs(loss.item() - loss_l.item()) < 1e-6, (loss.item(), loss_l.item())
    assert (h.grad - h_l.grad).abs().max().item() < 1e-6
    assert (w.grad - w_l.grad).abs().max().item() < 1e-6
    assert abs(metrics["clip_frac"].item() - metrics_l[-1].item()) < 1e-6
    # the case must exercise clipping, else the comparison proves little about it
    assert metrics["clip_frac"].item() > 0


def test_empty_rows_are_excluded_where_liger_counts_them():
    """A deliberate difference: our sequence means skip zero-length responses, Liger's "grpo"
    divides by every row. With one empty row of B the two differ by exactly B / (B - 1)."""
    lengths = [7, 3, 0, 1, 6]
    hidden, weight, ids, mask, adv, old, _, _ = _batch(seed=1, lengths=lengths)
    liger = LigerFusedLinearGRPOLoss(
        beta=0.0, compiled=False, use_ref_model=False, loss_type="grpo"
    )
    loss_l, _ = liger(hidden, weight, ids, mask, adv, old_per_token_logps=old)
    loss, _ = policy_loss(_logprobs(hidden, weight, ids), old, adv, mask, agg="seq_mean_token_mean")
    assert abs(loss.item() - loss_l.item() * B / (B - 1)) < 1e-6
