"""Mismatch metrics, IcePop masking and geometric-mean rejection on hand-derivable numbers."""

import math

import pytest
import torch

from lightrft.algorithms.mismatch import geometric_rejection, icepop_mask, mismatch_metrics

LN2, LN3 = math.log(2), math.log(3)


def _case():
    """Token ratios exp(trainer - engine): [1, 1/2, 2] and [1/2, 3, (padding)]."""
    ln = math.log
    trainer = torch.tensor(
        [[ln(0.5), ln(0.25), ln(0.8)], [ln(0.1), ln(0.9), 0.0]], dtype=torch.float64
    )
    engine = torch.tensor(
        [[ln(0.5), ln(0.5), ln(0.4)], [ln(0.2), ln(0.3), -7.0]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return trainer, engine, mask


def test_mismatch_metrics_equal_their_formulas():
    m = mismatch_metrics(*_case(), threshold=0.7)
    assert m["rollout/mismatch/mean_abs_delta"] == pytest.approx((3 * LN2 + LN3) / 5, abs=1e-6)
    # KL(engine || trainer) per sequence: -sum d = 0 and ln2 - ln3; their mean
    assert m["rollout/mismatch/seq_kl"] == pytest.approx((LN2 - LN3) / 2, abs=1e-6)
    assert m["rollout/mismatch/max_abs_delta"] == pytest.approx(LN3, abs=1e-6)
    assert m["rollout/mismatch/frac_beyond_threshold"] == pytest.approx(1 / 5, abs=1e-6)


def test_mismatch_is_zero_for_equal_logprobs_and_empty_masks():
    t, _, mask = _case()
    assert all(v == 0 for v in mismatch_metrics(t, t, mask).values())
    assert all(v == 0 for v in mismatch_metrics(t, t, torch.zeros_like(mask)).values())
    with pytest.raises(ValueError, match="one shape"):
        mismatch_metrics(t, t[:, :2], mask)
    with pytest.raises(ValueError, match="threshold"):
        mismatch_metrics(t, t, mask, threshold=0)


def test_icepop_masks_tokens_whose_ratio_leaves_the_band():
    keep = icepop_mask(*_case(), low=0.6, high=2.5)  # ratios 1/2 and 3 leave [0.6, 2.5]
    assert keep.tolist() == [[1, 0, 1], [0, 0, 0]]
    keep = icepop_mask(*_case(), low=0.4, high=3.5)  # everything sampled stays; padding 0
    assert keep.tolist() == [[1, 1, 1], [1, 1, 0]]
    with pytest.raises(ValueError, match="low < 1 < high is needed"):
        icepop_mask(*_case(), low=1.2, high=2.0)


def test_geometric_rejection_uses_the_geometric_mean_and_the_veto():
    # geometric means: exp((0 - ln2 + ln2) / 3) = 1 and exp((ln3 - ln2) / 2) = sqrt(1.5) = 1.2247
    tm, kept = geometric_rejection(*_case(), low=0.999, high=1.001, veto=0)
    assert kept.tolist() == [True, False] and tm.tolist() == [[1, 1, 1], [0, 0, 0]]
    tm, kept = geometric_rejection(*_case(), low=0.9, high=math.sqrt(1.5) + 1e-6, veto=0)
    assert kept.tolist() == [True, True] and tm.tolist() == [[1, 1, 1], [1, 1, 0]]
    tm, kept = geometric_rejection(*_case(), low=0.9, high=math.sqrt(1.5) - 1e-6, veto=0)
    assert kept.tolist() == [True, False]
    # veto 0.55: both rows hold a token of ratio 1/2, so both go although their means pass;
    # veto 0.45 is below every ratio
    _, kept = geometric_rejection(*_case(), low=0.9, high=1.3, veto=0.55)
    assert kept.tolist() == [False, False]
    _, kept = geometric_rejection(*_case(), low=0.9, high=1.3, veto=0.45)
    assert kept.tolist() == [True, True]
    t, e, mask = _case()
    _, kept = geometric_rejection(t, e, torch.zeros_like(mask))
    assert kept.tolist() == [True, True]  # nothing sampled: nothing to reject
    with pytest.raises(ValueError, match="veto"):
        geometric_rejection(t, e, mask, veto=1.5)


def test_the_algorithm_section_combines_both_and_logs_their_fractions():
    from omegaconf import OmegaConf

    from lightrft.algorithms.config import MismatchConfig

    node = OmegaConf.create({"icepop": {"low": 0.6, "high": 2.5}, "geometric": {"veto": 0}})
    cfg = MismatchConfig.read(node, "algorithm.mismatch.")
    keep, m = cfg.apply(*_case())
    # icepop keeps [[1, 0, 1], [0, 0, 0]]; geometric (0.999..1.001) keeps row 0 only
    assert keep.tolist() == [[True, False, True], [False, False, False]]
    assert m["rollout/mismatch/icepop_masked_frac"] == pytest.approx(3 / 5, abs=1e-6)
    assert m["rollout/mismatch/geometric_rejected_frac"] == pytest.approx(1 / 2, abs=1e-6)
    assert m["rollout/mismatch/max_abs_delta"] == pytest.approx(LN3, abs=1e-6)
    assert MismatchConfig.read(None, "algorithm.mismatch.").apply(*_case())[0] is None
