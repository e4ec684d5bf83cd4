"""Assert-style tests judged by the parent: the sandbox only computes the program's values.

:func:`plan_asserts` parses a test block with :mod:`ast` and rewrites every ``assert`` into a
report call. Only the sub-expressions that depend on the program (any expression that uses a
name outside a small safe set: ``f(3)``, ``x``, ``obj.attr``) go to the sandbox, each wrapped in
a ``lambda``; the condition around them, with its expected values, stays here with placeholders.
``assert f(3) == 9`` becomes ``__lightrft_report__(0, lambda: f(3))`` in the sandbox and
``__lightrft_v0__ == 9`` here. The sandbox reports the values as tagged JSON data
(:func:`decode`); :func:`judge` evaluates each condition, an expression restricted to literals,
comparisons, arithmetic with size bounds, boolean operators, a few builtins and ``math.isclose``.

Values that are not plain data (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
``bytes``, and lists, tuples, sets, frozensets and dicts of them; subclasses count as their base
value, so an object that claims to equal anything is refused) fail the assert when the condition
needs them: they are never compared by code that runs in the sandbox.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType, SimpleNamespace
from typing import Any

__all__ = ["AssertPlan", "Site", "decode", "judge", "plan_asserts"]

REPORT = "__lightrft_report__"
_VALUE = "__lightrft_v{}__"
_INNER = "__lightrft_e{}__"  # a program value of the current item of a judged comprehension
_ZIP = "__lightrft_zip__"
_ARITH = "__lightrft_arith__"
_ITEMS = "__lightrft_items__"  # each comprehension's iterable, counted against one budget
_Values = list[tuple[ast.expr, ast.Name]]  # program expressions sent, with their placeholders
_MAX_DEPTH = 64
_MAX_ITEMS = 1_000_000  # sequence * int, and other results built here
_MAX_POW_BITS = 1 << 16

_MATH = {"isclose": math.isclose, "inf": math.inf, "nan": math.nan, "pi": math.pi, "e": math.e}
# The builtins a condition may call, each named once. A program-dependent argument of the
# consumers is sent whole (``list(f(x))``), so an iterator or a generator that the program
# returns is consumed in the sandbox.
_CONSUMING = (len, sorted, set, list, tuple, sum, min, max, all, any, frozenset, dict)
_NOT_CONSUMING = (abs, round, int, float, str, bool, range, zip, enumerate, reversed)
_SAFE_FUNCS: dict[str, Any] = {f.__name__: f for f in (*_CONSUMING, *_NOT_CONSUMING)}
_CONSUMERS = {f.__name__ for f in _CONSUMING}
_KEYWORDS = {"sorted": {"reverse"}, "isclose": {"rel_tol", "abs_tol"}}
# The operators whose result can be huge, by node type: each goes through _arith's bounds.
_GUARDED = {
    ast.Mult: operator.mul,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
}


@dataclass(frozen=True)
class Site:
    """One ``assert``: its condition with placeholders, and how many values the sandbox sends."""

    condition: ast.Expression
    n_values: int
    line: int


@dataclass(frozen=True)
class AssertPlan:
    """A test block split in two: ``sandbox_source`` runs after the program; ``sites`` stay here."""

    sandbox_source: str
    sites: tuple[Site, ...]


@functools.lru_cache(maxsize=4096)  # a test block's plan, made once: it never changes
def plan_asserts(source: str) -> AssertPlan:
    """Split a test block; ``ValueError`` naming the line where it is not valid Python."""
    try:
        tree = ast.parse(source, "test.py")
    except SyntaxError as e:
        raise ValueError(f"the test code is not valid Python (line {e.lineno}: {e.msg})") from None
    if any(isinstance(n, ast.Name) and n.id.startswith("__lightrft_") for n in ast.walk(tree)):
        raise ValueError("the test code uses a reserved name (__lightrft_...)")
    rewriter = _Rewriter()
    tree = ast.fix_missing_locations(rewriter.visit(tree))
    return AssertPlan(ast.unparse(tree), tuple(rewriter.sites))


class _Rewriter(ast.NodeTransformer):
    def __init__(self) -> None:
        self.sites: list[Site] = []

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        values: _Values = []
        condition = _split(node.test, values)
        # The values that call nothing (the test's own variables) are read before any call into
        # the program can change them; their placeholders are numbered to match.
        values.sort(key=lambda v: any(isinstance(n, ast.Call) for n in ast.walk(v[0])))
        for i, (_, placeholder) in enumerate(values):
            placeholder.id = _VALUE.format(i)
        site = len(self.sites)
        self.sites.append(Site(ast.Expression(condition), len(values), node.lineno))
        no_args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
        call = ast.Call(
            ast.Name(REPORT, ast.Load()),
            [ast.Constant(site), *(ast.Lambda(no_args, v) for v, _ in values)],
            [],
        )
        return ast.copy_location(ast.Expr(call), node)


def _parent_only(node: ast.AST, bound: frozenset[str] = frozenset()) -> bool:
    """Whether the parent can evaluate ``node`` alone: no name the program could define (names
    in ``bound`` and those a comprehension inside binds are the parent's own variables)."""
    math_names = {id(n.value) for n in ast.walk(node) if _is_math(n)}
    generators = [c for c in ast.walk(node) if isinstance(c, ast.comprehension)]
    bound = bound.union(*(_names(c.target) or () for c in generators))
    for n in ast.walk(node):
        if id(n) in math_names:
            continue
        if not isinstance(n, _STRUCTURE):
            return False
        if isinstance(n, ast.Name) and n.id not in _SAFE_FUNCS and n.id not in bound:
            return False
        if isinstance(n, ast.Attribute) and not _is_math(n):
            return False
        if isinstance(n, ast.Call) and _safe_func(n) is None:
            return False
        if isinstance(n, ast.comprehension) and (n.is_async or _names(n.target) is None):
            return False
    return True


def _names(target: ast.expr) -> frozenset[str] | None:
    """The names a comprehension target binds, if it is a name or a flat tuple of names."""
    elts = target.elts if isinstance(target, ast.Tuple) else [target]
    return frozenset(e.id for e in elts) if all(isinstance(e, ast.Name) for e in elts) else None


def _load(target: ast.expr) -> ast.expr:
    if isinstance(target, ast.Name):
        return ast.Name(target.id, ast.Load())
    return ast.Tuple([_load(e) for e in target.elts], ast.Load())


def _is_math(n: ast.AST) -> bool:
    return (
        isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "math"
        and n.attr in _MATH
    )


def _safe_func(call: ast.Call) -> str | None:
    """The name of a safe function ``call`` calls with allowed keywords, else ``None``."""
    f = call.func
    name = f.attr if _is_math(f) else f.id if isinstance(f, ast.Name) else None
    if name is None or (name not in _SAFE_FUNCS and not _is_math(f)):
        return None
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    if any(k.arg not in _KEYWORDS.get(name, ()) for k in call.keywords):
        return None
    return name


def _split(
    node: ast.expr,
    values: _Values,
    bound: frozenset[str] = frozenset(),
    template: str = _VALUE,
) -> ast.expr:
    """``node`` with every program-dependent sub-expression moved to ``values`` with the
    placeholder name (``template``) that replaces it; ``bound``: names of comprehension variables
    here."""
    if _parent_only(node, bound):
        return node
    rec = lambda n: _split(n, values, bound, template)  # noqa: E731
    if isinstance(node, ast.Compare):
        return ast.Compare(rec(node.left), node.ops, [rec(c) for c in node.comparators])
    if isinstance(node, ast.BoolOp):
        return ast.BoolOp(node.op, [rec(v) for v in node.values])
    if isinstance(node, ast.UnaryOp):
        return ast.UnaryOp(node.op, rec(node.operand))
    if isinstance(node, ast.BinOp) and not isinstance(node.op, ast.MatMult):
        return ast.BinOp(rec(node.left), node.op, rec(node.right))
    if isinstance(node, ast.IfExp):
        return ast.IfExp(rec(node.test), rec(node.body), rec(node.orelse))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(
        isinstance(e, ast.Starred) for e in node.elts
    ):
        return type(node)(
            [rec(e) for e in node.elts], *([ast.Load()] * (type(node) is not ast.Set))
        )
    if isinstance(node, _COMPREHENSIONS) and not bound:
        split = _split_comprehension(node, values)
        if split is not None:
            return split
    if isinstance(node, ast.Call):
        name = _safe_func(node)
        # A consumer is sent whole with its argument, unless the argument compares or chooses
        # (where expected values hide): then the function is applied here.
        hides = (ast.Compare, ast.BoolOp, ast.IfExp, *_COMPREHENSIONS)
        whole = (
            name in _CONSUMERS
            and len(node.args) == 1
            and not node.keywords
            and not any(isinstance(n, hides) for n in ast.walk(node.args[0]))
        )
        if name is not None and not whole:
            kws = [ast.keyword(k.arg, rec(k.value)) for k in node.keywords]
            return ast.Call(node.func, [rec(a) for a in node.args], kws)
    return _placeholder(values, node, template)


def _placeholder(values: _Values, node: ast.expr, template: str = _VALUE) -> ast.Name:
    """A new placeholder name (``template``) for ``node``, which is appended to ``values``."""
    name = ast.Name(template.format(len(values)), ast.Load())
    values.append((node, name))
    return name


_COMPREHENSIONS = (ast.GeneratorExp, ast.ListComp, ast.SetComp)


def _split_comprehension(node: ast.expr, values: _Values) -> ast.expr | None:
    """``all(f(x) == x * x for x in range(5))``: the parent iterates and judges; the sandbox
    computes ``[f(x) for x in range(5)]`` (and ``any(v > 0 for v in f(3))`` sends ``f(3)``).
    ``None`` where the comprehension has another shape (it is then sent whole)."""
    if len(node.generators) != 1:
        return None
    gen = node.generators[0]
    names = _names(gen.target)
    if names is None or gen.is_async or not all(_parent_only(c, names) for c in gen.ifs):
        return None
    inner: _Values = []
    elt = _split(node.elt, inner, names, _INNER)
    if not inner:  # only the iterable needs the program (else _split kept it all here): sent
        # as a list, an iterator or a generator the program returns is data then
        it = _placeholder(values, ast.Call(ast.Name("list", ast.Load()), [gen.iter], []))
        return type(node)(elt, [ast.comprehension(gen.target, it, gen.ifs, 0)])
    if not _parent_only(gen.iter):
        return None
    # Each program part of the element is computed in the sandbox for every item; the parent
    # pairs them with its own items (strictly: another number of items fails).
    each = [ast.comprehension(gen.target, gen.iter, gen.ifs, 0)]
    columns = [_placeholder(values, ast.ListComp(part, each)) for part, _ in inner]
    items = ast.ListComp(_load(gen.target), each)
    target = ast.Tuple(
        [gen.target, *(ast.Name(_INNER.format(j), ast.Store()) for j in range(len(inner)))],
        ast.Store(),
    )
    pairs = ast.Call(ast.Name(_ZIP, ast.Load()), [items, *columns], [])
    return type(node)(elt, [ast.comprehension(target, pairs, [], 0)])


# ---------------------------------------------------------------- values sent as data


@dataclass(frozen=True)
class _Unusable:
    why: str


_INT = re.compile(r"-?\d+")
# The tags whose payload is a string, and what each reads from it ("x": not plain data, or it
# raised: fails where used).
_FROM_STR = {"i": int, "f": float, "s": str, "y": bytes.fromhex, "x": _Unusable}
_COLLECTIONS = {"l": list, "t": tuple, "S": set, "F": frozenset, "d": dict}


def decode(obj: Any, depth: int = 0) -> Any:
    """A value from its tagged form ``[tag, payload]``; ``ValueError`` for anything else."""
    if depth > _MAX_DEPTH or not isinstance(obj, list) or len(obj) != 2:
        raise ValueError("not a tagged value")
    tag, p = obj
    if tag == "n" and p is None:
        return None
    if tag == "b" and isinstance(p, bool):
        return p
    if tag in _FROM_STR and isinstance(p, str) and (tag != "i" or _INT.fullmatch(p)):
        return _FROM_STR[tag](p)
    if tag == "c" and isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p):
        return complex(float(p[0]), float(p[1]))
    if tag in _COLLECTIONS and isinstance(p, list):
        # a dict's items are its [key, value] pairs, each read as a tuple at the dict's depth
        items = [decode(["t", x], depth) if tag == "d" else decode(x, depth + 1) for x in p]
        bad = [x for x in items if isinstance(x, _Unusable)]
        return bad[0] if bad else _COLLECTIONS[tag](items)
    raise ValueError(f"bad tagged value {tag!r}")


