"""KL estimators, KL in the reward / in the loss, and the coefficient controllers."""

import math

import pytest
import torch

from lightrft.algorithms import kl
from lightrft.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    estimate,
    kl_in_loss,
    kl_in_reward,
)

D = torch.float64


def t(x, grad=False):
    return torch.tensor(x, dtype=D, requires_grad=grad)


def test_estimators_hand_numbers():
    logp, ref = t([[-1.0, -2.0]]), t([[-1.5, -2.0]])
    # diff = logp - ref = .5, 0; k3 uses d = ref - logp = -.5: e^-.5 + .5 - 1
    torch.testing.assert_close(estimate(logp, ref, "k1"), t([[0.5, 0.0]]))
    torch.testing.assert_close(estimate(logp, ref, "abs"), t([[0.5, 0.0]]))
    torch.testing.assert_close(estimate(logp, ref, "k2"), t([[0.125, 0.0]]))
    k3 = math.exp(-0.5) - 0.5
    torch.testing.assert_close(estimate(logp, ref, "k3"), t([[k3, 0.0]]))
    torch.testing.assert_close(estimate(logp, ref, "k3+"), t([[k3, 0.0]]))
    for alias, kind in kl.ALIASES.items():
        torch.testing.assert_close(estimate(logp, ref, alias), estimate(logp, ref, kind))


def test_k3_plus_has_k3_value_and_k2_gradient():
    logp = t([[-1.0, -0.2, -3.0]], grad=True)
    ref = t([[-1.5, -0.1, -1.0]])
    value = estimate(logp, ref, "k3+")
    torch.testing.assert_close(value, estimate(logp, ref, "k3"))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())  # d/dx 0.5 (x - ref)^2


def test_k3_clamps_keep_huge_ratios_finite():
    logp = t([[0.0, -200.0, -1.0]], grad=True)
    ref = t([[-200.0, 0.0, -1.0]])
    out = estimate(logp, ref, "k3")
    # d = -20 (clamped): e^-20 + 19 -> clamped to 10; d = +20: e^20 - 21 -> clamped to 10
    torch.testing.assert_close(out, t([[10.0, 10.0, 0.0]]))
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert torch.isfinite(estimate(logp, ref, "k3+")).all()


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_loss_gradcheck(kind):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g, dtype=D)).requires_grad_()
    ref = logp.detach() + 0.3 * torch.randn(3, 4, generator=g, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    fn = lambda x: kl_in_loss(estimate(x, ref, kind), mask, 0.1)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp,))


def test_estimate_errors_and_upcast():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        estimate(t([[0.0]]), t([[0.0]]), "k4")
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        estimate(t([[0.0]]), t([[0.0, 1.0]]), "k1")
    out = estimate(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2), "k3")
    assert out.dtype == torch.float32


def test_kl_in_reward_hand_numbers():
    rewards = t([1.0, 2.0])
    kl_mat = t([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]], grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out, m = kl_in_reward(rewards, kl_mat, mask, 0.5)
    torch.testing.assert_close(out, t([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]))
    assert not out.requires_grad
    assert m["kl"].item() == pytest.approx((0.2 + 0.45) / 2)
    assert m["kl_coef"].item() == 0.5
    token_level, _ = kl_in_reward(t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]]), kl_mat, mask, 0.5)
    torch.testing.assert_close(token_level, out)
    with pytest.raises(ValueError, match="kl shape"):
        kl_in_reward(rewards, kl_mat[:, :2], mask, 0.5)


def test_kl_in_loss_hand_numbers():
    kl_mat = t([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]], grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    term, m = kl_in_loss(kl_mat, mask, 0.1)
    assert term.item() == pytest.approx(0.1 * 1.5 / 5)
    term.backward()
    torch.testing.assert_close(kl_mat.grad, 0.1 / 5 * mask.to(D))
    term, _ = kl_in_loss(kl_mat, mask, 0.1, agg="seq_mean_token_mean")
    assert term.item() == pytest.approx(0.1 * (0.2 + 0.45) / 2)
    assert m["kl"].item() == pytest.approx((0.2 + 0.45) / 2)
    empty, _ = kl_in_loss(kl_mat, torch.zeros(2, 3), 0.1)
    assert empty.item() == 0.0


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(100.0, 512)
    assert c.coef == 0.05 and c.value == 0.05
    with pytest.raises(ValueError, match="coef"):
        FixedKLController(-1.0)


def test_adaptive_controller_update_rule():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(12.0, 256)  # error 1.0 clipped to 0.2
    assert c.coef == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    c2 = AdaptiveKLController(0.1, 6.0, 10000)
    c2.update(torch.tensor(3.0), 256)  # error -0.5 clipped to -0.2
    assert c2.coef == pytest.approx(0.1 * (1 - 0.2 * 256 / 10000))
    c3 = AdaptiveKLController(0.1, 6.0, 1000)
    c3.update(6.6, 1000)  # error 0.1, inside the clip
    assert c3.coef == pytest.approx(0.1 * 1.1)
    restored = AdaptiveKLController(1.0, 1.0, 1.0)
    restored.load_state_dict(c.state_dict())
    assert restored.state_dict() == c.state_dict()
    restored.update(7.0, 10)
    c.update(7.0, 10)
    assert restored.coef == c.coef
    for bad in [(-0.1, 6.0, 10.0), (0.1, 0.0, 10.0), (0.1, 6.0, 0.0)]:
        with pytest.raises(ValueError):
            AdaptiveKLController(*bad)


def test_build_kl_controller():
    assert isinstance(build_kl_controller("fixed", 0.1), FixedKLController)
    c = build_kl_controller("adaptive", 0.1, target=6.0, horizon=100)
    assert isinstance(c, AdaptiveKLController) and c.horizon == 100
    with pytest.raises(ValueError, match="target and horizon"):
        build_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="unknown KL controller"):
        build_kl_controller("pid", 0.1)
