"""A source checkout on PYTHONPATH imports its own recipes / kernels / configs folders, not those of
whichever tree ``pip install -e`` mapped (a git worktree beside an editable install of main)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_checkout_on_pythonpath_maps_its_own_top_level_folders(tmp_path):
    copy = tmp_path / "checkout"
    for name in ("lightrft", "recipes", "configs"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    probe = (
        "import lightrft.kernels, lightrft.recipes, lightrft.configs\n"
        "from lightrft.cli import recipes_dir, configs_dir\n"
        "for p in (lightrft.kernels.__file__, *lightrft.recipes.__path__, *lightrft.configs.__path__,"
        " recipes_dir(), configs_dir()): print(p)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(out) == 5
    assert all(Path(p).resolve().is_relative_to(copy.resolve()) for p in out), out


def test_the_wheel_lists_every_subpackage():
    """setuptools' explicit ``packages`` list: a subpackage missing there is absent from a wheel
    (the editable install and source checkouts hide it; lightrft.environments once was)."""
    import pytest

    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        "lightrft." + ".".join(p.parent.relative_to(ROOT / "lightrft").parts)
        for p in (ROOT / "lightrft").rglob("__init__.py")
        if p.parent != ROOT / "lightrft" and "__pycache__" not in p.parts
    }
    assert found - listed == set()
