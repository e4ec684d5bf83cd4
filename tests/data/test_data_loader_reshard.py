"""A loader position saved on W ranks continues on M ranks: no item skipped or read twice, and
each new rank reads what it would have read in a run on M ranks from the start."""

from __future__ import annotations

from collections import Counter

import pytest

from lightrft.data.loader import build_dataloader, epoch_batches


def _loaders(n: int, batch: int, world: int, drop_last: bool = True):
    data = list(range(n))
    return [
        build_dataloader(
            data, batch_size=batch, seed=3, rank=r, world_size=world, drop_last=drop_last
        )
        for r in range(world)
    ]


def _take(loaders, steps: int, epoch: int = 0):
    """``steps`` batches from each rank's loader, epoch after epoch: (per-rank items, iterators)."""
    its = [epoch_batches(loader, epoch) for loader in loaders]
    seen = [[] for _ in loaders]
    for _ in range(steps):
        for r, it in enumerate(its):
            seen[r].append(next(it)[1].tolist())
    return seen


@pytest.mark.parametrize(
    ("n", "old", "new", "k"),
    [
        (40, (2, 4), (1, 8), 3),
        (40, (1, 8), (2, 4), 2),
        (40, (2, 4), (4, 2), 4),
        (45, (2, 2), (4, 1), 6),
    ],
    ids=["2to1", "1to2", "2to4", "2to4_mid_epoch_ragged"],
)
def test_the_rest_of_the_run_is_the_uninterrupted_runs(n, old, new, k):
    (w, b), (m, b2) = old, new
    steps = 2 * (n // (w * b))  # two epochs
    saved_loaders = _loaders(n, b, w)
    before = _take(saved_loaders, k)
    states = [loader.state_dict() for loader in saved_loaders]

    resumed = _loaders(n, b2, m)
    for loader in resumed:
        loader.load_resharded(states)
    epoch = states[0]["lightrft_epoch"]
    after = _take(resumed, steps - k, epoch)

    reference = _take(_loaders(n, b2, m), steps)  # the run on M ranks from the start
    assert [rank[k:] for rank in reference] == after  # rank by rank, batch by batch
    # Over the whole run, every item as often as in the uninterrupted run on W ranks.
    whole = Counter(x for rank in before + after for batch in rank for x in batch)
    uninterrupted = _take(_loaders(n, b, w), steps)
    assert whole == Counter(x for rank in uninterrupted for batch in rank for x in batch)


def test_a_changed_global_batch_or_an_old_state_is_refused():
    saved = _loaders(40, 4, 2)
    _take(saved, 1)
    states = [loader.state_dict() for loader in saved]
    with pytest.raises(
        ValueError, match="prompts: the checkpoint read 8 items per batch over its 2"
    ):
        _loaders(40, 4, 1)[0].load_resharded(states, "prompts")  # 4 per step instead of 8
    old = [{k: v for k, v in s.items() if k != "lightrft_batch_size"} for s in states]
    with pytest.raises(ValueError, match="lacks its batch size and world size"):
        _loaders(40, 8, 1)[0].load_resharded(old)
