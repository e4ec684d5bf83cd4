"""The layers of docs/architecture.md, enforced: every import of lightrft/ and recipes/
(at any depth, inside functions too; relative imports resolved) goes to a lower room that the
table allows, no two rooms or files import each other in a cycle, and no module imports another
module's private (``_x``) name.

``recipes`` ships as ``lightrft.recipes`` (pyproject ``package-dir``), so its modules are named
that way here.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# room: (layer, rooms it may import). A room may import itself and the package root
# (``lightrft``: version and logging set-up); every allowed room must sit on a lower layer.
# docs/architecture.md mirrors this table (test_doc_table_matches).
LAYERS: dict[str, tuple[int, set[str]]] = {
    "lightrft.config": (0, set()),
    "lightrft.distributed": (0, set()),
    "lightrft.view": (0, set()),
    "lightrft.algorithms": (1, {"lightrft.config"}),
    "lightrft.sections": (1, {"lightrft.config"}),
    "lightrft.data": (1, {"lightrft.config", "lightrft.distributed"}),
    "lightrft.kernels": (0, set()),
    "lightrft.models": (
        3,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.sections",
            "lightrft.data",
            "lightrft.kernels",
        },
    ),
    "lightrft.engine": (
        4,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.sections",
            "lightrft.data",
            "lightrft.kernels",
            "lightrft.models",
        },
    ),
    "lightrft.training": (
        5,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.sections",
            "lightrft.data",
            "lightrft.kernels",
            "lightrft.models",
            "lightrft.engine",
        },
    ),
    "lightrft.strategy": (
        6,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.sections",
            "lightrft.data",
            "lightrft.kernels",
            "lightrft.models",
            "lightrft.engine",
            "lightrft.training",
        },
    ),
    # Above rewards, environments and evaluation: a source scores its samples, plays their
    # episodes and evaluates the policy it generates with.
    "lightrft.rollout": (
        11,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.algorithms",
            "lightrft.sections",
            "lightrft.data",
            "lightrft.kernels",
            "lightrft.models",
            "lightrft.engine",
            "lightrft.training",
            "lightrft.strategy",
            "lightrft.rewards",
            "lightrft.environments",
            "lightrft.evaluation",
        },
    ),
    "lightrft.export": (
        6,
        {
            "lightrft.distributed",
            "lightrft.sections",
            "lightrft.models",
            "lightrft.training",
        },
    ),
    "lightrft.rewards": (
        8,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.data",
            "lightrft.kernels",
            "lightrft.models",
            "lightrft.engine",
            "lightrft.export",
        },
    ),
    "lightrft.evaluation": (
        10,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.data",
            "lightrft.engine",
            "lightrft.rewards",
            "lightrft.environments",
        },
    ),
    "lightrft.environments": (
        9,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.data",
            "lightrft.models",
            "lightrft.rewards",
            "lightrft.engine",
        },
    ),
    "lightrft.tasks": (
        10,
        {"lightrft.config", "lightrft.data", "lightrft.models", "lightrft.environments"},
    ),
    "lightrft.cli": (
        11,
        {
            "lightrft.config",
            "lightrft.tasks",
            "lightrft.view",
            "lightrft.engine",
            "lightrft.training",
            "lightrft.export",
        },
    ),
    "lightrft.__main__": (12, {"lightrft.cli"}),
    "lightrft._worker": (12, set()),  # what `lightrft run` forks a CPU worker into
    "lightrft.recipes": (
        12,
        {
            "lightrft.config",
            "lightrft.distributed",
            "lightrft.algorithms",
            "lightrft.sections",
            "lightrft.data",
            "lightrft.kernels",
            "lightrft.models",
            "lightrft.engine",
            "lightrft.training",
            "lightrft.strategy",
            "lightrft.export",
            "lightrft.rollout",
            "lightrft.rewards",
            "lightrft.evaluation",
            "lightrft.environments",
            "lightrft.tasks",
        },
    ),
}
PACKAGE_ROOT = "lightrft"
SOURCES = {"lightrft": "lightrft", "recipes": "lightrft.recipes"}


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (a file of the project)
    name: str | None  # the name taken from dst (`from dst import name`), None for a module
    where: str  # file:line

    def __str__(self) -> str:
        what = f"{self.dst}.{self.name}" if self.name else self.dst
        return f"{self.where}: {self.src} imports {what}"


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    found = {}
    for folder, dotted in SOURCES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            found[".".join([dotted, *parts])] = (path, is_pkg)
    return found


def _absolute(name: str) -> str:
    for folder, dotted in SOURCES.items():
        if folder != "lightrft" and (name == folder or name.startswith(folder + ".")):
            return dotted + name[len(folder) :]
    return name


def _owner(name: str, mods: dict) -> str | None:
    """The project module that ``name`` is, or that holds it; None outside the project."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.cache