def judge(plan: AssertPlan, report: bytes) -> tuple[bool, str]:
    """Whether every assert site reported at least once and every report satisfied its
    condition; the second item says why not (or ``"ok"``)."""
    seen = [False] * len(plan.sites)
    for line in report.splitlines():
        try:
            site, raw = json.loads(line)
            values = [decode(v) for v in raw]
        except (ValueError, TypeError, RecursionError):
            return False, "a malformed report"
        if not isinstance(site, int) or not 0 <= site < len(plan.sites):
            return False, "a report for an unknown assert"
        s = plan.sites[site]
        if len(values) != s.n_values:
            return False, f"the assert on line {s.line}: wrong number of values"
        if not _holds(s.condition, values):
            return False, f"the assert on line {s.line} failed"
        seen[site] = True
    missing = [s.line for s, ok in zip(plan.sites, seen, strict=True) if not ok]
    if missing:
        return False, f"the assert on line {missing[0]} never ran"
    return True, "ok"


def _holds(condition: ast.Expression, values: Sequence[Any]) -> bool:
    """Whether ``condition`` holds for the reported ``values``, evaluated by Python itself: every
    node of a condition is one of :data:`_STRUCTURE` (:func:`_parent_only` checks the parts kept
    whole, :func:`_split` builds the rest of them), its names are the safe functions, ``math``,
    comprehension variables and placeholders (no builtins), so plain data in, plain data out. The
    operations that can build a huge result (:data:`_GUARDED`), ``range`` and ``round`` go through
    bounds checks (values come from the program); a value that is not plain data is left
    undefined, so the condition fails where it needs it."""
    env = {**_ENV, "__builtins__": {}, _ITEMS: functools.partial(_counted, [_MAX_ITEMS])}
    env.update((_VALUE.format(i), v) for i, v in enumerate(values) if not isinstance(v, _Unusable))
    try:
        return bool(eval(_compiled(condition), env))  # noqa: S307 - a checked expression
    except Exception:  # an error of the condition (a raising probe, 1/0, a bound) fails it
        return False


