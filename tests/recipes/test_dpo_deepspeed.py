"""The DPO recipe on DeepSpeed ZeRO-2 (strategy=deepspeed), 2 gloo processes: the FSDP2 curve.

Skipped where DeepSpeed is not installed (an optional extra); opt-in with ``-m deepspeed``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _dist import run_distributed
from test_dpo import _config, _first_loss, _train

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'lightrft[deepspeed]')",
)


@pytest.mark.deepspeed
def test_dpo_zero2_follows_fsdp2(tmp_path):
    """The frozen reference stays an FSDP2 copy beside the DeepSpeed engine; the losses, margins
    and gradient norms of ZeRO-2 equal FSDP2's on 2 ranks."""
    curves = {}
    for name, over in (("fsdp2", {}), ("zero2", {"strategy": "deepspeed"})):
        cfg = _config(tmp_path / name, batch_size=4, eval_every=None, **over)
        run_distributed(_first_loss, str(cfg), str(tmp_path / name))
        rows = _train(tmp_path / name / "out")
        keys = ("train/loss", "train/rewards/margins", "train/grad_norm")
        curves[name] = torch.tensor([[r[k] for k in keys] for r in rows])
    assert curves["fsdp2"].shape == (4, 3)
    assert curves["fsdp2"][-1, 0] < curves["fsdp2"][0, 0]
    torch.testing.assert_close(curves["zero2"], curves["fsdp2"], rtol=1e-4, atol=1e-5)
