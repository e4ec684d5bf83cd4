"""The install story of issue 40: the README's commands install from the lock, CI runs them word
for word, and the lock pins everything pyproject asks for."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# .ci/lock points this at the candidate lock it is about to write, so the candidate is checked.
LOCK = Path(os.environ.get("LIGHTRFT_LOCK") or ROOT / ".ci" / "constraints.txt")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _readme_command(marker: str) -> str:
    r = subprocess.run(
        ["bash", "-c", f'. .ci/env.sh && readme_command "{marker}"'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return r.stdout.strip()


def test_ci_runs_the_readme_test_command_from_the_lock():
    cmd = _readme_command("The test suite:")
    assert cmd.startswith("pip install torch==2.13.0 && pip install -c .ci/constraints.txt -e ")
    assert f"    {cmd}\n" in (ROOT / "README.md").read_text()
    assert "python -m pytest -q" in cmd


def test_the_readme_demo_installs_from_the_lock():
    text = (ROOT / "README.md").read_text()
    assert (
        "    pip install torch==2.13.0 && pip install -c .ci/constraints.txt -e . && lightrft run sft"
        in text
    )


def test_the_lock_pins_every_dependency_of_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_name(name)] = version
    assert wanted - set(pins) == set(), "regenerate the lock: .ci/lock"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.]*", v) for v in pins.values()), pins
    assert pins["torch"] == "2.13.0"  # no +cpu label: the same lock serves CUDA machines
    assert "torchtune" not in pins and int(pins["torchao"].split(".")[1]) >= 16
