"""``offload: params`` through a whole recipe on 2 gloo processes: GRPO with the offloaded actor
gives the run without offload's rollouts, losses and gradient norms exactly (on a CPU the
offload is to the same memory), including the weight sync into the engine after every step; a
checkpoint saved without offload resumes with it (the layout is the same)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist import run_distributed
from test_resume_world_size import _from_checkpoint, _grpo_config, _grpo_rows, _on_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("offload_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=96, n_test=8, digits=2)
    return root


def test_grpo_with_offload_equals_without_and_resumes_with_it(tmp_path, assets):
    a, t = assets, tmp_path
    plain = _grpo_config(t, a, t / "plain")
    runs = [(str(plain), str(t / "rec_plain"))]
    runs.append((str(_grpo_config(t, a, t / "offload", offload="params")), str(t / "rec_off")))
    run_distributed(_on_ranks, runs, "grpo")
    _from_checkpoint(t / "plain", t / "resumed", 2)
    resumed_cfg = _grpo_config(t, a, t / "resumed", offload="params", resume=True)
    run_distributed(_on_ranks, [(str(resumed_cfg), str(t / "rec_resumed"))], "grpo")

    want, got = _grpo_rows(t / "plain"), _grpo_rows(t / "offload")
    keys = [k for k in want[1] if k.split("/")[0] in ("train", "reward", "rollout")]
    assert len(keys) > 15 and sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        for key in keys:
            assert got[step][key] == want[step][key], (step, key)
    resumed = _grpo_rows(t / "resumed")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in keys:
            assert resumed[step][key] == want[step][key], (step, key)
