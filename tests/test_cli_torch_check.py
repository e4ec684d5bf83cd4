"""A torch outside the supported range, or a CUDA build on a machine without a GPU, is named in one
line at `lightrft` start-up with the command that fixes it (issue 40), not a deep traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightrft.cli import TORCH_RANGE, torch_problem


@pytest.mark.parametrize("version", ["2.14.1+cu128", "2.10.0", "3.0.0", "nightly"])
def test_a_torch_outside_the_range_is_fatal_and_names_the_fix(version):
    line, fatal = torch_problem(version, None, has_gpu=True)
    assert fatal and f"torch {version} is installed" in line
    assert line.endswith("pip install torch==2.13.0")


def test_a_cuda_build_without_a_gpu_is_a_notice_and_a_cpu_build_is_fine():
    line, fatal = torch_problem("2.13.0", "12.8", has_gpu=False)
    assert not fatal and "CUDA 12.8 build" in line and "whl/cpu" in line
    assert torch_problem("2.13.0", "12.8", has_gpu=True) is None
    assert torch_problem("2.13.0+cpu", None, has_gpu=False) is None
    lo, hi = TORCH_RANGE
    assert torch_problem(f"{lo[0]}.{lo[1]}.0", None, False) is None
    assert torch_problem(f"{hi[0]}.{hi[1] - 1}.5", None, False) is None


def _fake_torch(root, version: str, cuda: str | None) -> None:
    """A torch distribution that shadows the real one on PYTHONPATH: its metadata and version.py
    are what `lightrft` reads; importing it would raise, as a broken install might."""
    pkg = root / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('this fake torch must not be imported')\n")
    (pkg / "version.py").write_text(f"__version__ = {version!r}\ncuda: str | None = {cuda!r}\n")
    info = root / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def _lightrft(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    return subprocess.run(
        [sys.executable, "-m", "lightrft", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_lightrft_refuses_an_unsupported_torch_in_one_line(tmp_path):
    (tmp_path / "site").mkdir()
    _fake_torch(tmp_path / "site", "2.14.1+cu128", "12.8")
    r = _lightrft(tmp_path, "ls")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "lightrft: torch 2.14.1+cu128 is installed; LightRFT needs torch >=2.11,<2.14: "
        "pip install torch==2.13.0"
    ]


@pytest.mark.skipif(
    os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl"),
    reason="this machine has an NVIDIA GPU: a CUDA build is what it should have",
)
def test_a_cuda_build_on_a_cpu_machine_gets_one_note_and_runs(tmp_path):
    (tmp_path / "site").mkdir()
    _fake_torch(tmp_path / "site", "2.13.0", "12.8")
    r = _lightrft(tmp_path, "ls")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("lightrft: note:")]
    assert len(notes) == 1 and "CUDA 12.8 build" in notes[0]
    assert "grpo" in r.stdout
