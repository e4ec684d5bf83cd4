"""causal_lm_token_logprobs on tiny HF models: plain, tied embeddings, packed rows, FSDP2."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

from lightrft.kernels import fused_linear_logprobs
from lightrft.models import load_causal_lm, parallelize
from lightrft.models.forward import causal_lm_cross_entropy, causal_lm_token_logprobs
from lightrft.tasks import make_tiny_model

IGNORE = -100


def batch(seed: int, b: int = 3, t: int = 14):
    """Token ids, next-token targets with prompt/padding ignored, and per-token weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (b, t), generator=g)
    targets = ids[:, 1:].clone()  # [B, T-1]
    targets[:, :4] = IGNORE  # prompt
    targets[-1, -3:] = IGNORE  # a shorter response
    weights = torch.randn(b, t - 1, generator=g)
    return ids, targets, weights


def reference(model, ids, targets, temperature=1.0, **kw):
    """Log-probs (and entropy) from the full logits, 0 at ignored targets."""
    logits = model(input_ids=ids, use_cache=False, **kw).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)  # [B, T-1, V]
    valid = targets != IGNORE
    logp = logp_all.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, ent, 0.0)


def param_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got, ref, atol=1e-5, rtol=1e-4):
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=atol, rtol=rtol, msg=name)


