"""Final-answer extraction and answer equivalence for math responses, without sympy.

Extraction finds the answer a response commits to; equivalence decides whether two answer strings
mean the same value. Both are pure functions of strings, so verifiers stay small and testable.

Equivalence is deliberately conservative: numbers (integers, decimals, fractions, ``\\frac``,
percentages, with units or ``$`` around them) compare exactly as rationals; anything else compares
as a normalised LaTeX string. It does not do algebra (``\\sqrt{8}`` is not ``2\\sqrt{2}``).

Two rules keep it safe and honest on hostile answers:

- **Size bound.** An answer with a run of more than :data:`MAX_NUMBER_DIGITS` digits, or an
  exponent (``1e...`` or ``^{...}``) beyond ±:data:`MAX_NUMBER_EXPONENT`, is not a number:
  :func:`oversized_number` says why, and :func:`parse_number` refuses it, so no comparison
  ever builds a huge integer (``1e999999999`` would take minutes).
- **Equations.** An answer with a top-level ``=`` stands for its last right-hand side only when
  its first left-hand side is a variable name (``x = 7``, ``x_1 = 7``, ``\\theta = 7``,
  ``(x, y) = (1, 2)``, ``x = 2 + 5 = 7``); otherwise (``100 = 7``, ``2x = 14``) it is an
  equation (:func:`is_equation`), never the value on its right.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

__all__ = [
    "EXTRACTORS",
    "MAX_NUMBER_DIGITS",
    "MAX_NUMBER_EXPONENT",
    "answer_key",
    "answers_match",
    "equation_mismatch",
    "extract_answer",
    "extract_answer_is",
    "extract_boxed",
    "extract_hashes",
    "extract_last_number",
    "is_equation",
    "majority_vote",
    "math_verify_reference",
    "normalize_answer",
    "oversized_number",
    "parse_number",
    "plain_number_answer",
]

# --------------------------------------------------------------------------- extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")


def _closing_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` -> index of its matching ``}`` (unclosed ones are absent), in one
    pass, so a response with many boxes or deep nesting costs linear time."""
    match, stack = {}, []
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            match[stack.pop()] = i
    return match


def extract_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), braces nested.

    ``\\boxed 5`` (no braces) yields ``5``. A truncated last box is skipped in favour of the one
    before it, since only a closed box is a committed answer.
    """
    closing: dict[int, int] | None = None
    for m in reversed(list(_BOXED.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            if closing is None:
                closing = _closing_braces(text)
            if i in closing:
                return text[i + 1 : closing[i]].strip()
            # else unbalanced: the response was cut off inside the box
        if i > m.end():  # `\\boxed 5`: the argument is the next token
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                return tok.group(0)
    return None


_HASHES = re.compile(r"####[ \t]*([^\n]*)")


def extract_hashes(text: str) -> str | None:
    """The answer after the last GSM8K-style ``#### `` marker, up to the end of its line."""
    found = [a for m in _HASHES.finditer(text) if (a := m.group(1).strip())]
    return found[-1] if found else None


_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?[ \t]*([^\n]+)", re.IGNORECASE)


def extract_answer_is(text: str) -> str | None:
    """The answer of the last "the (final) answer is X" / "Answer: X", up to the sentence end."""
    found = [m.group(1) for m in _ANSWER_IS.finditer(text)]
    if not found:
        return None
    # A full stop followed by a space or the end closes the sentence; a decimal point does not.
    ans = re.split(r"\.(?:\s|$)", found[-1], maxsplit=1)[0].strip()
    return ans or None


