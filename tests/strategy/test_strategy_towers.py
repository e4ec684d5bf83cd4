"""Strategy.load_policy refuses a tower flag the checkpoint cannot honour, whichever recipe loads
the policy: a path a ``prepare`` step (or an earlier run) writes has no config.json when the
config is validated, so only the check before loading can see it (dpo had no such check)."""

from __future__ import annotations

import pytest
import torch

from lightrft.distributed import DistInfo
from lightrft.sections import PolicyModelConfig, StrategyConfig
from lightrft.strategy import build_strategy


@pytest.mark.parametrize("kind", ["vision", "audio"])
def test_load_policy_refuses_a_tower_a_text_checkpoint_lacks(tiny_model_dir, kind):
    strategy = build_strategy(StrategyConfig.read({}), DistInfo(0, 1, 0, torch.device("cpu")))
    m = PolicyModelConfig.read({"path": str(tiny_model_dir), f"train_{kind}_tower": True})
    with pytest.raises(ValueError, match=f"model.train_{kind}_tower=true but .* is not a {kind}"):
        strategy.load_policy(m)
    plain = PolicyModelConfig.read({"path": str(tiny_model_dir)})
    assert sum(p.numel() for p in strategy.load_policy(plain).parameters()) > 0
