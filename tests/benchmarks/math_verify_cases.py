"""math-verify's own regression cases, scored by math-verify and by our ``MathVerifier``.

Hugging Face's Math-Verify repository keeps its regression cases as pytest parameters
``(gold, pred, expected)`` in ``tests/*.py``. This script reads them from a checkout (it parses
the files with ``ast``; nothing of theirs is imported or copied), then scores every case twice:

(a) math-verify's ``parse`` + ``verify`` with the settings the case's own test uses (extraction
    configs, float precision, strictness, set/relation comparison), in this process, and again
    with the one fixed setting our verifier uses for every case (LaTeX + expression extraction,
    box first, 6 digits, strict, set/relation comparison on): the like-for-like baseline;
(b) our ``MathVerifier()`` end to end: the prediction as the response text, the gold as the
    reference, reward 1.0 or 0.0 (math-verify runs in its worker pool, as in training).

and prints both pass rates (a verdict passes when it equals the case's expected one) and every
case where the two disagree. Usage::

    git clone https://github.com/huggingface/Math-Verify /tmp/Math-Verify
    PYTHONPATH=. python tests/benchmarks/math_verify_cases.py /tmp/Math-Verify

The argument may be the checkout or its ``tests`` folder. Cases whose values are not literals
(an f-string built at import time) are counted as skipped.
"""

from __future__ import annotations

import argparse
import ast
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lightrft.rewards import Sample

# Keyword arguments of their ``compare_strings`` helper that change a verdict, with defaults.
_SETTINGS = {"match_types": ("latex", "expr"), "precision": 6, "strict": True}
_SETTINGS["allow_set_relation_comp"] = False
# The ones MathVerifier uses for every case (lightrft.rewards.math_equiv.judge_response).
_OUR_SETTINGS = dict(_SETTINGS, allow_set_relation_comp=True)


@dataclass(frozen=True)
class Case:
    """One regression case and the math-verify settings its test scores it with."""

    source: str  # file::test[index]
    gold: str
    pred: str
    expected: bool
    match_types: tuple[str, ...] | None  # None: parse()'s default extraction configs
    precision: int
    strict: bool
    allow_set_relation_comp: bool


@dataclass(frozen=True)
class Scored:
    case: Case
    theirs: bool  # math-verify, the test's own settings
    theirs_fixed: bool  # math-verify, our fixed settings
    ours: bool


def with_our_settings(case: Case) -> Case:
    """The case under the settings ``MathVerifier`` uses for everything."""
    return replace(
        case,
        match_types=_OUR_SETTINGS["match_types"],
        precision=_OUR_SETTINGS["precision"],
        strict=_OUR_SETTINGS["strict"],
        allow_set_relation_comp=_OUR_SETTINGS["allow_set_relation_comp"],
    )


def tests_dir(path: Path) -> Path:
    """The folder of test files: ``path`` itself or its ``tests`` folder."""
    for d in (path / "tests", path):
        if d.is_dir() and any(d.glob("test_*.py")):
            return d
    raise ValueError(f"{path} holds no test_*.py files (pass a Math-Verify checkout)")


def _parametrize(dec: ast.expr) -> tuple[list[str], ast.expr] | None:
    """``(argnames, argvalues node)`` of a ``@pytest.mark.parametrize(...)`` decorator."""
    if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
        return None
    if dec.func.attr != "parametrize" or len(dec.args) < 2:
        return None
    names = ast.literal_eval(dec.args[0])
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    return names, dec.args[1]


def _call_settings(fn: ast.FunctionDef) -> dict[str, object]:
    """The verdict settings of a test function's call: ``compare_strings(...)``'s keywords
    (literals, or names of the test's parameters), or parse()'s defaults for a direct
    ``verify(parse(gold), parse(pred))``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "compare_strings":
            found: dict[str, object] = dict(_SETTINGS)
            for kw in node.keywords:
                if isinstance(kw.value, ast.Name):
                    found[kw.arg] = ("param", kw.value.id)
                else:
                    found[kw.arg] = ast.literal_eval(kw.value)
            return found
    return dict(_SETTINGS, match_types=None)


def _cases_of(fn: ast.FunctionDef, source: str) -> Iterator[Case | None]:
    """The cases of one parametrized test (``None`` for a case that is not literal)."""
    settings = _call_settings(fn)
    for dec in fn.decorator_list:
        spec = _parametrize(dec)
        if spec is None:
            continue
        names, values = spec
        expected_name = next((n for n in ("expected", "result") if n in names), None)
        if not {"gold", "pred"} <= set(names) or expected_name is None:
            continue
        for i, row in enumerate(getattr(values, "elts", [])):
            try:
                row_values = dict(zip(names, ast.literal_eval(row), strict=True))
            except ValueError:
                yield None
                continue

            def setting(key: str, row_values: dict = row_values) -> object:
                value = settings[key]
                if isinstance(value, tuple) and value[:1] == ("param",):
                    return row_values[value[1]]
                return value

            match_types = setting("match_types")
            yield Case(
                source=f"{source}::{fn.name}[{i}]",
                gold=row_values["gold"],
                pred=row_values["pred"],
                expected=bool(row_values[expected_name]),
                match_types=None if match_types is None else tuple(match_types),
                precision=int(setting("precision")),
                strict=bool(setting("strict")),
                allow_set_relation_comp=bool(setting("allow_set_relation_comp")),
            )


def read_cases(folder: Path) -> tuple[list[Case], int]:
    """Every literal ``(gold, pred, expected)`` case of the test files, and how many were
    skipped as not literal."""
    cases, skipped = [], 0
    for path in sorted(folder.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef):
                for case in _cases_of(fn, path.name):
                    if case is None:
                        skipped += 1
                    else:
                        cases.append(case)
    return cases, skipped


def theirs(case: Case) -> bool:
    """math-verify's verdict with the case's own settings."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if case.match_types is None:
        gold, pred = parse(case.gold), parse(case.pred)
    else:
        make = {
            "latex": lambda: LatexExtractionConfig(boxed_match_priority=0),
            "expr": ExprExtractionConfig,
        }
        configs = [make[m]() for m in case.match_types]
        gold, pred = parse(case.gold, configs), parse(case.pred, configs)
    return bool(
        verify(
            gold,
            pred,
            float_rounding=case.precision,
            strict=case.strict,
            allow_set_relation_comp=case.allow_set_relation_comp,
        )
    )


