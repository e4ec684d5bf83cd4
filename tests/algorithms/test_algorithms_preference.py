"""Preference losses: equal to TRL's on the same log-probs (fixtures), and hand-derived numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightrft.algorithms.preference import (
    PREFERENCE_LOSSES,
    PreferenceLoss,
    cdpo_loss,
    check_preference_loss,
    dpo_loss,
    ipo_loss,
    kto_loss,
    metric_means,
    orpo_loss,
    preference_metrics,
    rdpo_loss,
    simpo_loss,
)
from lightrft.training.preference import kto_reference_point

# Written by fixtures/make_trl_preference.py with TRL (version and function in each case).
FIX = json.loads((Path(__file__).parent / "fixtures" / "trl_preference.json").read_text())


def _t(key: str) -> torch.Tensor:
    return torch.tensor(FIX[key], dtype=torch.float32)


def _close(got: torch.Tensor, want: list[float]) -> None:
    # 1e-6 absolute, or relative where fp32 cannot resolve it (IPO's losses near 30: 1 ulp = 2e-6)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["dpo", "cdpo", "rdpo", "ipo", "simpo", "orpo"])
def test_paired_losses_equal_trl(name):
    case = FIX["cases"][name]
    assert case["trl"].startswith(f"trl {FIX['trl_version']} ")
    c, r, rc, rr = _t("chosen"), _t("rejected"), _t("ref_chosen"), _t("ref_rejected")
    lc, lr = _t("chosen_len"), _t("rejected_len")
    if PREFERENCE_LOSSES[name].length_normalize:  # TRL: IPO, SimPO and ORPO on per-token means
        c, r, rc, rr = c / lc, r / lr, rc / lc, rr / lr
    beta = case["beta"]
    kw = {}
    if name in ("cdpo", "rdpo", "simpo"):
        kw["label_smoothing"] = case["label_smoothing"]
    if name == "simpo":
        kw["gamma"] = case["simpo_gamma"]
    fn = PREFERENCE_LOSSES[name].fn
    if PREFERENCE_LOSSES[name].reference:
        loss, rew_c, rew_r = fn(c, r, rc, rr, beta=beta, **kw)
    else:
        loss, rew_c, rew_r = fn(c, r, beta=beta, **kw)
    _close(loss, case["loss"])
    if name == "ipo":  # TRL's IPO divides inside the loss; its logged rewards are on the sums
        _, rew_c, rew_r = fn(_t("chosen"), _t("rejected"), _t("ref_chosen"), _t("ref_rejected"))
    _close(rew_c, case["rewards_chosen"])
    _close(rew_r, case["rewards_rejected"])


def test_kto_equals_trl():
    k = FIX["kto"]
    every = torch.arange(len(k["kl_logps"]))  # all of them are mismatched pairs
    kl = kto_reference_point(torch.tensor(k["kl_logps"]), torch.tensor(k["ref_kl_logps"]), every)
    assert kl.item() == pytest.approx(k["kl"], abs=1e-6)
    loss, _ = kto_loss(
        torch.tensor(k["logps"]),
        torch.tensor(k["ref_logps"]),
        torch.tensor(k["label"]),
        kl,
        beta=k["beta"],
        desirable_weight=k["desirable_weight"],
        undesirable_weight=k["undesirable_weight"],
    )
    _close(loss, k["loss"])


# ------------------------------------------------------------------ hand-derived numbers


def test_dpo_at_equal_logratios_is_log2_and_gradient_is_minus_half_beta():
    c = torch.tensor([-3.0], requires_grad=True)
    loss, rc, rr = dpo_loss(c, torch.tensor([-5.0]), torch.tensor([-3.0]), torch.tensor([-5.0]))
    assert loss.item() == pytest.approx(math.log(2))
    assert rc.item() == 0.0 and rr.item() == 0.0
    loss.sum().backward()
    assert c.grad.item() == pytest.approx(-0.05)  # -beta * sigmoid(0)


def test_dpo_hand_number():
    # h = (-1 - -2) - (-4 - -3) = 2; beta 0.5 -> -logsigmoid(1) = log(1 + e^-1)
    loss, rc, rr = dpo_loss(
        torch.tensor([-1.0]),
        torch.tensor([-4.0]),
        torch.tensor([-2.0]),
        torch.tensor([-3.0]),
        beta=0.5,
    )
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1)))
    assert (rc.item(), rr.item()) == pytest.approx((0.5, -0.5))


def test_cdpo_and_rdpo_hand_numbers_and_limits():
    args = (torch.tensor([-1.0]), torch.tensor([-4.0]), torch.tensor([-2.0]), torch.tensor([-3.0]))
    a, b = math.log1p(math.exp(-1)), math.log1p(math.exp(1))  # -logsig(1), -logsig(-1)
    assert cdpo_loss(*args, beta=0.5, label_smoothing=0.25)[0].item() == pytest.approx(
        0.75 * a + 0.25 * b
    )
    assert rdpo_loss(*args, beta=0.5, label_smoothing=0.25)[0].item() == pytest.approx(
        (0.75 * a - 0.25 * b) / 0.5
    )
    for fn in (cdpo_loss, rdpo_loss):
        assert fn(*args, beta=0.5, label_smoothing=0.0)[0].item() == pytest.approx(a)


def test_ipo_is_zero_at_its_target_margin():
    beta = 0.25  # target h = 1 / (2 beta) = 2
    loss, _, _ = ipo_loss(
        torch.tensor([0.0, 0.0]),
        torch.tensor([-2.0, -1.0]),
        torch.zeros(2),
        torch.zeros(2),
        beta=beta,
    )
    assert loss.tolist() == pytest.approx([0.0, 1.0])


def test_simpo_hand_number():
    # beta (c - r) - gamma = 2 * 0.5 - 1 = 0 -> log 2
    loss, rc, rr = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), beta=2.0, gamma=1.0)
    assert loss.item() == pytest.approx(math.log(2))
    assert (rc.item(), rr.item()) == pytest.approx((-1.0, -2.0))


def test_orpo_hand_number_and_stability_near_zero():
    # p_c = 0.5, p_r = 0.2: odds 1 and 0.25 -> log odds ratio = log 4; loss = beta * log(1 + 1/4)
    lc, lr = math.log(0.5), math.log(0.2)
    loss, _, _ = orpo_loss(torch.tensor([lc]), torch.tensor([lr]), beta=0.1)
    assert loss.item() == pytest.approx(0.1 * math.log1p(0.25))
    near = orpo_loss(torch.tensor([-1e-7]), torch.tensor([-3.0]))[0]
    assert torch.isfinite(near).all()


def test_kto_hand_numbers():
    # r = (1, -1), z = 0: desirable 1 - sigmoid(beta), undesirable 1 - sigmoid(beta)
    beta = 0.5
    loss, rew = kto_loss(
        torch.tensor([0.0, -2.0]),
        torch.tensor([-1.0, -1.0]),
        torch.tensor([True, False]),
        beta=beta,
        desirable_weight=2.0,
        undesirable_weight=1.0,
    )
    s = 1 / (1 + math.exp(-0.5))
    assert loss.tolist() == pytest.approx([2 * (1 - s), 1 - s])
    assert rew.tolist() == pytest.approx([0.5, -0.5])
    # the reference point is clamped at 0 and detached
    policy = torch.tensor([-3.0, -3.0], requires_grad=True)
    z = kto_reference_point(policy, torch.tensor([-1.0, -1.0]), torch.tensor([0, 1]))
    assert z.item() == 0.0 and not z.requires_grad


def test_metrics_are_sums_with_counts_and_their_means():
    t = torch.tensor
    m = preference_metrics(t([1.0, 0.0]), t([0.5, 1.0]), t([-1.0, -2.0]), t([-3.0, -4.0]))
    assert m["rewards/margins"].item() == pytest.approx(-0.5)
    assert m["rewards/accuracies"].item() == 1.0 and m["n/pairs"].item() == 2
    means = metric_means({k: float(v) for k, v in m.items()}, "train/")
    assert means["train/rewards/margins"] == pytest.approx(-0.25)
    assert means["train/rewards/accuracies"] == 0.5 and means["train/logps/chosen"] == -1.5
    # unpaired (KTO): 2 desirable, 1 undesirable; the margin is the difference of the means
    u = preference_metrics(t([1.0, 3.0]), t([-1.0]), t([-1.0, -2.0]), t([-3.0]), paired=False)
    means = metric_means({k: float(v) for k, v in u.items()}, "eval/")
    assert means["eval/rewards/margins"] == pytest.approx(2.0 - (-1.0))
    assert "eval/rewards/accuracies" not in means


def test_check_refuses_by_name():
    with pytest.raises(ValueError, match="loss.beta must be > 0"):
        check_preference_loss("dpo", 0.0, {})
    with pytest.raises(ValueError, match="unknown preference loss 'dop'"):
        check_preference_loss("dop", 0.1, {})
    with pytest.raises(ValueError, match="loss.label_smoothing does not apply to loss 'dpo'"):
        check_preference_loss("dpo", 0.1, {"label_smoothing": 0.1})
    with pytest.raises(ValueError, match=r"label_smoothing must be in \(0, 0.5\)"):
        check_preference_loss("cdpo", 0.1, {"label_smoothing": 0.0})
    with pytest.raises(ValueError, match=r"in \[0, 0.5\)"):
        check_preference_loss("rdpo", 0.1, {"label_smoothing": 0.5})
    assert check_preference_loss("rdpo", 0.1, {"label_smoothing": None}).options


def test_a_copied_recipe_can_register_its_own_loss():
    def hinge(c, r, rc, rr, *, beta=0.1):
        h = (c - rc) - (r - rr)
        return torch.relu(1 - beta * h), beta * (c - rc), beta * (r - rr)

    PREFERENCE_LOSSES["hinge"] = PreferenceLoss(hinge)
    try:
        assert check_preference_loss("hinge", 0.1, {}).fn is hinge
    finally:
        del PREFERENCE_LOSSES["hinge"]
