"""Aggregation, policy / value losses, importance weights and entropy helpers: hand-derived
numbers, float64 gradient checks, gradient-accumulation equivalence and edge cases."""

import math

import pytest
import torch

from lightrft.algorithms import (
    AGG_MODES,
    OBJECTIVES,
    aggregate,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
    policy_loss,
    tis_weights,
    value_loss,
)

D = torch.float64


def t(x, dtype=D, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


# --------------------------------------------------------------------------- aggregate

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token_mean", {}, 7 / 3),
        ("token_mean", {"num_tokens": 14}, 0.5),
        ("token_mean", {"num_tokens": torch.tensor(14.0)}, 0.5),
        ("seq_mean_token_mean", {}, (1.5 + 4.0) / 2),  # the empty row is not a sequence
        ("seq_mean_token_mean", {"num_seqs": 5.5}, 1.0),
        ("seq_mean_token_sum", {}, (3.0 + 4.0) / 2),
        ("seq_mean_token_sum", {"num_seqs": 7}, 1.0),
        ("seq_mean_token_sum_norm", {}, (3 / 3 + 4 / 3) / 2),  # norm_len defaults to T
        ("seq_mean_token_sum_norm", {"norm_len": 10}, (0.3 + 0.4) / 2),
    ],
)
def test_aggregate_hand_numbers(mode, kwargs, expected):
    out = aggregate(t(LOSS), MASK, mode, **kwargs)
    assert out.dtype == D
    assert out.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_ignores_garbage_on_padding(mode):
    loss = t(LOSS, grad=True)
    with torch.no_grad():
        loss[0, 2] = math.inf
        loss[2] = math.nan
    out = aggregate(loss, MASK, mode)
    clean = aggregate(t(LOSS), MASK, mode)
    assert out.item() == clean.item()
    out.backward()
    assert torch.isfinite(loss.grad).all()
    assert (loss.grad[MASK == 0] == 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_all_masked_is_zero_with_finite_grad(mode):
    loss = t(LOSS, grad=True)
    out = aggregate(loss, torch.zeros(3, 3), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(3, 3, dtype=D))
    assert aggregate(t(LOSS), torch.zeros(3, 3), mode, num_tokens=0, num_seqs=0).item() == 0.0


def test_aggregate_errors():
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(t(LOSS), MASK, "mean")
    with pytest.raises(ValueError, match="mask must be"):
        aggregate(t(LOSS), MASK[:, :2], "token_mean")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(t(LOSS), MASK, "seq_mean_token_sum_norm", norm_len=0)
    with pytest.raises(ValueError, match=">= 0"):
        aggregate(t(LOSS), MASK, "token_mean", num_tokens=-1)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_gradcheck(mode):
    loss = torch.randn(3, 4, dtype=D, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert torch.autograd.gradcheck(lambda x: aggregate(x, mask, mode), (loss,))


# --------------------------------------------------------------------------- ppo


def _ppo_case():
    # ratios 1.5, 0.5, 1.1, 3.0 with advantages +1, -1, +2, -1
    old = t([[-1.0, -2.0, -0.5, -3.0]])
    logp = (old + torch.log(t([[1.5, 0.5, 1.1, 3.0]]))).requires_grad_()
    adv = t([[1.0, -1.0, 2.0, -1.0]])
    return logp, old, adv, torch.ones(1, 4)


def test_ppo_hand_numbers_and_metrics():
    logp, old, adv, mask = _ppo_case()
    loss, m = policy_loss(logp, old, adv, mask)
    # per token: max(-1.5, -1.2) = -1.2 | max(.5, .8) = .8 | -2.2 | max(3, 1.2) = 3
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2 + 3.0) / 4)
    loss.backward()
    # clipped tokens have no gradient; the others d(-A r)/dlogp = -A r
    torch.testing.assert_close(logp.grad, t([[0.0, 0.0, -2.2, 3.0]]) / 4)
    assert m["clip_frac_low"].item() == 0.25 and m["clip_frac_high"].item() == 0.25
    assert m["clip_frac"].item() == 0.5 and m["clip_frac_dual"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 3.0) / 4)
    assert m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_max"].item() == pytest.approx(3.0)
    r = t([1.5, 0.5, 1.1, 3.0])
    assert m["approx_kl"].item() == pytest.approx((r - 1 - r.log()).mean().item())
    assert all(v.requires_grad is False for v in m.values())