def ours(cases: Sequence[Case], workers: int, timeout: float) -> list[bool]:
    """Our ``MathVerifier`` end to end: response = pred, reference = gold."""
    from lightrft.rewards import MathVerifier

    verifier = MathVerifier(workers=workers, timeout=timeout)
    try:
        rewards = verifier(
            Sample.batch(
                ["q"] * len(cases),
                [c.pred for c in cases],
                references=[c.gold for c in cases],
                labels=[None] * len(cases),
            )
        )
    finally:
        verifier.close()
    return [r == 1.0 for r in rewards]


def _preview(text: str, width: int = 90) -> str:
    one_line = " ".join(text.split())
    return (
        one_line
        if len(one_line) <= width
        else one_line[: width // 2] + " ... " + one_line[-width // 2 :]
    )


def _settings_note(case: Case) -> str:
    """The settings of the case's own test that differ from ours, as a note."""
    ours_ = with_our_settings(case)
    keys = ("match_types", "precision", "strict", "allow_set_relation_comp")
    diff = [f"{k}={getattr(case, k)}" for k in keys if getattr(case, k) != getattr(ours_, k)]
    return f"  [its test: {', '.join(diff)}]" if diff else ""


def report(scored: Sequence[Scored], skipped: int) -> str:
    """Both pass rates and the cases where our verdict differs from math-verify's."""
    n = len(scored)
    theirs_ok = sum(s.theirs == s.case.expected for s in scored)
    fixed_ok = sum(s.theirs_fixed == s.case.expected for s in scored)
    ours_ok = sum(s.ours == s.case.expected for s in scored)
    lines = [
        f"{n} cases ({skipped} skipped: not literal)",
        f"math-verify parse+verify, each test's settings: {theirs_ok}/{n} = {theirs_ok / n:.1%}",
        f"math-verify parse+verify, our fixed settings:   {fixed_ok}/{n} = {fixed_ok / n:.1%}",
        f"lightrft MathVerifier, end to end (defaults):   {ours_ok}/{n} = {ours_ok / n:.1%}",
        "",
        "cases where we differ from math-verify with the test's settings"
        " (expected | math-verify | math-verify, our settings | ours):",
    ]
    for s in scored:
        if s.ours != s.theirs:
            c = s.case
            note = _settings_note(c)
            verdicts = (
                f"{int(c.expected)} | {int(s.theirs)} | {int(s.theirs_fixed)} | {int(s.ours)}"
            )
            lines.append(f"- {c.source}: {verdicts}{note}")
            lines.append(f"    gold: {_preview(c.gold)}")
            lines.append(f"    pred: {_preview(c.pred)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a Math-Verify checkout or its tests folder")
    parser.add_argument("--workers", type=int, default=1, help="our math-verify workers")
    parser.add_argument("--timeout", type=float, default=5.0, help="our seconds per answer")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # math-verify's per-call timeout notices
    cases, skipped = read_cases(tests_dir(args.path))
    if not cases:
        raise ValueError(f"no (gold, pred, expected) cases found under {args.path}")
    start = time.monotonic()
    their_verdicts = [theirs(c) for c in cases]
    theirs_s = time.monotonic() - start
    fixed_verdicts = [theirs(with_our_settings(c)) for c in cases]
    start = time.monotonic()
    our_verdicts = ours(cases, args.workers, args.timeout)
    ours_s = time.monotonic() - start
    scored = [
        Scored(*row)
        for row in zip(cases, their_verdicts, fixed_verdicts, our_verdicts, strict=True)
    ]
    print(report(scored, skipped))
    print(f"\ntime: math-verify {theirs_s:.1f} s, ours {ours_s:.1f} s (incl. worker start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
