"""Advantage estimators on small tensors with hand-derived numbers."""

import math

import pytest
import torch

from lightrft.algorithms import (
    ESTIMATORS,
    compute_advantages,
    cpgd,
    dr_grpo,
    gae,
    grpo,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    to_token_rewards,
)

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


# --------------------------------------------------------------------------- grpo family


def test_grpo_group_scale_hand_numbers():
    r = t([1, 0, 1, 0, 2, 2, 2, 2, 0, 0, 0, 3])
    out = grpo(r, 4, eps=0.0)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: equal -> 0; group 2: mean .75, std 1.5
    s = math.sqrt(1 / 3)
    expected = t([0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s, 0, 0, 0, 0, -0.5, -0.5, -0.5, 1.5])
    torch.testing.assert_close(out, expected)
    # The default eps=1e-6 sits in the denominator.
    torch.testing.assert_close(grpo(r, 4)[:2], t([0.5, -0.5]) / (s + 1e-6))


def test_grpo_batch_scale_and_none():
    r = t([1, 0, 1, 0, 2, 2, 2, 2])
    # batch std: mean 1.25, squared deviations sum 5.5 over 7 -> std sqrt(5.5/7); group means kept
    std = math.sqrt(5.5 / 7)
    torch.testing.assert_close(
        grpo(r, 4, scale="batch", eps=0.0), t([0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0]) / std
    )
    expected = t([0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0])
    torch.testing.assert_close(grpo(r, 4, scale="none"), expected)
    torch.testing.assert_close(dr_grpo(r, 4), expected)


def test_rloo_leave_one_out():
    r = t([1, 0, 1, 0, 3, 0])
    # r=1: others (0,1,0) mean 1/3; r=0: others mean 2/3; group 2 of size 2: 3-0, 0-3
    out = rloo(r, 2)
    torch.testing.assert_close(out, t([1, -1, 1, -1, 3, -3]))
    out4 = rloo(r[:4], 4)
    torch.testing.assert_close(out4, t([2 / 3, -2 / 3, 2 / 3, -2 / 3]))
    torch.testing.assert_close(out4, 4 / 3 * dr_grpo(r[:4], 4))


def test_cpgd_weights():
    r = t([1, 0, 1, 0, 2, 2, 2, 2])
    # "filter": 1 of 2 groups informative -> scale 2 on the centred rewards
    torch.testing.assert_close(cpgd(r, 4), t([1, -1, 1, -1, 0, 0, 0, 0]))
    torch.testing.assert_close(cpgd(r, 4, weight="none"), dr_grpo(r, 4))
    torch.testing.assert_close(cpgd(r, 4, weight="std"), grpo(r, 4))
    # no informative group: all zeros, no division by zero
    assert torch.equal(cpgd(t([1, 1, 0, 0]), 2), t([0, 0, 0, 0]))
    with pytest.raises(ValueError, match="weight"):
        cpgd(r, 4, weight="median")


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo, cpgd])
@pytest.mark.parametrize("value", [0.1, 1.0, -3.7, 0.0])
def test_equal_rewards_give_exact_zero(fn, value):
    r = torch.full((8,), value)
    out = fn(r, 4)
    assert torch.equal(out, torch.zeros(8)), out
    # eps=0 for grpo would be 0/0 without the explicit zeroing
    assert torch.equal(grpo(r, 4, eps=0.0), torch.zeros(8))
    assert torch.equal(grpo(r, 4, eps=0.0, scale="batch"), torch.zeros(8))


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo, cpgd])
def test_group_estimators_reject_bad_groups(fn):
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="group_size"):
        fn(r, 1)
    with pytest.raises(ValueError, match="multiple of group_size"):
        fn(r, 4)
    with pytest.raises(ValueError, match="1-D"):
        fn(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="NaN or inf at sample indices \\[2\\]"):
        fn(t([0, 1, math.nan, 1]), 2)


def test_integer_rewards_are_accepted():
    # group [1, 0]: mean .5, unbiased std sqrt(.5)
    out = grpo(torch.tensor([1, 0, 1, 1]), 2, eps=0.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0.0, 0.0]) / math.sqrt(0.5))


# --------------------------------------------------------------------------- token-level helpers


def test_to_token_rewards_last_valid_token_and_empty_row():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0]])
    out = to_token_rewards(t([1, 2, 3, 4]), mask)
    expected = t([[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 4, 0]])
    torch.testing.assert_close(out, expected)