def test_ppo_dual_clip():
    logp, old, adv, mask = _ppo_case()
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=2.0)
    # the A<0, r=3 token is capped at -A * c = 2 and loses its gradient
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2 + 2.0) / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[0.0, 0.0, -2.2, 0.0]]) / 4)
    assert m["clip_frac_dual"].item() == 0.25


def test_ppo_clip_higher():
    old = t([[0.0, 0.0]])
    logp = torch.log(t([[1.25, 0.75]])).requires_grad_()
    adv = t([1.0])
    sym, _ = policy_loss(logp, old, adv, torch.ones(1, 2))
    asym, m = policy_loss(logp, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    assert sym.item() == pytest.approx((-1.2 - 0.75) / 2)
    assert asym.item() == pytest.approx((-1.25 - 0.75) / 2)  # 1.25 < 1.28: not clipped
    assert m["clip_frac"].item() == 0.0


def test_advantages_per_sequence_broadcast():
    logp = torch.randn(3, 4, dtype=D)
    old = logp + 0.1 * torch.randn(3, 4, dtype=D)
    adv = t([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    for objective in OBJECTIVES:
        a, _ = policy_loss(logp, old, adv, mask, objective=objective)
        b, _ = policy_loss(logp, old, adv[:, None].expand(3, 4), mask, objective=objective)
        torch.testing.assert_close(a, b)


def test_on_policy_default_old_logprobs():
    logp = torch.randn(2, 3, dtype=D, requires_grad=True)
    adv = t([1.0, -1.0])
    loss, m = policy_loss(logp, None, adv, torch.ones(2, 3))
    assert loss.item() == pytest.approx(0.0)  # ratio 1 everywhere, advantages sum to 0
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv[:, None].expand(2, 3) / 6)
    assert m["ratio_mean"].item() == 1.0 and m["approx_kl"].item() == 0.0


# --------------------------------------------------------------------------- gspo


def test_gspo_hand_numbers():
    old = t([[-1.0, -2.0, -1.0], [-1.0, -1.5, -9.0]])
    lr = t([[0.2, 0.4, 0.0], [-0.1, -0.3, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    logp = (old + lr).requires_grad_()
    adv = t([1.0, -1.0])
    loss, m = policy_loss(logp, old, adv, mask, objective="gspo", clip_low=0.2, clip_high=0.2)
    # s0 = e^.3 > 1.2 with A>0: clipped to 1.2; s1 = e^-.2 = .8187 (inside): loss -A s1
    s1 = math.exp(-0.2)
    assert loss.item() == pytest.approx((-1.2 + s1) / 2)
    loss.backward()
    # row 1 token grad: 1/2 (sequences) * 1/2 (tokens) * (-A) * s1
    torch.testing.assert_close(logp.grad, t([[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]]))
    assert m["clip_frac_high"].item() == 0.5  # the 2 tokens of row 0
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.3))


def test_gspo_gradient_equals_sequence_ratio_gradient():
    torch.manual_seed(0)
    old = torch.randn(3, 5, dtype=D)
    logp = (old + 0.05 * torch.randn(3, 5, dtype=D)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    adv = t([0.7, -1.2, 0.3])
    loss, _ = policy_loss(logp, old, adv, mask, objective="gspo", clip_low=1e-3, clip_high=1e-3)
    loss.backward()
    # reference: sequence ratio exp(mean log-ratio) with full gradient, PPO-clipped per sequence
    x = logp.detach().clone().requires_grad_()
    m = mask.to(D)
    s = torch.exp(((x - old) * m).sum(1) / m.sum(1))
    ref = torch.maximum(-adv * s, -adv * s.clamp(1 - 1e-3, 1 + 1e-3)).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logp.grad, x.grad)


# --------------------------------------------------------------------------- gmpo


def test_gmpo_hand_numbers():
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    lr = t([[0.5, -0.6, 0.1], [0.5, -0.6, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logp = (old + lr).requires_grad_()
    adv = t([1.0, -1.0])
    loss, m = policy_loss(logp, old, adv, mask, objective="gmpo", clip_low=0.4, clip_high=0.4)
    # A>0: min(l, clip(l)) = .4, -.6, .1 -> mean -1/30; A<0: max(l, clip(l)) = .5, -.4 -> .05
    r0, r1 = math.exp(-1 / 30), math.exp(0.05)
    assert loss.item() == pytest.approx((-r0 + r1) / 2)
    loss.backward()
    expected = t([[0.0, -0.5 * r0 / 3, -0.5 * r0 / 3], [0.5 * r1 / 2, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert m["ratio_min"].item() == pytest.approx(r0)


def test_gmpo_only_aggregates_per_sequence():
    with pytest.raises(ValueError, match="gmpo"):
        policy_loss(
            torch.zeros(1, 2), None, t([1.0]), torch.ones(1, 2), objective="gmpo", agg="token_mean"
        )


# --------------------------------------------------------------------------- cpgd


def test_cpgd_hand_numbers():
    old = t([[-1.0, -2.0, -1.5, -0.5]])
    logp = (old + t([[0.5, 0.1, -0.5, 0.3]])).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 4), objective="cpgd")
    hi, lo = math.log(1.2), math.log(0.8)
    # A>0: min(logp, old + log 1.2); A<0: max(logp, old + log .8); loss -A * clipped
    per_token = [1.0 - hi, 1.9, -1.5 + lo, -0.2]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[0.0, -1.0, 0.0, 1.0]]) / 4)
    assert m["clip_frac_high"].item() == 0.25 and m["clip_frac_low"].item() == 0.25


# --------------------------------------------------------------------------- gradient checks


def _random_batch(seed=0, b=3, t_=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t_, generator=g, dtype=D) * 3
    logp = (old + 0.3 * torch.randn(b, t_, generator=g, dtype=D)).requires_grad_()
    adv = torch.randn(b, generator=g, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    return logp, old, adv, mask


@pytest.mark.parametrize(
    "kwargs",
    [
        {"objective": "ppo"},
        {"objective": "ppo", "dual_clip": 1.3, "clip_high": 0.28},
        {"objective": "ppo", "agg": "seq_mean_token_sum_norm", "norm_len": 8},
        {"objective": "gspo", "clip_low": 0.05, "clip_high": 0.06},
        {"objective": "gspo", "agg": "token_mean"},
        {"objective": "gmpo", "clip_low": 0.2, "clip_high": 0.3},
        {"objective": "cpgd"},
        {"objective": "cpgd", "agg": "seq_mean_token_mean"},
    ],
)
def test_policy_loss_gradcheck(kwargs):
    logp, old, adv, mask = _random_batch()
    rollout = old + 0.2 * torch.randn(old.shape, dtype=D)
    fn = lambda x: policy_loss(x, old, adv, mask, **kwargs)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp,))
    # GSPO's token ratio is a surrogate: its value is the sequence ratio, its gradient flows
    # through each token's own log-prob. With weights that vary across a sequence's tokens
    # (token TIS) that gradient is by design not the derivative of the value, so gspo is
    # checked with the per-sequence weights of "sequence_mask".
    mode = "sequence_mask" if kwargs["objective"] == "gspo" else "token"
    fn_tis = lambda x: policy_loss(  # noqa: E731
        x, old, adv, mask, rollout_logprobs=rollout, tis_mode=mode, tis_cap=3.0, **kwargs
    )[0]
    assert torch.autograd.gradcheck(fn_tis, (logp,))


def test_value_and_entropy_gradcheck():
    logp, old, _, mask = _random_batch()
    returns = torch.randn(old.shape, dtype=D)
    for clip in (0.2, None):
        assert torch.autograd.gradcheck(
            lambda v, c=clip: value_loss(v, old, returns, mask, clip=c)[0], (logp,)
        )
    ent = logp.detach().neg().requires_grad_()
    assert torch.autograd.gradcheck(lambda e: entropy_bonus(e, mask, 0.01)[0], (ent,))


# --------------------------------------------------------------------------- accumulation


ACCUMULATION_CASES = [
    (objective, agg)
    for objective in OBJECTIVES
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    if objective != "gmpo" or agg == "seq_mean_token_mean"  # gmpo is per sequence only
]


@pytest.mark.parametrize("objective, agg", ACCUMULATION_CASES)
def test_gradient_accumulation_with_global_counts(objective, agg):
    g = torch.Generator().manual_seed(1)
    b, T = 6, 7
    old = -torch.rand(b, T, generator=g, dtype=D) * 2
    logp = (old + 0.3 * torch.randn(b, T, generator=g, dtype=D)).requires_grad_()
    adv = torch.randn(b, generator=g, dtype=D)
    lengths = torch.tensor([7, 1, 3, 0, 6, 2])  # unequal micro-batch token counts, one empty
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    kw = dict(objective=objective, agg=agg, norm_len=T)

    full, _ = policy_loss(logp, old, adv, mask, **kw)
    (g_full,) = torch.autograd.grad(full, logp)

    counts = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(1) > 0).sum())
    micro = [slice(0, 2), slice(2, 6)]
    total, total_naive = 0, 0
    for sl in micro:
        part, _ = policy_loss(logp[sl], old[sl], adv[sl], mask[sl], **kw, **counts)
        naive, _ = policy_loss(logp[sl], old[sl], adv[sl], mask[sl], **kw)
        total, total_naive = total + part, total_naive + naive / len(micro)
    (g_acc,) = torch.autograd.grad(total, logp)
    (g_naive,) = torch.autograd.grad(total_naive, logp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_acc, g_full)
    # without the global counts, averaging micro-batch means is not the big-batch gradient
    assert not torch.allclose(g_naive, g_full)

    # two data-parallel ranks whose gradient reduce averages: divide the counts by world size
    world = 2
    rank_grads = []
    for sl in micro:
        x = logp.detach()[sl].clone().requires_grad_()
        part, _ = policy_loss(
            x, old[sl], adv[sl], mask[sl], **kw,
            num_tokens=counts["num_tokens"] / world, num_seqs=counts["num_seqs"] / world,
        )  # fmt: skip
        part.backward()
        rank_grads.append(x.grad)
    torch.testing.assert_close(torch.cat(rank_grads) / world, g_full)


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_all_masked_micro_batch_is_finite_zero(objective):
    logp, old, adv, _ = _random_batch()
    with torch.no_grad():
        logp[0, 0] = math.nan  # garbage on padding must not leak into the gradient
    mask = torch.zeros(3, 5)
    rollout = old + 5.0
    loss, m = policy_loss(logp, old, adv, mask, objective=objective, rollout_logprobs=rollout)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert all(torch.isfinite(v).all() for v in m.values())
    assert m["ratio_mean"].item() == 1.0 and m["clip_frac"].item() == 0.0


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_empty_batch_is_zero(objective):
    loss, m = policy_loss(
        torch.zeros(0, 4, requires_grad=True),
        None,
        torch.zeros(0),
        torch.zeros(0, 4),
        objective=objective,
    )
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_nan_on_padding_never_reaches_loss_or_grad(objective):
    logp, old, adv, mask = _random_batch()
    clean, _ = policy_loss(logp, old, adv, mask, objective=objective)
    (g_clean,) = torch.autograd.grad(clean, logp)
    dirty_lp = logp.detach().clone()
    dirty_lp[mask == 0] = math.nan
    dirty_lp.requires_grad_()
    dirty_old = old.clone()
    dirty_old[mask == 0] = math.inf
    dirty, _ = policy_loss(dirty_lp, dirty_old, adv, mask, objective=objective)
    (g_dirty,) = torch.autograd.grad(dirty, dirty_lp)
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(g_dirty, g_clean)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("shift", [1e4, -1e4])
def test_huge_log_ratios_stay_finite(objective, shift):
    for dtype in (torch.float32, D):
        old = torch.full((2, 3), -1.0, dtype=dtype)
        logp = (old + shift).requires_grad_()
        adv = torch.tensor([1.0, -1.0], dtype=dtype)
        loss, m = policy_loss(logp, old, adv, torch.ones(2, 3), objective=objective)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert all(torch.isfinite(v) for v in m.values())
    loss, _ = policy_loss(logp, old, adv, torch.ones(2, 3), objective="ppo", dual_clip=3.0)
    assert torch.isfinite(loss)


def test_zero_length_response_is_excluded_from_sequence_mean():
    logp, old, adv, mask = _random_batch()
    empty = mask.clone()
    empty[1] = 0
    for objective in OBJECTIVES:
        with_empty, _ = policy_loss(logp, old, adv, empty, objective=objective)
        keep = [0, 2]
        without, _ = policy_loss(logp[keep], old[keep], adv[keep], empty[keep], objective=objective)
        torch.testing.assert_close(with_empty, without)


def test_bf16_inputs_are_upcast():
    logp = torch.randn(2, 3).to(torch.bfloat16).requires_grad_()
    loss, m = policy_loss(logp, logp.detach() - 0.1, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    assert loss.dtype == torch.float32 and m["ratio_mean"].dtype == torch.float32
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16


def test_policy_loss_argument_errors():
    x, mask, a = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1)
    with pytest.raises(ValueError, match="unknown policy objective 'grpo'"):
        policy_loss(x, None, a, mask, objective="grpo")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(x, None, a, mask, dual_clip=0.9)
    with pytest.raises(ValueError, match="dual_clip applies"):
        policy_loss(x, None, a, mask, objective="cpgd", dual_clip=3.0)
    with pytest.raises(ValueError, match="clip_low must be < 1"):
        policy_loss(x, None, a, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(x, None, torch.ones(3), mask)
    with pytest.raises(ValueError, match="old_logprobs shape"):
        policy_loss(x, torch.zeros(1, 3), a, mask)
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        policy_loss(x, None, a, mask, agg="sum")


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand_numbers():
    v = t([[1.4, 2.0, -1.0]], grad=True)
    old = t([[0.8, 1.0, 0.0]])
    ret = t([[1.5, 1.0, 1.0]])
    loss, m = value_loss(v, old, ret, torch.ones(1, 3), clip=0.5)
    # t0: max(.01, (1.3 - 1.5)^2 = .04); t1: max(1, .25); t2: max(4, 2.25)
    assert loss.item() == pytest.approx(0.5 * (0.04 + 1.0 + 4.0) / 3)
    loss.backward()
    torch.testing.assert_close(v.grad, t([[0.0, 1 / 3, -2 / 3]]))
    assert m["value_clip_frac"].item() == pytest.approx(1 / 3)
    assert m["value_error"].item() == pytest.approx((0.01 + 1 + 4) / 3)
    assert m["value_mean"].item() == pytest.approx(2.4 / 3)
    plain, _ = value_loss(v, old, ret, torch.ones(1, 3), clip=None)
    assert plain.item() == pytest.approx(0.5 * (0.01 + 1.0 + 4.0) / 3)


def test_value_loss_all_masked_and_errors():
    v = torch.randn(2, 3, dtype=D, requires_grad=True)
    loss, m = value_loss(v, v.detach(), v.detach(), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(v.grad, torch.zeros_like(v))
    with pytest.raises(ValueError, match="returns shape"):
        value_loss(v, v, torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="value clip"):
        value_loss(v, v, v, torch.ones(2, 3), clip=0.0)


# --------------------------------------------------------------------------- importance weights


def test_tis_weights_token_and_sequence_mask():
    rollout = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    old = rollout + torch.log(t([[3.0, 0.5, 1.0], [1.5, 1.2, 7.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = tis_weights(old, rollout, mask, mode="token", cap=2.0)
    torch.testing.assert_close(w, t([[2.0, 0.5, 1.0], [1.5, 1.2, 0.0]]))
    w = tis_weights(old, rollout, mask, mode="sequence_mask", cap=2.0)
    # row 0: rho = 3 * .5 * 1 = 1.5 -> kept with weight 1.5; row 1: 1.5 * 1.2 = 1.8 -> kept
    torch.testing.assert_close(w, t([[1.5, 1.5, 1.5], [1.8, 1.8, 0.0]]))
    w = tis_weights(old, rollout, mask, mode="sequence_mask", cap=1.6)
    torch.testing.assert_close(w, t([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="tis mode"):
        tis_weights(old, rollout, mask, mode="sequence")
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, rollout, mask, cap=0.0)


@pytest.mark.parametrize("mode", ["token", "sequence_mask"])
def test_policy_loss_applies_tis(mode):
    logp, old, adv, mask = _random_batch()
    rollout = old + 0.4 * torch.randn(old.shape, dtype=D)
    loss, m = policy_loss(
        logp, old, adv, mask, rollout_logprobs=rollout, tis_mode=mode, tis_cap=1.5
    )
    w = tis_weights(old, rollout, mask, mode=mode, cap=1.5)
    ratio = (logp - old).exp()
    a = adv[:, None]
    mat = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * w
    torch.testing.assert_close(loss, (mat * mask).sum() / mask.sum())
    assert m["tis_weight_mean"].item() == pytest.approx(w[mask.bool()].mean().item())
    capped = (w >= 1.5) if mode == "token" else (w == 0)
    assert m["tis_frac_capped"].item() == pytest.approx(capped[mask.bool()].double().mean().item())


# --------------------------------------------------------------------------- entropy


def test_entropy_bonus_sign_and_value():
    ent = t([[1.0, 2.0], [3.0, 99.0]], grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    term, m = entropy_bonus(ent, mask, 0.1)
    assert term.item() == pytest.approx(-0.1 * 2.0)
    term.backward()
    torch.testing.assert_close(ent.grad, t([[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]]))
    assert m["entropy"].item() == pytest.approx(2.0)


def test_high_entropy_selection_is_batch_quantile():
    ent = torch.arange(1.0, 13.0).view(2, 6)  # 1..12
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0  # 11 and 12 are padding: never selected
    # valid entropies 1..10: top 20% = {9, 10}; top 25% = ceil(2.5) = 3 tokens
    assert entropy_threshold(ent, mask, 0.2).item() == 9.0
    sel = high_entropy_mask(ent, mask, 0.2)
    assert sel.dtype == torch.bool and sel.sum() == 2 and sel[1, 2] and sel[1, 3]
    assert high_entropy_mask(ent, mask, 0.25).sum() == 3
    assert high_entropy_mask(ent, mask, 1.0).sum() == 10
    assert high_entropy_mask(torch.ones(2, 3), torch.ones(2, 3), 0.2).sum() == 6  # ties kept
    assert not high_entropy_mask(ent, torch.zeros(2, 6)).any()
    with pytest.raises(ValueError, match="rho"):
        high_entropy_mask(ent, mask, 0.0)


def test_value_clip_inf_is_the_plain_loss_and_the_config_bounds_it():
    """``algorithm.value.clip: null`` means the default 0.5, so ``.inf`` is how a config turns
    clipping off: the clipped term then equals the plain one."""
    from lightrft.algorithms.config import ValueConfig

    v, old, ret = torch.randn(2, 5, dtype=D), torch.randn(2, 5, dtype=D), torch.randn(2, 5, dtype=D)
    mask = torch.ones(2, 5)
    plain, _ = value_loss(v, old, ret, mask, clip=None)
    off, m = value_loss(v, old, ret, mask, clip=ValueConfig.read({"clip": math.inf}).clip)
    assert torch.equal(off, plain) and m["value_clip_frac"].item() == 0.0
    assert ValueConfig.read({"clip": None}).clip is None
    for bad in (0.0, -0.2, math.nan):
        with pytest.raises(ValueError, match="clip must be > 0"):
            ValueConfig.read({"clip": bad})