def edges(root: Path = ROOT) -> list[Edge]:
    """Every import of a project module by a project module."""
    mods = modules(root)
    out = []
    for src, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = src if is_pkg else src.rpartition(".")[0]
        for node in ast.walk(tree):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    dst = _owner(_absolute(alias.name), mods)
                    if dst is not None:
                        out.append(Edge(src, dst, None, where))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = _absolute(node.module or "")
                if _owner(target, mods) is None:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:  # `from package import module`
                        out.append(Edge(src, sub, None, where))
                    else:
                        out.append(Edge(src, _owner(target, mods), alias.name, where))
    return out


def room(module: str) -> str:
    """The room (top-level part of lightrft) a module belongs to."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for e in edges(root):
        a, b = room(e.src), room(e.dst)
        if a == b or b == PACKAGE_ROOT:
            continue
        if a not in LAYERS or b not in LAYERS:
            bad.append(f"{e}: room {a if a not in LAYERS else b} is not in the layer table")
        elif LAYERS[b][0] >= LAYERS[a][0]:
            bad.append(f"{e}: {a} (layer {LAYERS[a][0]}) imports the higher layer {b}")
        elif b not in LAYERS[a][1]:
            bad.append(f"{e}: {a} may not import {b}")
    return bad


def cycle_violations(root: Path = ROOT) -> list[str]:
    found = edges(root)
    bad = []
    for label, key in (("rooms", room), ("files", lambda m: m)):
        graph: dict[str, set[str]] = {}
        first: dict[tuple[str, str], Edge] = {}
        for e in found:
            a, b = key(e.src), key(e.dst)
            if a != b:
                graph.setdefault(a, set()).add(b)
                first.setdefault((a, b), e)
        for comp in _cycles(graph):
            inside = [str(first[a, b]) for a in comp for b in sorted(graph[a]) if b in comp]
            bad.append(f"import cycle between {label} {comp}: " + "; ".join(inside))
    return bad


def private_violations(root: Path = ROOT) -> list[str]:
    return [
        f"{e}: a private name of another module"
        for e in edges(root)
        if e.src != e.dst
        and (e.name or e.dst.rpartition(".")[2]).startswith("_")
        and not (e.name or e.dst.rpartition(".")[2]).startswith("__")
    ]


def test_layer_table_points_down():
    for name, (layer, allowed) in LAYERS.items():
        for other in allowed:
            assert LAYERS[other][0] < layer, f"{name} may import {other}, which is not lower"


def test_imports_follow_the_layers():
    bad = layer_violations()
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycles():
    bad = cycle_violations()
    assert not bad, "\n".join(bad)


def test_no_private_names_cross_modules():
    bad = private_violations()
    assert not bad, "make these public (drop the underscore) or move them:\n" + "\n".join(bad)


def test_every_module_has_a_room():
    rooms = {room(m) for m in modules()} - {PACKAGE_ROOT}
    assert rooms <= set(LAYERS), f"rooms missing from the layer table: {rooms - set(LAYERS)}"


def doc_table(path: Path = ROOT / "docs" / "architecture.md") -> dict[str, tuple[int, set[str]]]:
    """The ``| layer | room | holds | may import |`` rows of docs/architecture.md."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        names = re.findall(r"`([\w.]+)`", cells[1])
        allowed = set(re.findall(r"`([\w.]+)`", cells[3]))
        for name in names:
            rows[name] = (int(cells[0]), allowed)
    return rows


def test_doc_table_matches():
    assert doc_table() == LAYERS, "docs/architecture.md's table and LAYERS differ"


def _named_in_doc(label: str, path: Path = ROOT / "docs" / "architecture.md") -> set[str]:
    """The names in the parentheses after ``label`` in the layer table, e.g. ``rollout engines
    (native, vLLM, SGLang)`` -> ``{"native", "vllm", "sglang"}``."""
    found = re.findall(re.escape(label) + r" \(([^)]*)\)", path.read_text())
    assert found, f"docs/architecture.md names no {label} (...)"
    return {n.strip().lower() for n in re.split(r",|\|", found[0]) if n.strip()}


def test_doc_names_the_engines_and_modalities_the_code_has():
    """The page's engines are EngineConfig.backend's choices, its modalities text plus the
    fields of ``Media`` (lightrft/data/media.py); its diagram names the same engines."""
    import typing

    from lightrft.engine.config import EngineConfig

    backends = set(typing.get_args(typing.get_type_hints(EngineConfig)["backend"]))
    assert _named_in_doc("rollout engines") == backends
    diagram = re.search(
        r"^\s+4\s+engine\s+(.*)$", (ROOT / "docs" / "architecture.md").read_text(), re.M
    )
    assert {n.strip().lower() for n in diagram[1].split(",")[0].split("|")} == backends
    tree = ast.parse((ROOT / "lightrft" / "data" / "media.py").read_text())
    media = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Media")
    kinds = {n.target.id for n in media.body if isinstance(n, ast.AnnAssign)}
    assert _named_in_doc("datasets of the modalities") == {"text"} | kinds
