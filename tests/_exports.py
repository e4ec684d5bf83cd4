"""Comparing two exports of a run: what `lightrft export` writes against a run's final/."""

from __future__ import annotations

from pathlib import Path

import torch


def assert_same_export(got: Path, want: Path) -> None:
    """``got`` and ``want`` hold the same files; safetensors tensors equal bit for bit (names,
    dtypes, values), every other file byte for byte."""
    from safetensors.torch import load_file

    names = sorted(p.relative_to(want).as_posix() for p in want.rglob("*") if p.is_file())
    assert names, f"{want} is empty"
    assert sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()) == names
    for name in names:
        if name.endswith(".safetensors"):
            a, b = load_file(got / name), load_file(want / name)
            assert sorted(a) == sorted(b), name
            for k in b:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{name}: {k}"
        else:
            assert (got / name).read_bytes() == (want / name).read_bytes(), name