_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"  # a minus that is a sign, not a subtraction (`10-3`)
    r"(?:\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"  # \frac{1}{2}
    r"|(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?"  # 1,000.5  3/4
    r"|\.\d+)"  # .5
)


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (with thousands separators, decimals, ``a/b`` or ``\\frac``)."""
    found = _NUMBER.findall(text)
    return found[-1].strip() if found else None


EXTRACTORS = {
    "boxed": extract_boxed,
    "hashes": extract_hashes,
    "answer_is": extract_answer_is,
    "last_number": extract_last_number,
}


def extract_answer(
    text: str, order: Sequence[str] = ("boxed", "hashes", "answer_is", "last_number")
) -> str | None:
    """The first answer found by the extractors named in ``order`` (keys of :data:`EXTRACTORS`)."""
    for name in order:
        if name not in EXTRACTORS:
            raise ValueError(f"unknown answer extractor {name!r}; choose from {sorted(EXTRACTORS)}")
        ans = EXTRACTORS[name](text)
        if ans:
            return ans
    return None


# --------------------------------------------------------------------------- math-verify's input

# A number spelled the one way math-verify and these rules are sure to read alike: digits with an
# optional decimal part, or comma-grouped thousands that do not start with 0 (`0,111` is a
# decimal comma to math-verify), a plain `a/b` or `\frac{a}{b}` of integers, with a sign.
_PLAIN_NUMBER = re.compile(
    r"[+-]?(?:(?:\d+|[1-9]\d{0,2}(?:,\d{3})+)(?:\.\d+)?|\d+\s*/\s*\d+|\\[dt]?frac\{\d+\}\{\d+\})"
)


def plain_number_answer(text: str) -> str | None:
    """The answer of a response that commits to one plain number beyond doubt, else ``None``.

    That is the content of the response's only ``\\boxed{}`` (complete, no other box anywhere),
    or the whole response when it is nothing but the number, and in both cases a number spelled
    plainly (``42``, ``-0.5``, ``1,000``, ``3/4``, ``\\frac{3}{4}``): where math-verify's
    extraction cannot pick anything else and reads the number the same way. A verifier may
    compare such an answer without math-verify (the fast path); anything else (several boxes,
    display math, ``1 000``, ``3,5``, ``\\frac13``, a box holding a text) is for math-verify.
    """
    boxes = len(_BOXED.findall(text))
    if boxes > 1:
        return None
    ans = extract_boxed(text) if boxes else text.strip()
    if ans is None or not _PLAIN_NUMBER.fullmatch(ans):
        return None
    return ans


_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\(?:boxed|fbox)\b")


def math_verify_reference(reference: str) -> str:
    """The text math-verify parses as the gold answer of ``reference``.

    A GSM8K solution's ``#### N`` answer is boxed (``\\boxed{N}``); a reference that already
    marks its math (a ``\\boxed{}``, ``$...$``, ``\\( \\)``, ``\\[ \\]``) is read as written,
    so math-verify finds its answer the way it finds a response's (several boxes form a set); a
    bare answer (``\\frac{1}{2}``, ``(1, 2]``, ``x^2+1``) is boxed, since math-verify reads
    LaTeX only inside delimiters.
    """
    ref = reference.strip()
    hashes = extract_hashes(ref)
    if hashes is not None:
        return "\\boxed{" + hashes + "}"
    if _DELIMITED.search(ref):
        return ref
    return "\\boxed{" + ref + "}"


# --------------------------------------------------------------------------- equations

_GREEK = (
    "alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu"
    "|xi|pi|rho|sigma|tau|upsilon|phi|varphi|chi|psi|omega"
    "|Gamma|Delta|Theta|Lambda|Xi|Pi|Sigma|Upsilon|Phi|Psi|Omega"
)
# One letter (Latin, or Greek spelled in LaTeX), a subscript, primes: x, x_1, y_{ab}, \theta, f'.
_VAR = rf"(?:[A-Za-z]|\\(?:{_GREEK})(?![A-Za-z]))(?:_(?:\{{[^{{}}]*\}}|[A-Za-z0-9]))?'*"
_VAR_NAME = re.compile(rf"\s*(?:{_VAR}|\(\s*{_VAR}(?:\s*,\s*{_VAR})*\s*\))\s*")


def _split_top(s: str, sep: str) -> list[str]:
    """``s`` split at each ``sep`` character outside brackets. An ``=`` that is part of ``<=``,
    ``>=``, ``!=``, ``:=`` or ``==`` does not split."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(depth - 1, 0)  # half-open intervals close with the other bracket
        elif c == sep and depth == 0:
            if sep == "=" and (
                s[i - 1 : i] in ("<", ">", "!", ":", "=") or s[i + 1 : i + 2] == "="
            ):
                continue
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _assigned_value(s: str) -> str:
    """The last side of ``var = ... = value`` (see the module docstring), else ``s`` unchanged.
    A list of assignments (``x = 3, y = 4``) is left whole: each element is read on its own."""
    if len(_split_top(s, ",")) > 1:
        return s
    sides = _split_top(s, "=")
    if len(sides) > 1 and _VAR_NAME.fullmatch(sides[0]):
        return sides[-1].strip()
    return s


_SUBSCRIPT = re.compile(r"_(?:\{[^{}]*\}|\w)")


def _is_label(side: str) -> bool:
    """Whether an equation's left side names the value on its right: it has a letter and no
    digit outside subscripts (``AB``, ``|AB|``, ``f(x)``, ``V_{1}:V_{2}``, ``\\frac{NO}{BO}``);
    ``100``, ``2x``, ``3 + 4`` and ``x^2 + y^2`` do not."""
    bare = _SUBSCRIPT.sub("", side)
    return re.search(r"[A-Za-z]", bare) is not None and re.search(r"\d", bare) is None


