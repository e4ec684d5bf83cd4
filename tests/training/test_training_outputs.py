"""check_output_dir: fail fast, naming the path, when the run cannot write its outputs."""

from __future__ import annotations

import os

import pytest

from lightrft.training.outputs import check_output_dir


def test_creates_missing_directory(tmp_path):
    out = check_output_dir(tmp_path / "a" / "b")
    assert out.is_dir() and list(out.iterdir()) == []  # the probe file is gone


def test_rejects_a_file_and_paths_below_it(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"output_dir '.*file.txt' exists and is not a directory"):
        check_output_dir(f)
    with pytest.raises(ValueError, match=r"output_dir '.*file.txt/run' cannot be created"):
        check_output_dir(f / "run")


def test_rejects_unset():
    for bad in (None, "", "  "):
        with pytest.raises(ValueError, match="output_dir is not set"):
            check_output_dir(bad)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_rejects_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=r"output_dir '.*ro' is not writable"):
            check_output_dir(ro)
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_rejects_unwritable_existing_directory():
    # /proc/self exists and is a directory that nobody, root included, can create files in.
    with pytest.raises(ValueError, match=r"output_dir '/proc/self' is not writable"):
        check_output_dir("/proc/self")
