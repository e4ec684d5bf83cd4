"""A save that fails (disk full) names the directory and the cause and leaves no partial dir."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from lightrft.training.checkpoint import Checkpointer, CheckpointSaveError


def _small(width=4):
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["dcp_writer", "rank_state"])
def test_injected_enospc_is_named_and_the_partial_dir_removed(tmp_path, monkeypatch, where):
    model, opt = _small()
    ckpt = Checkpointer(tmp_path)
    good = ckpt.save(1, models=model, optimizers=opt)
    if where == "dcp_writer":
        import torch.distributed.checkpoint.filesystem as fs

        monkeypatch.setattr(fs, "_write_item", _enospc)
    else:
        import lightrft.training.checkpoint as mod

        monkeypatch.setattr(mod, "save_state", _enospc)
    with pytest.raises(CheckpointSaveError) as info:
        ckpt.save(2, models=model, optimizers=opt)
    msg = str(info.value)
    assert f"into {tmp_path / 'checkpoints' / 'step_000002.tmp'} failed" in msg
    assert "No space left on device (errno ENOSPC)" in msg
    assert f"the last good checkpoint {good} is intact" in msg
    assert not (tmp_path / "checkpoints" / "step_000002.tmp").exists()
    monkeypatch.undo()
    assert ckpt.load_latest(models=model, optimizers=opt).step == 1


def test_real_full_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", f"lr-{uuid.uuid4().hex[:6]}", str(mnt)],
        capture_output=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        small, sopt = _small(4)
        ckpt = Checkpointer(mnt)
        good = ckpt.save(1, models=small, optimizers=sopt)
        big, bopt = _small(256)  # 256*257 floats * 3 (params + 2 Adam moments) ~ 790 kB
        with pytest.raises(CheckpointSaveError) as info:
            ckpt.save(2, models=big, optimizers=bopt)
        msg = str(info.value)
        assert "step_000002.tmp failed" in msg and "No space left on device" in msg, msg
        assert not (mnt / "checkpoints" / "step_000002.tmp").exists()
        assert shutil.disk_usage(mnt).free > 0
        assert ckpt.latest() == good
        assert ckpt.load_latest(models=small, optimizers=sopt).step == 1
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        assert not os.path.ismount(mnt)


def test_a_failure_without_a_message_is_still_described(tmp_path, monkeypatch):
    """A bare ``assert`` (or ``MemoryError()``) inside the writer has an empty message: the save
    error still names its type instead of failing on it with an IndexError."""
    import lightrft.training.checkpoint as mod

    def bare(*args, **kwargs):
        raise AssertionError

    model, opt = _small()
    monkeypatch.setattr(mod, "save_state", bare)
    with pytest.raises(CheckpointSaveError, match=r"step_000001.tmp failed: AssertionError"):
        Checkpointer(tmp_path).save(1, models=model, optimizers=opt)
    assert not (tmp_path / "checkpoints" / "step_000001.tmp").exists()
