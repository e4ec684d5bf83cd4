"""SFT cross-entropy and the fused policy loss against their unfused compositions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightrft.kernels import fused_linear_cross_entropy, fused_linear_logprobs

IGNORE = -100


def make(shape, h, v, *, bias=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, shape, generator=g)
    return hidden, weight, b, targets


def grads_of(loss, *tensors):
    for t in tensors:
        if t is not None:
            t.grad = None
    loss.backward()
    return [None if t is None else t.grad.clone() for t in tensors]


def naive_ce(hidden, weight, targets, bias=None):
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    if bias is not None:
        logits = logits + bias
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=IGNORE)


# ----------------------------------------------------------------------------- cross-entropy


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_cross_entropy_matches_torch(bias, chunk_size):
    hidden, weight, b, targets = make((3, 13), 24, 1003, bias=bias)
    targets[:, :4] = IGNORE  # prompt tokens
    ref = naive_ce(hidden, weight, targets, b)
    ref_g = grads_of(ref, hidden, weight, b)
    got = fused_linear_cross_entropy(hidden, weight, targets, bias=b, chunk_size=chunk_size)
    got_g = grads_of(got, hidden, weight, b)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    for g, r in zip(got_g, ref_g, strict=True):
        if r is not None:
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    assert torch.all(hidden.grad[:, :4] == 0)


def test_cross_entropy_scaled_upstream_gradient():
    """The gradients computed in the forward are rescaled by the incoming gradient."""
    hidden, weight, _, targets = make((20,), 16, 101)
    ref_g = grads_of(3.5 * naive_ce(hidden, weight, targets), hidden, weight)
    got_g = grads_of(3.5 * fused_linear_cross_entropy(hidden, weight, targets), hidden, weight)
    for g, r in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_cross_entropy_gradient_accumulation_with_global_token_count():
    hidden, weight, _, targets = make((4, 9), 16, 211, seed=2)
    targets[0, :6] = IGNORE
    targets[3, 2:] = IGNORE
    whole = grads_of(naive_ce(hidden, weight, targets), hidden, weight)
    total = int((targets != IGNORE).sum())
    hidden.grad = weight.grad = None
    for rows in (slice(0, 1), slice(1, 4)):  # two micro-batches of unequal token counts
        fused_linear_cross_entropy(hidden[rows], weight, targets[rows], num_tokens=total).backward()
    torch.testing.assert_close(hidden.grad, whole[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad, whole[1], atol=1e-6, rtol=1e-5)


def test_cross_entropy_num_tokens_tensor_and_no_grad_path():
    hidden, weight, _, targets = make((10,), 8, 50)
    with torch.no_grad():
        a = fused_linear_cross_entropy(hidden, weight, targets, num_tokens=torch.tensor(20))
    b = fused_linear_cross_entropy(hidden, weight, targets, num_tokens=20)
    torch.testing.assert_close(a, b.detach())
    torch.testing.assert_close(b, naive_ce(hidden, weight, targets) / 2)


def test_cross_entropy_all_ignored_is_zero_not_nan():
    hidden, weight, _, targets = make((5,), 8, 50)
    targets[:] = IGNORE
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


@pytest.mark.parametrize(
    "bad",
    [0, -3, float("nan"), torch.tensor(0.0), torch.tensor(float("nan")), torch.tensor([1, 2])],
)
def test_cross_entropy_rejects_bad_num_tokens(bad):
    hidden, weight, _, targets = make((5,), 8, 50)
    with pytest.raises(ValueError, match="num_tokens"):
        fused_linear_cross_entropy(hidden, weight, targets, num_tokens=bad)


def test_cross_entropy_bf16_close_to_fp32():
    hidden, weight, _, targets = make((64,), 32, 997, dtype=torch.bfloat16)
    h32, w32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    ref = naive_ce(h32, w32, targets)
    ref_g = grads_of(ref, h32, w32)
    got = fused_linear_cross_entropy(hidden, weight, targets)
    got_g = grads_of(got, hidden, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=1e-2)
    for g, r in zip(got_g, ref_g, strict=True):
        assert g.dtype == torch.bfloat16
        assert (g.float() - r).abs().max() <= 2e-2 * r.abs().max()


# ----------------------------------------------------------------------------- policy loss


def naive_logprobs_bt(hidden, weight, targets, bias, temperature):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logp_all = torch.log_softmax(logits.float() / temperature, -1)  # [B, T, V]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"objective": "ppo"},
        {"objective": "ppo", "clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
        {"objective": "ppo", "agg": "seq_mean_token_sum_norm", "norm_len": 16},
        {"objective": "ppo", "agg": "seq_mean_token_mean", "kl": "k3", "tis_mode": "sequence_mask"},
        {"objective": "ppo", "kl": "k2", "tis_mode": "token", "old": None},
        {"objective": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
        {"objective": "gmpo", "clip_low": 0.4, "clip_high": 0.4},
        {"objective": "cpgd", "kl": "k3"},
    ],
    ids=[
        "ppo",
        "ppo-dual-clip-higher",
        "dr-grpo-agg",
        "ppo-kl-tis",
        "on-policy-k2-token-tis",
        "gspo",
        "gmpo",
        "cpgd-kl",
    ],
)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("route", ["logprobs", "grad_hint"])
def test_policy_loss_equals_unfused_composition(kwargs, entropy_coef, route, monkeypatch):
    """The recipe's routes: the fused kernel's log-probs and entropy, then the pure losses; with
    ``grad_hint`` (per-token objectives) the gradients come from the kernel's forward and the
    recomputing backward never runs. Both equal the naive logits path to fp32 tolerance."""
    losses = pytest.importorskip("lightrft.algorithms.losses")
    from lightrft.algorithms.kl import estimate, kl_in_loss
    from lightrft.kernels import logprobs as lp_mod
    from lightrft.kernels import response_grad_hint

    kwargs = dict(kwargs)
    kl_kind, on_policy = kwargs.pop("kl", None), "old" in kwargs and kwargs.pop("old") is None
    tis_mode = kwargs.pop("tis_mode", None)
    b_, t_, temperature = 4, 11, 0.8
    hidden, weight, bias, targets = make((b_, t_), 24, 1003, bias=True, seed=5)
    g = torch.Generator().manual_seed(6)
    mask = torch.ones(b_, t_, dtype=torch.bool)
    mask[:, :3] = False  # prompt
    mask[2, 7:] = False  # a short response
    targets = torch.where(mask, targets, torch.full_like(targets, 0))
    advantages = torch.randn(b_, generator=g)
    with torch.no_grad():
        cur, _ = naive_logprobs_bt(hidden, weight, targets, bias, temperature)
        old = cur + 0.3 * torch.randn(b_, t_, generator=g)  # some tokens beyond the clip range
        ref_lp = cur + 0.2 * torch.randn(b_, t_, generator=g)
        rollout = old + 0.5 * torch.randn(b_, t_, generator=g)
    agg = kwargs.get("agg") or losses.OBJECTIVES[kwargs["objective"]].defaults["agg"]
    norm = {"agg": agg, "norm_len": kwargs.get("norm_len")}
    tis = {} if tis_mode is None else {"rollout_logprobs": rollout, "tis_mode": tis_mode}

    def compose(logp, ent):
        loss, metrics = losses.policy_loss(
            logp, None if on_policy else old, advantages, mask, **kwargs, **tis
        )
        term, ent_metrics = losses.entropy_bonus(ent, mask, entropy_coef, **norm)
        loss = loss + term
        if kl_kind is not None:
            kl_term, _ = kl_in_loss(estimate(logp, ref_lp, kl_kind), mask, 0.05, **norm)
            loss = loss + kl_term
        return loss, {**metrics, **ent_metrics}

    def unfused():
        return compose(*naive_logprobs_bt(hidden, weight, targets, bias, temperature))

    per_token = losses.OBJECTIVES[kwargs["objective"]].per_token
    hint = None
    if route == "grad_hint" and per_token:
        hint = response_grad_hint(
            lambda lp, ent: compose(lp, ent)[0],
            torch.arange(b_ * t_).view(b_, t_),
            mask,
            b_ * t_,
            entropy_grad=bool(entropy_coef),
        )

        sweep = lp_mod.chunked_sweep

        def no_recompute(*args, **kw):
            if kw.get("logp_out") is None:  # a forward writes its log-probs
                raise AssertionError("the recomputing backward ran")
            return sweep(*args, **kw)

        monkeypatch.setattr(lp_mod, "chunked_sweep", no_recompute)

    def fused():
        kernel_targets = torch.where(mask, targets, torch.full_like(targets, -100))
        logp, ent = fused_linear_logprobs(
            hidden.reshape(b_ * t_, -1),
            weight,
            kernel_targets.reshape(-1),
            bias=bias,
            temperature=temperature,
            chunk_size=9,
            return_entropy=True,
            grad_hint=hint,
        )
        ent = ent if entropy_coef else ent.detach()
        return compose(logp.view(b_, t_), ent.view(b_, t_))

    ref_loss, ref_metrics = unfused()
    ref_g = grads_of(ref_loss, hidden, weight, bias)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hint that disagrees would warn
        got_loss, got_metrics = fused()
        got_g = grads_of(got_loss, hidden, weight, bias)
    torch.testing.assert_close(got_loss, ref_loss, atol=1e-6, rtol=1e-5)
    assert set(got_metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        torch.testing.assert_close(got_metrics[k], v, atol=1e-5, rtol=1e-5, msg=k)
    for name, got, ref in zip(("hidden", "weight", "bias"), got_g, ref_g, strict=True):
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5, msg=name)
    assert torch.all(hidden.grad[~mask] == 0)  # masked positions cost nothing and get nothing
