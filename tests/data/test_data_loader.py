"""build_dataloader: rank shards, per-epoch shuffles, and exact resume (epoch boundary too)."""

import pytest
import torch

from lightrft.data import SFTDataset, build_dataloader, pack_or_pad_collator

EPOCHS = 3


def _as_list(batch):
    if isinstance(batch, dict):
        return {k: v.tolist() for k, v in batch.items()}
    return batch.tolist()


def run(loader, start_epoch, epochs=EPOCHS, stop_after=None):
    """Batches of epochs [start_epoch, epochs), optionally stopping early; (batches, epoch)."""
    seen = []
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append(_as_list(batch))
            if stop_after is not None and len(seen) == stop_after:
                return seen, epoch
    return seen, epochs


def resumed(make, stop_after):
    """Batches of an uninterrupted run, and of a run stopped after ``stop_after`` then resumed."""
    want, _ = run(make(), 0)
    first_loader = make()
    first, epoch = run(first_loader, 0, stop_after=stop_after)
    state = first_loader.state_dict()
    loader = make()
    loader.load_state_dict(state)
    rest, _ = run(loader, epoch)
    return want, first + rest


def test_ranks_get_disjoint_shards_covering_the_data():
    data = list(range(10))
    shards = [
        [i for b in build_dataloader(data, batch_size=2, seed=1, rank=r, world_size=2) for i in b]
        for r in range(2)
    ]
    assert len(shards[0]) == len(shards[1]) == 5
    assert sorted(shards[0] + shards[1]) == data


def test_uneven_data_drop_last_vs_padding():
    data = list(range(11))
    dl = build_dataloader(data, batch_size=2, seed=0, rank=1, world_size=2, drop_last=True)
    assert len(dl) == 2 and sum(len(b) for b in dl) == 4  # 5 per rank, last odd item dropped
    dl = build_dataloader(data, batch_size=2, seed=0, rank=1, world_size=2)
    assert len(dl) == 3 and sum(len(b) for b in dl) == 6  # padded to 6 per rank by repeats


def test_epochs_shuffle_differently_and_reproducibly():
    data = list(range(16))
    a, _ = run(build_dataloader(data, batch_size=4, seed=5), 0)
    b, _ = run(build_dataloader(data, batch_size=4, seed=5), 0)
    assert a == b
    epochs = [sum(a[i * 4 : (i + 1) * 4], []) for i in range(EPOCHS)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1]) == data
    ordered, _ = run(build_dataloader(data, batch_size=4, shuffle=False), 0)
    assert sum(ordered[:4], []) == data


@pytest.mark.parametrize("stop_after", [1, 3, 4, 6], ids=["first", "epoch_end", "next", "end2"])
@pytest.mark.parametrize("rank", [0, 1])
def test_resume_equals_uninterrupted(stop_after, rank):
    # 14 items over 2 ranks, batch 2, drop_last: 3 batches per rank per epoch.
    def make():
        return build_dataloader(
            list(range(14)), batch_size=2, seed=11, rank=rank, world_size=2, drop_last=True
        )

    assert len(make()) == 3
    want, got = resumed(make, stop_after)
    assert got == want and len(want) == 3 * EPOCHS


def test_state_holds_epoch_so_mid_epoch_resume_needs_no_set_epoch():
    def make():
        return build_dataloader(list(range(12)), batch_size=3, seed=2)

    want, _ = run(make(), 0)
    first = make()
    run(first, 0, stop_after=5)  # epoch 1, batch 2 of 4
    loader = make()
    loader.load_state_dict(first.state_dict())
    assert loader.epoch == 1
    assert [b.tolist() for b in loader] == want[5:8]


def test_resume_with_sft_dataset_and_both_collators(tok):
    recs = [{"prompt": f"{i}*{i}=", "completion": str(i * i)} for i in range(10)]
    ds = SFTDataset(tok, records=recs)
    for packing in (False, True):

        def make(packing=packing):
            return build_dataloader(
                ds,
                batch_size=3,
                seed=0,
                drop_last=True,
                collate_fn=pack_or_pad_collator(tok, packing=packing),
            )

        want, got = resumed(make, stop_after=4)
        assert got == want and len(want) == 3 * EPOCHS
        assert set(want[0]) >= {"input_ids", "labels", "position_ids", "num_loss_tokens"}


def test_resume_with_worker_processes():
    def make():
        return build_dataloader(list(range(12)), batch_size=2, seed=3, num_workers=2)

    want, got = resumed(make, stop_after=7)  # mid epoch 1
    assert got == want
    want, got = resumed(make, stop_after=6)  # end of epoch 0
    assert got == want


def test_bad_arguments():
    data = list(range(4))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        build_dataloader(data, batch_size=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\)"):
        build_dataloader(data, batch_size=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="2 per rank over world_size=2, fewer than batch_size=3"):
        build_dataloader(data, batch_size=3, world_size=2, drop_last=True)
    with pytest.raises(ValueError, match="the dataset is empty"):
        build_dataloader([], batch_size=1)


def test_default_collate_without_collate_fn():
    batch = next(iter(build_dataloader([torch.tensor([i, i]) for i in range(4)], batch_size=2)))
    assert batch.shape == (2, 2)
