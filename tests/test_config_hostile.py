"""Hostile config files and overrides are refused by name, fast (issue 44): no file under 64 KB
takes over 2 s to refuse, and none ends in a raw traceback from `validate` or `run`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightrft.config import ConfigError, load

ROOT = Path(__file__).resolve().parent.parent


def billion_laughs(levels: int = 9) -> str:
    """Nine levels of nine aliases: 9**9 values once expanded, 600-odd bytes of text."""
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels + 1):
        refs = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "aliases": (billion_laughs(), r"more than 100,000 values once its aliases"),
    "not_utf8": ("output_dir: out\nname: \xff\xfe\n", r"not UTF-8 text \(byte 0xff\)"),
    "deep_block": ("a: " + "[" * 5000 + "]" * 5000 + "\n", r"nested"),
    "deep_mapping": (
        "".join(f"{'  ' * i}k{i}:\n" for i in range(70)) + "  " * 70 + "v: 1\n",
        r"nested \d+ levels deep",
    ),
    "long_int": ("output_dir: out\nseed: " + "7" * 5000 + "\n", r":2: an integer of 5000 digits"),
    "recursive_alias": ("output_dir: out\na: &a [1, {b: *a}]\n", r":2: an alias \(\*name\) inside"),
    # A list as a key: the loader's own refusal (the line walk raised a TypeError on it).
    "list_key": ("output_dir: out\n? [a, b]\n: 1\n", r"(?s)invalid YAML: .*unhashable key"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_file_is_refused_by_name_within_two_seconds(tmp_path, case):
    text, message = HOSTILE[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(text.encode("latin-1") if case == "not_utf8" else text.encode())
    assert path.stat().st_size < 64 * 1024
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=message) as err:
        load(path)
    assert time.perf_counter() - t0 < 2.0
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "optimizer.betas=" + "[" * 5000 + "]" * 5000,
            r"override of optimizer.betas: the value is nested 5000 levels",
        ),
        ("seed=" + "9" * 5000, r"override of seed:1: an integer of 5000 digits"),
        ("a" + ".a" * 5000 + "=1", r"the key is nested deeper than 64 levels"),
    ],
)
def test_a_hostile_override_is_refused_by_name(tmp_path, override, message):
    path = tmp_path / "ok.yaml"
    path.write_text("output_dir: out\nseed: 1\noptimizer:\n  betas: [0.9, 0.99]\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        load(path, [override])
    assert time.perf_counter() - t0 < 2.0


def test_aliases_within_the_bound_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(billion_laughs(levels=2))  # 81 values: an ordinary use of anchors
    cfg, src = load(path)
    assert len(cfg.a2) == 9 and list(cfg.a2[0][0]) == ["lol"]
    assert src.lines["a2"] == 3


@pytest.mark.parametrize("command", ["validate", "run"])
def test_validate_and_run_exit_2_with_one_line_not_a_traceback(tmp_path, command):
    path = tmp_path / "laughs.yaml"
    path.write_text("# lightrft run sft --config laughs.yaml\n" + billion_laughs())
    argv = [sys.executable, "-m", "lightrft", command]
    argv += [str(path)] if command == "validate" else ["sft", "--config", str(path)]
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "aliases" in r.stderr and str(path) in r.stderr
    assert time.perf_counter() - t0 < 60  # interpreter start and imports included
