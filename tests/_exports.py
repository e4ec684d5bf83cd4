"""Comparing two exports of a run (what `lightrft export` writes against a run's final/), and
marking a model directory as a reward-model export."""

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


def likelihood_reward_model(src, dst):
    """A copy of the vision- or audio-language model directory ``src`` at ``dst`` marked as a
    ``likelihood`` reward model (the ``lightrft_reward`` block an export of
    recipes/reward_model.py writes): the untrained model scores a response by its own mean log-probability. Returns ``dst`` as a string."""
    import json
    import shutil

    from lightrft.models.reward import CONFIG_KEY, build_reward_net

    shutil.copytree(src, dst)
    block = build_reward_net(dst, pooling="likelihood").reward_config()
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, CONFIG_KEY: block}, indent=2))
    return str(dst)