def is_equation(ans: str, labels: bool = False) -> bool:
    """Whether an answer is an equation rather than a value: a top-level ``=`` whose left side
    is not a variable name (``100 = 7``, ``2x = 14``; ``x = 7`` is the value 7). With
    ``labels`` (the math-verify path), any left side without a number outside subscripts names
    the value too (``AB = 4``, ``f(x) = 1``, ``V_1:V_2 = 11:21``; see :func:`_is_label`), as
    math-verify reads it; ``100 = 7`` stays an equation. A list is an equation if any of its
    elements is."""
    parts = _split_top(normalize_answer(ans), ",")
    if len(parts) > 1:
        return any(is_equation(p, labels) for p in parts)
    sides = _split_top(parts[0], "=")
    return len(sides) > 1 and not (labels and _is_label(sides[0]))


def equation_mismatch(pred: str, ref: str) -> bool:
    """Whether one answer is an equation (:func:`is_equation` with ``labels``) and the other has
    no top-level ``=`` at all: unequal, whatever math-verify finds (it reads ``100 = 7`` as 7).
    Two answers that both hold an ``=`` (``2x+4y-3=0`` and ``y=-\\frac{1}{2}x+\\frac{3}{4}``)
    are math-verify's to compare."""
    return any(
        is_equation(a, labels=True) and len(_split_top(b, "=")) == 1
        for a, b in ((pred, ref), (ref, pred))
    )


# --------------------------------------------------------------------------- normalisation

_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad\b|~")


def normalize_answer(ans: str) -> str:
    """A canonical string form of an answer: no math delimiters, ``$``, thousands separators,
    LaTeX spacing, ``\\text`` wrappers, degree signs, a variable's ``x =`` (the last side of
    ``x = 2 + 5 = 7``) or trailing full stop;
    ``\\dfrac``/``\\tfrac`` spelled ``\\frac``; single spaces."""
    s = ans.strip().replace("\u2212", "-")  # Unicode minus sign
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = re.sub(r"^\\[(\[]|\\[)\]]$", "", s)  # \( ... \) and \[ ... \]
    s = s.replace("\\$", "").replace("$", "")
    s = _WRAPPERS.sub(r"\1", s)
    s = _SPACING.sub(" ", s)
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = s.replace("\\%", "%")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # \sqrt2
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # 1,000,000 -> 1000000
    s = _assigned_value(s.strip())  # x = 5 -> 5, 100 = 7 stays an equation
    s = re.sub(r"^\(([A-Za-z])\)$", r"\1", s)  # (B) -> B
    s = re.sub(r"\s+", " ", s).strip()
    return s.rstrip(".").strip()


# No real answer comes near these; past them, building the exact value is what takes the time.
MAX_NUMBER_DIGITS = 1000  # digits in a row (after thousands separators are dropped)
MAX_NUMBER_EXPONENT = 10_000  # |e| of 1e..., and of a literal power ^{...}
_LONG_DIGITS = re.compile(rf"\d{{{MAX_NUMBER_DIGITS + 1},}}")
_EXPONENT = re.compile(r"(?:(?<=\d)\.?[eE]|\^)\s*\{?\s*[+-]?\s*0*(\d+)")  # 1e5, 1.e5, 2^{5}


def oversized_number(ans: str) -> str | None:
    """Why ``ans`` holds a number too large to compare exactly (more than
    :data:`MAX_NUMBER_DIGITS` digits in a row, or an exponent beyond ±:data:`MAX_NUMBER_EXPONENT`),
    else ``None``. Linear in the length of ``ans``."""
    plain = re.sub(r"(?<=\d)(?:,|\{,\})(?=\d)", "", ans)
    m = _LONG_DIGITS.search(plain)
    if m:
        return f"a number of {len(m.group(0))} digits (the bound is {MAX_NUMBER_DIGITS})"
    for m in _EXPONENT.finditer(ans):
        e = m.group(1)
        if len(e) > len(str(MAX_NUMBER_EXPONENT)) or int(e) > MAX_NUMBER_EXPONENT:
            shown = e if len(e) <= 20 else f"{e[:20]}... ({len(e)} digits)"
            return f"an exponent of {shown} (the bound is {MAX_NUMBER_EXPONENT})"
    return None


_DEC = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_UNITS = re.compile(r"(?:[A-Za-z\s./']|\^\{?[23]\}?)+")  # "dollars", "km/h", "m^2", "sq. ft"
_VARIABLES = set("abcnkxyzt")
_FRAC = re.compile(r"\\frac\{([^{}]+)\}\{([^{}]+)\}")