@functools.lru_cache(maxsize=4096)
def _compiled(condition: ast.Expression) -> CodeType:
    """``condition`` with each operation of :data:`_GUARDED` ``a * b`` rewritten to
    ``__lightrft_arith__("Mult", a, b)`` and each comprehension's iterable ``it`` to
    ``__lightrft_items__(it)``, compiled."""

    class Arith(ast.NodeTransformer):
        def visit_BinOp(self, n: ast.BinOp) -> ast.expr:
            if type(n.op) not in _GUARDED:
                return self.generic_visit(n)
            op = ast.Constant(type(n.op).__name__)
            return ast.Call(
                ast.Name(_ARITH, ast.Load()), [op, *map(self.visit, (n.left, n.right))], []
            )

        def visit_comprehension(self, n: ast.comprehension) -> ast.comprehension:
            self.generic_visit(n)
            paired = isinstance(n.iter, ast.Call) and getattr(n.iter.func, "id", "") == _ZIP
            if not paired:  # a zip pairs items its first list comprehension already counted
                n.iter = ast.Call(ast.Name(_ITEMS, ast.Load()), [n.iter], [])
            return n

    for n in ast.walk(condition.body):  # a check only: _split builds nothing else
        if not isinstance(n, _STRUCTURE) or (isinstance(n, ast.Attribute) and not _is_math(n)):
            raise ValueError(f"{type(n).__name__} is not evaluated here")
    tree = ast.fix_missing_locations(Arith().visit(copy.deepcopy(condition)))
    return compile(tree, "assert", "eval")


