"""Reward-model losses: hand-derived numbers, gradchecks, masking of missing candidates."""

import math

import pytest
import torch

from lightrft.algorithms.reward_losses import (
    bradley_terry_loss,
    center_loss,
    hps_loss,
    log_exp_loss,
    pairwise_stats,
    preference_loss,
    safety_sign_loss,
)


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_bradley_terry_by_hand():
    # Item 0: r_c=2, r_r=1 -> -logsigmoid(1) = log(1 + e^-1) = 0.31326.
    # Item 1: r_c=0, r_r=1, margin 0.5 -> -logsigmoid(-1.5) = log(1 + e^1.5) = 1.70141.
    scores = torch.tensor([[2.0, 1.0], [0.0, 1.0]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    out = bradley_terry_loss(scores, valid, torch.tensor([0.0, 0.5]))
    assert torch.allclose(out, torch.tensor([0.313262, 1.701413]), atol=1e-6)
    assert math.isclose(out[0].item(), _softplus(-1.0), rel_tol=1e-6)


def test_list_losses_average_valid_rejected_only():
    # Three candidates for item 0, two for item 1 (third column missing: its 99 must not count).
    scores = torch.tensor([[1.0, 0.0, 1.0], [3.0, 1.0, 99.0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    bt = bradley_terry_loss(scores, valid)
    want0 = (_softplus(-1.0) + _softplus(0.0)) / 2  # (0.31326 + 0.69315) / 2 = 0.50320
    want1 = _softplus(-2.0)  # 0.12693
    assert torch.allclose(bt, torch.tensor([want0, want1]), atol=1e-6)
    # log-exp is the same function (no margin); it refuses a margin.
    assert torch.allclose(log_exp_loss(scores, valid), bt, atol=1e-7)
    with pytest.raises(ValueError, match="margin"):
        log_exp_loss(scores, valid, torch.tensor([1.0, 0.0]))
    # HPS: -log softmax over valid candidates. Item 0: -log(e^1 / (e^1 + e^0 + e^1)) =
    # log(2 + e^-1) = 0.86199; item 1 (a pair) equals Bradley-Terry.
    hps = hps_loss(scores, valid)
    assert torch.allclose(hps, torch.tensor([math.log(2 + math.exp(-1)), want1]), atol=1e-6)
    # Centring: mean over rejected of (r_c + r_k)^2: item 0 (1 + 4) / 2 = 2.5, item 1 16.
    assert torch.allclose(center_loss(scores, valid), torch.tensor([2.5, 16.0]))
    total = preference_loss(scores, valid, kind="bradley_terry", center_coef=0.1)
    assert torch.allclose(total, bt + 0.1 * torch.tensor([2.5, 16.0]), atol=1e-6)
    with pytest.raises(ValueError, match="loss must be one of"):
        preference_loss(scores, valid, kind="hinge")


def test_safety_sign_and_pairwise_stats():
    # Costs of (chosen, rejected); chosen safe (+1) and rejected unsafe (-1) in item 0; item 1
    # unlabelled. Safe wants c < 0: -logsigmoid(-c); unsafe wants c > 0: -logsigmoid(c).
    costs = torch.tensor([[-1.0, 2.0], [5.0, 5.0]])
    safe = torch.tensor([[1, -1], [0, 0]])
    out = safety_sign_loss(costs, safe)
    assert torch.allclose(out, torch.tensor([_softplus(-1.0) + _softplus(-2.0), 0.0]), atol=1e-6)
    scores = torch.tensor([[2.0, 1.0, 3.0], [1.0, 1.0, 0.0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    acc, margin = pairwise_stats(scores, valid)
    assert torch.allclose(acc, torch.tensor([0.5, 0.5]))  # one win of two; one tie of one
    assert torch.allclose(margin, torch.tensor([0.0, 0.0]))


@pytest.mark.parametrize("fn", [bradley_terry_loss, log_exp_loss, hps_loss, center_loss])
def test_gradcheck(fn):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    valid = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    assert torch.autograd.gradcheck(lambda s: fn(s, valid), (scores,))
    margin = torch.tensor([0.3, 0.0, -0.2], dtype=torch.float64)
    if fn in (bradley_terry_loss, hps_loss):
        assert torch.autograd.gradcheck(lambda s: fn(s, valid, margin), (scores,))
    costs = torch.randn(3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    safe = torch.tensor([[1, -1, 0], [0, 1, 0], [-1, -1, 1]])
    assert torch.autograd.gradcheck(lambda c: safety_sign_loss(c, safe), (costs,))