def _parse_plain(s: str) -> Fraction | None:
    """A signed decimal, ``a/b``, ``\\frac{a}{b}`` or mixed ``2\\frac{1}{2}`` as a rational."""
    if oversized_number(s):
        return None
    s = re.sub(r"\s*([/{}])\s*", r"\1", s.strip())
    s = re.sub(r"^([+-])\s+", r"\1", s)
    s = re.sub(r"(\d)\s+\\frac", r"\1\\frac", s)
    # Fraction reads every string _DEC matches, and no division below is by 0: nothing raises.
    if re.fullmatch(_DEC, s):
        return Fraction(s)
    m = re.fullmatch(rf"({_DEC})/({_DEC})", s)
    if m:
        den = Fraction(m.group(2))
        return Fraction(m.group(1)) / den if den else None
    m = re.fullmatch(rf"([+-]?)(\d*){_FRAC.pattern}", s)
    if m:
        sign, whole, a, b = m.groups()
        num, den = _parse_plain(a), _parse_plain(b)
        if num is None or not den:
            return None
        val = num / den
        if whole:  # a mixed number: 2\frac{1}{2} = 2.5
            val = int(whole) + val
        return -val if sign == "-" else val
    return None


_WITH_UNITS = re.compile(
    rf"(?P<num>{_DEC}(?:\s*/\s*{_DEC})?|[+-]?\d*\s*{_FRAC.pattern})\s*(?P<rest>.+)"
)


def parse_number(ans: str) -> tuple[Fraction, bool] | None:
    """``(value, is_percent)`` of a normalised numeric answer, else ``None`` (also for a number
    past the size bound: see :func:`oversized_number`).

    Trailing unit words are dropped (``18 dollars``, ``5 km/h``); a number followed by words
    that contain other numbers is not a number.
    """
    s = ans.strip()
    percent = s.endswith("%")
    if percent:
        s = s[:-1].strip()
    val = _parse_plain(s)
    if val is not None:
        return val, percent
    m = _WITH_UNITS.fullmatch(s)
    if percent or m is None or not _UNITS.fullmatch(m.group("rest")):
        return None
    if m.group("rest") in _VARIABLES:  # `5x` is an expression, not five of a unit
        return None
    val = _parse_plain(m.group("num"))
    if val is None:
        return None
    return val, m.group("rest").strip().lower() in ("percent", "per cent")


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False  # integers: exact, so 1000000 != 1000001
    # A rounded decimal of a non-terminating value (0.3333333 for 1/3) within 1e-6 relative.
    return abs(a - b) <= Fraction(1, 10**6) * max(abs(a), abs(b))


def _split_tuple(s: str) -> list[str] | None:
    """Top-level elements of ``(a, b)`` / ``[a, b]`` / ``a, b``; ``None`` if not a tuple."""
    if len(s) >= 2 and s[0] + s[-1] in ("()", "[]", "{}"):
        s = s[1:-1]
    parts = [p.strip() for p in _split_top(s, ",")]
    return parts if len(parts) > 1 else None


def answers_match(pred: str | None, ref: str | None) -> bool:
    """Whether two answers are equivalent: same number (18 = 18.0 = $18 = 18 dollars,
    3/4 = 0.75 = \\frac{3}{4}, 50% = 50 = 0.5), same normalised LaTeX, or equal tuples."""
    if pred is None or ref is None:
        return False
    p, r = normalize_answer(str(pred)), normalize_answer(str(ref))
    if not p or not r:
        return False
    if p.replace(" ", "") == r.replace(" ", ""):
        return True
    pn, rn = parse_number(p), parse_number(r)
    if pn is not None and rn is not None:
        # A percentage may be written as its number or as a fraction of one: 50% = 50 = 0.5.
        pv = {pn[0], pn[0] / 100} if pn[1] else {pn[0]}
        rv = {rn[0], rn[0] / 100} if rn[1] else {rn[0]}
        return any(_numbers_equal(a, b) for a in pv for b in rv)
    pt, rt = _split_tuple(p), _split_tuple(r)
    if pt is not None and rt is not None and len(pt) == len(rt):
        return all(answers_match(a, b) for a, b in zip(pt, rt, strict=True))
    return False


# --------------------------------------------------------------------------- voting


def answer_key(ans: str) -> str:
    """A key under which equal answers vote together: the exact value of a plain number
    (``0.5``, ``1/2`` and ``\\frac{1}{2}`` share one), else the normalised string."""
    norm = normalize_answer(ans)
    num = parse_number(norm)
    if num is not None:
        return f"{num[0]}{'%' if num[1] else ''}"
    return norm.replace(" ", "")


def majority_vote(answers: Sequence[str | None]) -> tuple[str | None, int]:
    """The most common answer (by :func:`answer_key`) and its vote count; ``None`` answers do
    not vote. Ties go to the answer seen first, so the result does not depend on hashing."""
    keyed = [(answer_key(a), a) for a in answers if a is not None]
    if not keyed:
        return None, 0
    # most_common orders equal counts as first encountered
    best, votes = Counter(k for k, _ in keyed).most_common(1)[0]
    return next(a for k, a in keyed if k == best), votes