def _arith(name: str, a: Any, b: Any) -> Any:
    """``a <op> b`` for the ``ast`` operator ``name``; refuses arithmetic whose result would be
    huge (values come from the program)."""
    op = getattr(ast, name)
    ints = isinstance(a, int) and isinstance(b, int)
    if op is ast.Pow and ints and abs(a) > 1 and b > 0 and a.bit_length() * b > _MAX_POW_BITS:
        raise ValueError("power too large")
    if op is ast.LShift and ints and b > _MAX_POW_BITS:
        raise ValueError("shift too large")
    if op is ast.Mult:
        for seq, k in ((a, b), (b, a)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(k, int):
                if len(seq) * k > _MAX_ITEMS:
                    raise ValueError("repetition too large")
    if op is ast.Mod and isinstance(a, (str, bytes)):
        raise ValueError("% formatting")  # formatting could build huge strings
    return _GUARDED[op](a, b)


def _counted(budget: list[int], iterable: Any) -> Any:
    """An iterable's items, each taken from ``budget`` (one per condition): nested
    comprehensions multiply their lengths, so each is bounded by the whole, not by itself."""
    for item in iterable:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("comprehensions too long")
        yield item


def _range(*args: int) -> range:
    r = range(*args)
    if len(r) > _MAX_ITEMS:
        raise ValueError("range too long")
    return r


def _round(number: Any, ndigits: int | None = None) -> Any:
    if isinstance(ndigits, int) and abs(ndigits) > 10_000:
        raise ValueError("round digits")
    return round(number, ndigits)


# The names a condition may use (a comprehension's variables aside).
_ENV = {
    **_SAFE_FUNCS,
    "range": _range,
    "round": _round,
    "math": SimpleNamespace(**_MATH),
    _ZIP: functools.partial(zip, strict=True),
    _ARITH: _arith,
}
# The nodes a condition is made of: _parent_only keeps an expression here only if it holds nothing
# else.
_STRUCTURE = (
    ast.Constant,
    ast.Name,
    ast.Attribute,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.BoolOp,
    ast.UnaryOp,
    ast.IfExp,
    ast.BinOp,
    ast.Compare,
    ast.Subscript,
    ast.Slice,
    *_COMPREHENSIONS,
    ast.Call,
    ast.comprehension,
    ast.keyword,
    ast.expr_context,
    ast.cmpop,
    ast.boolop,
    ast.unaryop,
    ast.operator,
)
