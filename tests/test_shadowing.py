"""Nothing in the repository root shadows an installed package (issue 40).

Python puts the working directory first on ``sys.path`` (``python -m pytest``, ``python -c``, a
notebook), and a regular package there wins over site-packages. transformers >= 5.25 imports
Hugging Face's ``kernels`` distribution from ``transformers.modeling_utils``; a top-level
``kernels/__init__.py`` here once broke every Python started in the root. The root therefore holds
one importable package, ``lightrft``; ``kernels/``, ``recipes/`` and ``configs/`` are plain folders
(namespace portions at most, which never win over an installed package of the same name).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SUFFIXES = (".py", ".pyc", ".so", ".pyd")


def _in_root(code: str) -> subprocess.CompletedProcess:
    """Run ``python -c code`` the way a user in the repository root would."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def root_packages(root: Path = ROOT) -> set[str]:
    """Names a Python started in ``root`` imports from ``root`` before site-packages: regular
    packages (a folder with ``__init__.py``) and modules (``x.py``, extensions)."""
    names = set()
    for entry in root.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file():
            names.add(entry.name)
        elif entry.is_file() and entry.suffix in _SUFFIXES:
            names.add(entry.name.split(".")[0])
    return names


def test_the_root_holds_no_package_but_lightrft():
    assert root_packages() == {"lightrft"}, (
        "a regular package or module in the repository root shadows any installed distribution "
        "of the same name for a Python started there: map the folder into lightrft instead "
        "(pyproject package-dir, no __init__.py; see tests/test_shadowing.py)"
    )


def test_the_checker_sees_a_shadowing_package(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "recipes").mkdir()  # a namespace portion: never wins over an installed package
    (tmp_path / "setup.py").write_text("")
    assert root_packages(tmp_path) == {"kernels", "setup"}


def _from_root(name: str, path: str | None) -> bool:
    """Whether ``path`` (an import's origin or package folder) is the repository root's own
    ``name``: a folder, ``name.py`` or ``name/__init__.py`` in the root. A virtual environment
    inside the root (``.venv/``) or beside it (``<root>-venv/``) is not."""
    root = ROOT.resolve()
    return path is not None and Path(path).resolve() in {
        root / name,
        root / f"{name}.py",
        root / name / "__init__.py",
    }


def test_from_root_names_only_the_roots_own_module():
    assert _from_root("kernels", str(ROOT / "kernels" / "__init__.py"))
    assert _from_root("kernels", str(ROOT / "kernels"))  # a namespace package's folder
    for venv in (ROOT / ".venv", Path(f"{ROOT}-venv")):
        assert not _from_root("kernels", str(venv / "lib/site-packages/kernels/__init__.py"))
    assert not _from_root("kernels", None)


def test_no_root_name_collides_with_an_installed_distribution():
    """Every top-level module of an installed distribution that also names something in the root
    (a folder or a file) imports as the installed one, from a Python started in the root."""
    installed = importlib.metadata.packages_distributions()
    names = {e.name.split(".")[0] for e in ROOT.iterdir() if not e.name.startswith(".")}
    clashes = sorted(n for n in names & set(installed) if n != "lightrft")
    if not clashes:
        pytest.skip(f"no installed distribution has a top-level name among {sorted(names)}")
    probe = (  # find_spec: where the import would come from, without running the module
        "import importlib.util, json\n"
        f"for name in {clashes!r}:\n"
        "    s = importlib.util.find_spec(name)\n"
        "    print(json.dumps([name, s.origin, list(s.submodule_search_locations or [])]))\n"
    )
    r = _in_root(probe)
    assert r.returncode == 0, r.stderr[-2000:]
    for line in r.stdout.splitlines():
        name, origin, folders = json.loads(line)
        for where in (origin, *folders):
            assert not _from_root(name, where), f"{name} ({installed[name]}) imports from {where}"


def _installed(dist: str) -> bool:
    """Whether a distribution is installed (by its metadata: ``find_spec`` would find the
    repository's own ``kernels/`` folder on a path that holds the root)."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    not _installed("kernels"),
    reason="Hugging Face's `kernels` distribution is not installed (transformers < 5.25 does not "
    "require it)",
)
def test_transformers_imports_the_kernel_hub_from_the_repository_root():
    r = _in_root(
        "import kernels, transformers.modeling_utils, lightrft, peft\n"
        "import lightrft.kernels, lightrft.recipes, lightrft.configs\n"
        "print(kernels.__file__)\n"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not _from_root("kernels", r.stdout.strip()), r.stdout
    assert importlib.metadata.distribution("kernels").locate_file("") != ROOT
