"""RolloutBatch (select, cat, all_gather over 2 gloo processes) and MetricAccumulator
(declared reductions, the empty-rank rule), with hand-derived values."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _dist import run_distributed

from lightrft.rollout import RolloutBatch, pad_rows
from lightrft.training import MetricAccumulator


def make_batch(responses: list[list[int]], tag: str = "a") -> RolloutBatch:
    n = len(responses)
    lens = torch.tensor([len(r) for r in responses])
    ids = pad_rows(responses, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=pad_rows([[1] * (i + 1) for i in range(n)], dtype=torch.long),
        prompt_lens=torch.arange(1, n + 1),
        response_ids=ids,
        response_lens=lens,
        response_mask=torch.arange(ids.shape[1]) < lens.unsqueeze(1),
        rollout_logprobs=pad_rows([[-0.5 * (j + 1) for j in range(len(r))] for r in responses]),
        reward_raw=torch.arange(n, dtype=torch.float64) + 0.1,
        rewards=torch.arange(n, dtype=torch.float64) + 0.1,
        reward_parts={"acc": torch.arange(n, dtype=torch.float64)},
        reward_applied={"acc": torch.tensor([i % 2 == 0 for i in range(n)])},
        prompts=[f"{tag}{i}" for i in range(n)],
        references=[str(i) for i in range(n)],
        labels=[None] * n,
        wheres=[f"f:{i}" for i in range(n)],
        texts=["x" * len(r) for r in responses],
        finish_reasons=["stop"] * n,
        groups=[(tag, i // 2) for i in range(n)],
    )


def test_select_trims_and_cat_pads():
    b = make_batch([[5, 6, 7], [8], [9, 10]])
    s = b.select([2, 1])
    assert s.response_ids.tolist() == [[9, 10], [8, 0]]  # trimmed to the longest selected
    assert s.prompt_ids.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert s.prompts == ["a2", "a1"] and s.reward_parts["acc"].tolist() == [2.0, 1.0]
    assert s.response(1) == [8] and s.prompt(0) == [1, 1, 1]
    c = RolloutBatch.cat([s, make_batch([[4, 4, 4, 4]], tag="b")])
    assert c.response_ids.shape == (3, 4) and c.prompts == ["a2", "a1", "b0"]
    assert c.response_mask.sum(dim=1).tolist() == [2, 1, 4]
    assert len(b.select([])) == 0


def _gather(rank: int, world_size: int) -> None:
    # Rank 0: 2 samples up to 3 tokens; rank 1: 1 sample of 5 tokens.
    mine = make_batch([[1, 2, 3], [4]], "r0") if rank == 0 else make_batch([[5] * 5], "r1")
    mine = dataclasses.replace(
        mine, rollout_logprobs=torch.full(mine.response_ids.shape, float(rank))
    )
    full = mine.all_gather()
    assert full.prompts == ["r00", "r01", "r10"]
    assert full.response_ids.tolist() == [[1, 2, 3, 0, 0], [4, 0, 0, 0, 0], [5] * 5]
    assert full.response_lens.tolist() == [3, 1, 5]
    assert full.reward_applied["acc"].dtype == torch.bool
    assert full.reward_applied["acc"].tolist() == [True, False, True]
    assert full.rewards.dtype == torch.float64 and full.rewards.tolist() == [0.1, 1.1, 0.1]
    assert full.rollout_logprobs[:, 0].tolist() == [0.0, 0.0, 1.0]
    assert full.groups == [("r0", 0), ("r0", 0), ("r1", 0)]


def test_all_gather_over_two_processes():
    run_distributed(_gather, world_size=2)


def _media(*patches: int):
    """One Media per entry (None for 0): images whose flat [patches, 6] values name them."""
    from lightrft.data import ImageInputs, Media

    return [
        None
        if p == 0
        else Media(
            image=ImageInputs(
                images=[f"img{p}"],
                pixel_values=torch.full((p, 6), float(p)),
                image_grid_thw=torch.tensor([[1, p, 1]]),
                num_tokens=[p],
                processor_kwargs={},
            )
        )
        for p in patches
    ]


def test_media_select_and_cat_per_sample():
    from lightrft.data import Media

    b = make_batch([[5, 6, 7], [8], [9, 10]])
    b.media = _media(2, 0, 3)
    s = b.select([2, 0])
    assert [x.image.num_tokens for x in s.media] == [[3], [2]]  # whole samples, not patch rows
    joined = Media.cat(s.media).image
    assert joined.pixel_values[:, 0].tolist() == [3.0] * 3 + [2.0] * 2
    assert joined.image_grid_thw.tolist() == [[1, 3, 1], [1, 2, 1]]
    assert Media.cat(b.select([1]).media) is None  # a text-only row
    c = RolloutBatch.cat([s, make_batch([[4]], tag="b")])  # a text batch joins: None entries
    assert [x is None for x in c.media] == [False, False, True]
    assert RolloutBatch.cat([make_batch([[1]]), make_batch([[2]])]).media is None


def _gather_media(rank: int, world_size: int) -> None:
    # Rank 0: 2 samples with 2 and 1 patches; rank 1: one text sample (media None).
    mine = make_batch([[1, 2, 3], [4]], "r0") if rank == 0 else make_batch([[5] * 5], "r1")
    if rank == 0:
        mine.media = _media(2, 1)
    full = mine.all_gather()
    assert full.prompts == ["r00", "r01", "r10"]
    assert full.media[2] is None
    images = [m.image for m in full.media[:2]]
    assert [x.pixel_values.shape for x in images] == [(2, 6), (1, 6)]
    assert images[0].pixel_values.sum().item() == 24.0 and images[1].images == ["img1"]
    assert full.select([1, 0]).media[0].image.num_tokens == [1]
    assert make_batch([[1]], "t").all_gather().media is None  # text everywhere: stays None


def test_all_gather_media_over_two_processes():
    run_distributed(_gather_media, world_size=2)


def test_metric_accumulator_reductions():
    acc = MetricAccumulator({"lo": "min", "hi": "max", "n": "sum"}, empty={"lo": 1.0})
    acc.add("m", 2.0, weight=1.0)
    acc.add("m", torch.tensor(5.0), weight=3.0)
    acc.add("lo", 0.5, weight=2.0)
    acc.add("lo", 0.1, weight=0.0)  # a padding micro-batch: not a value
    acc.add("hi", 7.0, weight=1.0)
    acc.add("n", 3)
    acc.add("n", 4)
    assert acc.reduce() == {"m": (2.0 + 15.0) / 4.0, "lo": 0.5, "hi": 7.0, "n": 7.0}
    # Nothing with a positive weight: the declared empty value (default 0).
    acc.add("m", 9.0, weight=0.0)
    acc.add("lo", 9.0, weight=0.0)
    assert acc.reduce() == {"m": 0.0, "lo": 1.0}
    with pytest.raises(ValueError, match="reduction of x"):
        MetricAccumulator({"x": "median"})


def _empty_rank(rank: int, world_size: int) -> None:
    acc = MetricAccumulator({"ratio_min": "min"}, empty={"ratio_min": 1.0})
    w = 2.0 if rank == 0 else 0.0  # rank 1 ran only a padding micro-batch
    acc.add("loss", 3.0 if rank == 0 else 100.0, weight=w)
    acc.add("ratio_min", 0.8 if rank == 0 else -5.0, weight=w)
    out = acc.reduce()
    assert out == {"loss": 3.0, "ratio_min": 0.8}
    assert all(math.isfinite(v) for v in out.values())


def test_metric_accumulator_with_an_empty_rank():
    run_distributed(_empty_rank, world_size=2)


def _gather_episodes(rank: int, world_size: int) -> None:
    from lightrft.environments import Episode, EpisodeStats, ErrorKind

    # Rank 0: two multi-turn samples with their episodes; rank 1: one without (None).
    mine = make_batch([[1, 2, 3], [4]], "r0") if rank == 0 else make_batch([[5] * 5], "r1")
    if rank == 0:
        stats = EpisodeStats(turns=2, tool_calls=1, errors={ErrorKind.tool_timeout: 1})
        mine.episodes = [Episode([{"role": "user", "content": "q0"}], stats=stats), None]
    full = mine.all_gather()
    assert full.episodes[0].stats.errors == {ErrorKind.tool_timeout: 1}
    assert full.episodes[0].messages[0]["content"] == "q0"
    assert full.episodes[1:] == [None, None]
    assert full.select([2, 0]).episodes[1].stats.turns == 2
    assert make_batch([[1]], "t").all_gather().episodes is None  # single-turn everywhere


def test_all_gather_episodes_over_two_processes():
    run_distributed(_gather_episodes, world_size=2)
