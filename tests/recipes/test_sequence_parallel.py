"""``sequence_parallel: 2`` through the recipes on 2 gloo processes: the SP group reads the
samples one process reads, and the run's logged losses and gradient norms equal the 1-process
run's (fp32; not bitwise: the sums run in another order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from _recording import read_record
from test_resume_world_size import _grpo_config, _grpo_rows, _on_ranks, _one_process, _sft_config

from lightrft.training import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("sp_assets")
    # Two query and two KV heads: SP=2 splits both.
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=2, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=96, n_test=8, digits=2)
    return root


def _rows(out: Path, prefix: str) -> dict[int, dict]:
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith(prefix)}
        for r in read_metrics(out)
        if any(k.startswith(prefix) for k in r)
    }


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_sft_sequence_parallel_equals_one_process(tmp_path, assets, monkeypatch, packing):
    a, t = assets, tmp_path
    over = dict(packing=packing, max_steps=3, save_every=100)
    # Padded: with activation checkpointing, whose recompute runs the all-to-alls again.
    model = {"path": str(a / "model"), "activation_checkpointing": not packing}
    over["model"] = model
    _one_process(_sft_config(t, a, t / "one", **over), str(t / "rec_one"), monkeypatch)
    sp = _sft_config(t, a, t / "sp", sequence_parallel=2, **over)
    run_distributed(_on_ranks, [(str(sp), str(t / "rec_sp"))])
    # The SP group reads what one process reads: the same samples on both ranks.
    one = read_record(str(t / "rec_one"), 0)
    assert read_record(str(t / "rec_sp"), 0) == read_record(str(t / "rec_sp"), 1) == one
    want, got = _rows(t / "one", "train/"), _rows(t / "sp", "train/")
    assert sorted(want) == sorted(got) == [1, 2, 3]
    for step in want:
        for key in ("train/loss", "train/grad_norm"):
            torch.testing.assert_close(got[step][key], want[step][key], rtol=1e-5, atol=1e-6)


def test_grpo_sequence_parallel_equals_one_process_and_two(tmp_path, assets, monkeypatch):
    """GRPO (KL to a frozen reference, packed micro-batches, 4 steps): the SP=2 run on 2
    processes logs the 1-process and the plain 2-process runs' losses, KL, grad norms and
    rewards. Generation is unchanged by SP (each rank still samples its share of prompts)."""
    a, t = assets, tmp_path
    over = dict(save_every=100)
    _one_process(_grpo_config(t, a, t / "one", **over), str(t / "rec_one"), monkeypatch, "grpo")
    plain = _grpo_config(t, a, t / "two", **over)
    sp = _grpo_config(t, a, t / "sp", sequence_parallel=2, **over)
    run_distributed(
        _on_ranks, [(str(plain), str(t / "rec_two")), (str(sp), str(t / "rec_sp"))], "grpo"
    )
    keys = (
        "train/loss",
        "train/policy_loss",
        "train/kl_loss",
        "train/grad_norm",
        "reward/total/mean",
    )
    got = _grpo_rows(t / "sp")
    for name in ("one", "two"):
        want = _grpo_rows(t / name)
        assert sorted(got) == sorted(want) == [1, 2, 3, 4]
        for step in want:
            for key in keys:
                torch.testing.assert_close(
                    got[step][key],
                    want[step][key],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"{name} {step} {key}",
                )