def test_matches_logits_path_values_and_all_parameter_grads(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    ids, targets, w = batch(0)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in one row
    ref_lp, ref_ent = reference(model, ids, targets, 0.7, attention_mask=mask)
    ref_g = param_grads(model, (ref_lp * w).sum() + 0.1 * (ref_ent * w).sum())
    lp, ent = causal_lm_token_logprobs(
        model, ids, targets=targets, attention_mask=mask, temperature=0.7, return_entropy=True
    )
    got_g = param_grads(model, (lp * w).sum() + 0.1 * (ent * w).sum())
    assert lp.shape == (3, 13) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert "lm_head.weight" in got_g
    assert_grads_close(got_g, ref_g)
    assert not model._forward_hooks and not model.get_decoder()._forward_hooks


def test_entropy_without_grad_is_logged_but_leaves_the_backward_alone(tiny_model_dir):
    """entropy_grad=False (the GRPO recipe without an entropy bonus): the entropy has the
    reference values, no gradient, and the log-probs' gradient is bitwise that of log-probs
    alone."""
    model = load_causal_lm(tiny_model_dir)
    ids, targets, w = batch(3)
    ref_lp, ref_ent = reference(model, ids, targets, 0.7)
    lp_only = causal_lm_token_logprobs(model, ids, targets=targets, temperature=0.7)
    only_g = param_grads(model, (lp_only * w).sum())
    lp, ent = causal_lm_token_logprobs(
        model, ids, targets=targets, temperature=0.7, return_entropy=True, entropy_grad=False
    )
    assert not ent.requires_grad and lp.requires_grad
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(lp, lp_only)
    got_g = param_grads(model, (lp * w).sum())
    for name in only_g:
        assert torch.equal(got_g[name], only_g[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_forward_takes_liger_on_cuda_without_entropy_bonus(tiny_model_dir, monkeypatch):
    """On CUDA, log-probs with a no-grad entropy (the recipe's forward with no entropy bonus)
    run Liger's kernel; the entropy still matches the logits reference."""
    pytest.importorskip("liger_kernel")
    from lightrft.kernels import logprobs as kernel

    calls = []
    real = kernel.liger_flce
    monkeypatch.setattr(kernel, "liger_flce", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = load_causal_lm(tiny_model_dir).cuda()
    ids, targets, w = (t.cuda() for t in batch(4))
    ref_lp, ref_ent = reference(model, ids, targets, 0.7)
    lp, ent = causal_lm_token_logprobs(
        model, ids, targets=targets, temperature=0.7, return_entropy=True, entropy_grad=False
    )
    assert calls, "the log-probs did not go through Liger"
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    (lp * w).sum().backward()


def test_default_targets_are_the_next_tokens(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    ids, _, _ = batch(1)
    with torch.no_grad():
        lp = causal_lm_token_logprobs(model, ids)
        ref, _ = reference(model, ids, ids[:, 1:])
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)


def test_tied_embeddings(tmp_path):
    d = make_tiny_model(tmp_path / "tied", arch="llama", layers=1, hidden=32, tie_embeddings=True)
    model = load_causal_lm(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, targets, w = batch(2)
    ref_lp, _ = reference(model, ids, targets)
    ref_g = param_grads(model, (ref_lp * w).sum())
    lp = causal_lm_token_logprobs(model, ids, targets=targets)
    got_g = param_grads(model, (lp * w).sum())
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    assert_grads_close(got_g, ref_g)


def test_packed_rows_with_position_ids(tiny_model_dir):
    """Two samples packed in one row: per-sample positions, no attention mask."""
    model = load_causal_lm(tiny_model_dir)
    ids = torch.randint(3, 99, (1, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    targets = ids[:, 1:].clone()
    targets[0, 4] = IGNORE  # the boundary: token 5 starts a new sample
    with torch.no_grad():
        lp = causal_lm_token_logprobs(model, ids, targets=targets, position_ids=pos)
        ref, _ = reference(model, ids, targets, position_ids=pos)
        second = causal_lm_token_logprobs(model, ids[:, 5:])  # the second sample alone
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp[:, 5:], second, atol=1e-5, rtol=1e-5)


def test_cross_entropy_matches_hf_loss(tiny_model_dir):
    """The SFT loss equals the model's own (logits-based) shifted cross-entropy, with grads."""
    model = load_causal_lm(tiny_model_dir)
    ids, targets, _ = batch(4)
    labels = torch.cat([torch.full_like(ids[:, :1], IGNORE), targets], dim=1)  # HF shifts inside
    ref = model(input_ids=ids, labels=labels, use_cache=False).loss
    ref_g = param_grads(model, ref)
    loss = causal_lm_cross_entropy(model, ids, targets=targets)
    got_g = param_grads(model, loss)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    assert_grads_close(got_g, ref_g)
    # With a global token count: the loss (and gradient) scale by count / num_tokens.
    n = int((targets != IGNORE).sum())
    scaled = causal_lm_cross_entropy(model, ids, targets=targets, num_tokens=4 * n)
    torch.testing.assert_close(scaled, ref.detach() / 4, atol=1e-6, rtol=1e-5)


def test_input_errors_and_hooks_removed(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        causal_lm_token_logprobs(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets must be \[B, T-1\]"):
        causal_lm_token_logprobs(
            model, torch.zeros(2, 5, dtype=torch.long), targets=torch.zeros(2, 5)
        )
    with pytest.raises(ValueError, match="targets must lie in"):
        causal_lm_token_logprobs(
            model, torch.zeros(1, 5, dtype=torch.long), targets=torch.full((1, 4), 10**6)
        )
    assert not model._forward_hooks and not model.get_decoder()._forward_hooks
    with pytest.raises(ValueError, match="not a Hugging Face causal LM"):
        causal_lm_token_logprobs(torch.nn.Linear(2, 2), torch.zeros(1, 3, dtype=torch.long))


def policy_loss_via_hidden(model, ids, targets, old, adv):
    """The GRPO recipe's route under FSDP2: fused log-probs inside the model's forward, then
    the pure policy loss."""
    from lightrft.algorithms.losses import policy_loss

    lp = causal_lm_token_logprobs(model, ids, targets=targets)
    return policy_loss(lp, old, adv, targets != IGNORE, clip_low=0.2, clip_high=0.28)


def policy_loss_reference(model, ids, targets, old, adv):
    from lightrft.algorithms.losses import policy_loss

    lp, _ = reference(model, ids, targets)
    return policy_loss(lp, old, adv, targets != IGNORE, clip_low=0.2, clip_high=0.28)


def test_policy_loss_inside_forward_matches_reference(tiny_model_dir):
    pytest.importorskip("lightrft.algorithms.losses")
    model = load_causal_lm(tiny_model_dir)
    ids, targets, w = batch(5)
    old = w * 0.2 + reference(model, ids, targets)[0].detach()
    adv = torch.tensor([1.0, -0.5, 2.0])
    ref, ref_metrics = policy_loss_reference(model, ids, targets, old, adv)
    ref_g = param_grads(model, ref)
    loss, metrics = policy_loss_via_hidden(model, ids, targets, old, adv)
    got_g = param_grads(model, loss)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    assert metrics.keys() == ref_metrics.keys()
    assert_grads_close(got_g, ref_g)


def _fsdp_worker(rank: int, world_size: int, dirs: list[str], with_policy: bool) -> None:
    torch.manual_seed(0)
    for d in dirs:
        ref_model = load_causal_lm(d)
        model = parallelize(load_causal_lm(d))  # FSDP2: blocks, then the root (embed, norm, head)
        data = [batch(10 + r) for r in range(world_size)]
        # FSDP2 averages gradients over ranks: the reference is the mean of the ranks' losses.
        ref_loss = 0.0
        for r, (ids, targets, w) in enumerate(data):
            lp_r, _ = reference(ref_model, ids, targets)
            ref_loss = ref_loss + (lp_r * w).sum() / world_size
            if r == rank:
                ref_lp = lp_r.detach()
        ref_g = param_grads(ref_model, ref_loss)
        ids, targets, w = data[rank]
        lp = causal_lm_token_logprobs(model, ids, targets=targets)
        model.zero_grad(set_to_none=True)
        (lp * w).sum().backward()
        torch.testing.assert_close(lp.detach(), ref_lp, atol=1e-5, rtol=1e-5)
        got_g = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        assert_grads_close(got_g, ref_g)

        # The SFT loss, normalised by the token count of both ranks, through the same hooks.
        total = sum(int((tg != IGNORE).sum()) for _, tg, _ in data)
        ref_ce = sum(-reference(ref_model, i, tg)[0].sum() / total for i, tg, _ in data)
        ref_g = param_grads(ref_model, ref_ce)
        model.zero_grad(set_to_none=True)
        causal_lm_cross_entropy(model, ids, targets=targets, num_tokens=total).backward()
        got_g = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        # Each rank's loss is its share of the global mean; FSDP2 averages over ranks.
        assert_grads_close({n: g * world_size for n, g in got_g.items()}, ref_g)

        if with_policy:  # the fused policy loss through forward_on_hidden, old log-probs apart
            old = [reference(ref_model, i, tg)[0].detach() + 0.2 * w_ for i, tg, w_ in data]
            adv = torch.tensor([1.0, -0.5, 2.0])
            ref_pl = sum(
                policy_loss_reference(ref_model, i, tg, old[r], adv)[0] / world_size
                for r, (i, tg, _) in enumerate(data)
            )
            ref_g = param_grads(ref_model, ref_pl)
            model.zero_grad(set_to_none=True)
            loss, _ = policy_loss_via_hidden(model, ids, targets, old[rank], adv)
            loss.backward()
            got_g = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            assert_grads_close(got_g, ref_g)

        # Outside the root's forward the LM head is a sharded DTensor: a clear error.
        with pytest.raises(ValueError, match="sharded DTensor"):
            fused_linear_logprobs(torch.zeros(2, 64), model.lm_head.weight, torch.zeros(2).long())


def test_under_fsdp2_two_processes(tiny_model_dir, tmp_path):
    tied = make_tiny_model(tmp_path / "tied", layers=2, hidden=64, tie_embeddings=True)
    try:
        import lightrft.algorithms.losses  # noqa: F401  (being written in parallel; optional)

        with_policy = True
    except ImportError:
        with_policy = False
    run_distributed(_fsdp_worker, [str(tiny_model_dir), str(tied)], with_policy)