def test_masked_whiten_hand_numbers_and_degenerate_masks():
    x = t([[0.25, 0.5, 1.0, 99.0], [1.0, 2.0, -7.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # valid: .25 .5 1 1 2 -> mean .95, unbiased var 1.8 / 4 = .45
    dev = t([[-0.7, -0.45, 0.05, 0.0], [0.05, 1.05, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(x, mask), dev / math.sqrt(0.45 + 1e-8))
    one = torch.zeros_like(mask)
    one[0, 1] = 1
    assert torch.equal(masked_whiten(x, one), torch.zeros_like(x))
    assert torch.equal(masked_whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))


def test_reinforce_pp_discounting_and_whitening():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tok = to_token_rewards(t([1.0, 2.0]), mask)
    advantages, returns = reinforce_pp(tok, mask, gamma=0.5)
    torch.testing.assert_close(returns, t([[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]]))
    torch.testing.assert_close(advantages, masked_whiten(returns, mask))
    assert advantages[0, 3] == 0 and advantages[1, 2:].abs().sum() == 0


def test_reinforce_pp_skips_interior_masked_tokens():
    mask = torch.tensor([[1, 0, 1]])
    tok = t([[0.0, 5.0, 1.0]])  # the masked reward is ignored and is no discount step
    _, returns = reinforce_pp(tok, mask, gamma=0.5)
    torch.testing.assert_close(returns, t([[0.5, 0.0, 1.0]]))


def test_reinforce_pp_baseline_hand_numbers():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages, returns = reinforce_pp_baseline(t([1.0, 0.0]), mask, 2)
    torch.testing.assert_close(returns, t([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))
    # valid .5 .5 -.5: mean 1/6, deviations 1/3 1/3 -2/3, unbiased var 1/3
    s = math.sqrt(1 / 3 + 1e-8)
    torch.testing.assert_close(advantages, t([[1 / 3, 1 / 3, 0.0], [-2 / 3, 0.0, 0.0]]) / s)
    with pytest.raises(ValueError, match="group_size"):
        reinforce_pp_baseline(t([1.0, 0.0]), mask, 1)


def test_gae_hand_numbers():
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.2, 0.4]])
    mask = torch.ones(1, 3)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # deltas .6, .2, -.3 -> A = [-.05, .5, .6]; returns = A + V
    torch.testing.assert_close(returns, t([[0.45, 0.7, 1.0]]))
    # whitened: mean .35, unbiased var .245 / 2
    torch.testing.assert_close(advantages, t([[-0.4, 0.15, 0.25]]) / math.sqrt(0.1225 + 1e-8))


def test_gae_skips_padding_and_discounts():
    rewards = t([[0.0, 9.0, 1.0, 0.0]])
    values = t([[0.5, 7.0, 0.4, 3.0]])
    mask = torch.tensor([[1, 0, 1, 0]])
    _, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # t2: delta 1 - .4 = .6; t0 bootstraps from t2: delta .4 - .5 = -.1, A = -.1 + .5 * .6 = .2
    torch.testing.assert_close(returns, t([[0.7, 0.0, 1.0, 0.0]]))
    _, returns = gae(t([[0.0, 1.0]]), t([[0.5, 0.4]]), torch.ones(1, 2), gamma=0.9, lam=1.0)
    # lam=1: A_t = discounted return - V_t; returns = discounted returns
    torch.testing.assert_close(returns, t([[0.9, 1.0]]))


def test_token_estimators_on_empty_mask_are_zero_not_nan():
    mask = torch.zeros(2, 3)
    tok = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    for out in (*reinforce_pp(tok, mask), *gae(tok, tok, mask)):
        assert torch.equal(out, torch.zeros_like(tok))


def test_token_estimator_argument_checks():
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp(torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5)
    with pytest.raises(ValueError, match="values shape"):
        gae(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask shape"):
        reinforce_pp(torch.zeros(1, 2), torch.ones(1, 3))


# --------------------------------------------------------------------------- dispatch


def test_registry_names():
    assert set(ESTIMATORS) == {
        "grpo", "dr_grpo", "rloo", "cpgd", "reinforce_pp", "reinforce_pp_baseline", "gae"
    }  # fmt: skip
    assert ESTIMATORS["grpo"].fn is grpo and ESTIMATORS["gae"].fn is gae


def test_compute_advantages_broadcasts_group_estimators():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    rewards = t([1.0, 0.0, 2.0, 2.0])
    out, returns = compute_advantages("grpo", rewards=rewards, mask=mask, group_size=2)
    assert returns is None
    a = grpo(rewards, 2)
    torch.testing.assert_close(out, a.unsqueeze(1) * mask)
    out, _ = compute_advantages("grpo", rewards=rewards, mask=mask, group_size=2, scale="none")
    torch.testing.assert_close(out[:, 0], t([0.5, -0.5, 0.0, 0.0]))


def test_compute_advantages_scores_token_rewards_by_their_sum():
    mask = torch.tensor([[1, 1], [1, 0]])
    tok = t([[0.2, 1.0], [0.1, 5.0]])  # the padded 5.0 does not count
    out, _ = compute_advantages("rloo", token_rewards=tok, mask=mask, group_size=2)
    torch.testing.assert_close(out, t([[1.1, 1.1], [-1.1, 0.0]]))


def test_compute_advantages_token_estimators():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards = t([1.0, -1.0])
    a, r = compute_advantages("reinforce_pp", rewards=rewards, mask=mask, gamma=1.0)
    ea, er = reinforce_pp(to_token_rewards(rewards, mask), mask)
    torch.testing.assert_close(a, ea)
    torch.testing.assert_close(r, er)
    values = t([[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]])
    a, r = compute_advantages("gae", rewards=rewards, mask=mask, values=values, lam=1.0)
    ea, er = gae(to_token_rewards(rewards, mask), values, mask, lam=1.0)
    torch.testing.assert_close(a, ea)
    torch.testing.assert_close(r, er)
    a, r = compute_advantages("reinforce_pp_baseline", rewards=rewards, mask=mask, group_size=2)
    torch.testing.assert_close(a, reinforce_pp_baseline(rewards, mask, 2)[0])


def test_compute_advantages_errors():
    mask = torch.ones(2, 2)
    r = t([1.0, 0.0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", rewards=r, mask=mask)
    with pytest.raises(ValueError, match="unexpected \\['lam'\\]"):
        compute_advantages("grpo", rewards=r, mask=mask, group_size=2, lam=0.9)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", rewards=r, mask=mask)
    with pytest.raises(ValueError, match="needs group_size"):
        compute_advantages("rloo", rewards=r, mask=mask)
    with pytest.raises(ValueError, match="rewards \\[B\\] or token_rewards"):
        compute_advantages("grpo", mask=mask, group_size=2)
