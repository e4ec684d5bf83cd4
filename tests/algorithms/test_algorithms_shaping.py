"""Running reward normalisation, DAPO overlong penalty and dynamic sampling."""

import logging
import math

import pytest
import torch

from lightrft.algorithms import (
    DynamicSamplingAccumulator,
    RunningRewardNormalizer,
    clip_rewards,
    filter_groups,
    overlong_penalty,
    policy_loss,
)

# --------------------------------------------------------------------------- normalisation


def test_running_normalizer_hand_numbers():
    norm = RunningRewardNormalizer()
    torch.testing.assert_close(norm.normalize(torch.tensor([3.0])), torch.tensor([3.0]))  # identity
    norm(torch.tensor([1.0, 2.0, 3.0]))
    assert norm.count == 3 and norm.mean == pytest.approx(2.0) and norm.var == pytest.approx(2 / 3)
    out = norm(torch.tensor([4.0, 5.0]))
    # all five seen: mean 3, population variance 2
    assert norm.mean == pytest.approx(3.0) and norm.var == pytest.approx(2.0)
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0]) / (math.sqrt(2.0) + 1e-8))


def test_running_normalizer_matches_whole_data_statistics():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g) * 3 + 1 for n in (5, 1, 17, 8)]
    norm = RunningRewardNormalizer()
    for b in batches:
        norm.update(b)
    every = torch.cat(batches).double()
    assert norm.mean == pytest.approx(every.mean().item(), rel=1e-12)
    assert norm.var == pytest.approx(every.var(unbiased=False).item(), rel=1e-12)


def test_running_normalizer_clip_center_state():
    norm = RunningRewardNormalizer(clip=1.0, center=False)
    out = norm(torch.tensor([0.0, 10.0]))  # std 5: 0 -> 0, 10 -> 2 -> clipped to 1
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0]))
    copy = RunningRewardNormalizer(clip=1.0, center=False)
    copy.load_state_dict(norm.state_dict())
    x = torch.tensor([3.0, -4.0])
    torch.testing.assert_close(copy(x), norm(x))
    before = norm.state_dict()
    norm(x, update=False)
    assert norm.state_dict() == before
    with pytest.raises(ValueError, match="NaN or inf"):
        norm.update(torch.tensor([math.nan]))
    with pytest.raises(ValueError, match="clip"):
        RunningRewardNormalizer(clip=0.0)


def test_clip_rewards():
    torch.testing.assert_close(
        clip_rewards(torch.tensor([-3.0, 0.5, 9.0]), 2.0), torch.tensor([-2.0, 0.5, 2.0])
    )
    with pytest.raises(ValueError):
        clip_rewards(torch.zeros(1), -1.0)


# --------------------------------------------------------------------------- overlong


def test_overlong_penalty_hand_numbers():
    lengths = [10, 16, 17, 18, 20, 25]
    out = overlong_penalty(lengths, max_len=20, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    out = overlong_penalty(torch.tensor(lengths), max_len=20, buffer=4, factor=0.5)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    for kwargs in (
        {"max_len": 20, "buffer": 0},
        {"max_len": 20, "buffer": 21},
        {"max_len": 0, "buffer": 1},
    ):
        with pytest.raises(ValueError):
            overlong_penalty(lengths, **kwargs)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(lengths, 20, 4, factor=-1.0)


# --------------------------------------------------------------------------- dynamic sampling


def test_filter_groups():
    metric = torch.tensor([1, 1, 0, 1, 2, 2, 2, 2, 0.5, 0.5, 0.5, 0.5, 0, 1, 0, 0])
    assert filter_groups(metric, 4).tolist() == [True, False, False, True]
    assert filter_groups(torch.tensor([1, 1, 0, 1]), 2).tolist() == [False, True]  # ints work
    with pytest.raises(ValueError, match="group_size"):
        filter_groups(metric, 1)
    with pytest.raises(ValueError, match="multiple"):
        filter_groups(metric, 5)
    with pytest.raises(ValueError, match="NaN"):
        filter_groups(torch.tensor([math.nan, 1.0]), 2)


def test_accumulator_fills_and_trims_surplus():
    acc = DynamicSamplingAccumulator(target_groups=3, group_size=2, max_draws=5)
    assert acc.add(["a0", "a1", "b0", "b1"], torch.tensor([1.0, 0.0, 1.0, 1.0])) == 1
    assert not acc.done
    assert acc.add(["c0", "c1", "d0", "d1", "e0", "e1"], torch.tensor([0, 1, 1, 0, 0.2, 0.3])) == 3
    assert acc.full and acc.done and acc.num_groups == 4
    batch, stats = acc.take()
    assert batch == ["a0", "a1", "c0", "c1", "d0", "d1"]  # surplus group e is dropped
    assert stats == {
        "dynamic_sampling/draws": 2.0,
        "dynamic_sampling/groups_seen": 5.0,
        "dynamic_sampling/groups_kept": 4.0,
        "dynamic_sampling/groups_used": 3.0,
        "dynamic_sampling/kept_frac": 0.8,
        "dynamic_sampling/short": 0.0,
    }
    assert acc.num_groups == 0 and acc.draws == 0 and not acc.done  # reset after take


def test_accumulator_limit_trains_on_what_there_is(caplog):
    acc = DynamicSamplingAccumulator(target_groups=4, group_size=2, max_draws=2)
    draws = 0
    while not acc.done:
        acc.add(
            ["x", "y", "p", "q"],
            torch.tensor([1.0, 1.0, 0.0, 1.0]) if draws == 0 else torch.ones(4),
        )
        draws += 1
    assert draws == 2
    with caplog.at_level(logging.WARNING, logger="lightrft.algorithms.shaping"):
        batch, stats = acc.take()
    assert batch == ["p", "q"]
    assert stats["dynamic_sampling/short"] == 1.0 and stats["dynamic_sampling/groups_used"] == 1.0
    assert "1 of 4 groups after 2 draws" in caplog.text


def test_accumulator_empty_batch_trains_without_nan():
    acc = DynamicSamplingAccumulator(target_groups=2, group_size=2, max_draws=1)
    acc.add([1, 2, 3, 4], torch.zeros(4))
    assert acc.done
    batch, stats = acc.take()
    assert batch == [] and stats["dynamic_sampling/kept_frac"] == 0.0
    # an empty train batch through the loss: 0, not NaN
    logp = torch.zeros(len(batch), 5, requires_grad=True)
    loss, metrics = policy_loss(logp, None, torch.zeros(0), torch.zeros(0, 5))
    loss.backward()
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in metrics.values())


def test_accumulator_unlimited_and_errors():
    acc = DynamicSamplingAccumulator(target_groups=1, group_size=2, max_draws=0)
    for _ in range(50):
        acc.add([0, 0], torch.ones(2))
    assert not acc.done and acc.max_draws is None
    with pytest.raises(ValueError, match="metric values"):
        acc.add([0, 0, 0], torch.ones(2))
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSamplingAccumulator(0, 2)
    with pytest.raises(ValueError, match="group_size"):
        DynamicSamplingAccumulator(1, 1)
