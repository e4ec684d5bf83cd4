"""A synthetic arithmetic task with verifiable answers, for tiny CPU demos and tests.

Problems such as ``"12+34="`` (``style="equation"``) or ``"What is 12+34?"``
(``style="question"``) with the exact integer answer. Records carry ``prompt``, ``completion``
(the answer, for SFT), ``answer`` (the reference, for RL verifiers) and ``label``. The easiest
setting, 2-digit addition, is learnable by a tiny character-level model in minutes on a CPU;
``digits``, ``terms`` and ``ops`` make it harder.

``ensure_arith_dataset`` writes ``train.jsonl`` and ``test.jsonl`` (disjoint problems) only when
they are absent or were made with other settings, so configs can call it on every start.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightrft.config import at_least
from lightrft.tasks.made import META, derive_splits, ensure_made, write_made

OPS = ("+", "-", "*")
STYLES = ("equation", "question")
ANSWER_ORDERS = ("natural", "reversed")


def _norm_ops(ops: str | Sequence[str]) -> tuple[str, ...]:
    out = tuple(ops) if isinstance(ops, str) else tuple(str(o) for o in ops)
    bad = [o for o in out if o not in OPS]
    if not out or bad:
        raise ValueError(f"ops must be a non-empty list of {list(OPS)}, got {list(out)}")
    return tuple(dict.fromkeys(out))  # dedupe, keep order


def arith_records(
    n: int,
    *,
    digits: int = 2,
    min_digits: int = 1,
    ops: str | Sequence[str] = ("+",),
    terms: int = 2,
    style: str = "equation",
    allow_negative: bool = False,
    answer_order: str = "natural",
    seed: int = 0,
    exclude: set[str] | None = None,
) -> list[dict[str, Any]]:
    """``n`` distinct problems (no prompt in ``exclude``), deterministic for the arguments.

    Operands have between ``min_digits`` and ``digits`` digits (``min_digits=1`` includes 0).
    With ``allow_negative=False`` problems whose answer is negative are skipped.
    ``answer_order="reversed"`` writes the answer least-significant digit first, zero-padded to
    the longest possible answer (``49+97=`` -> ``641``, ``3+4=`` -> ``700``): every answer
    digit is then a function of one column and the carry just written, the order in which
    people add, and a tiny transformer generalises it to unseen problems.
    """
    ops_ = _norm_ops(ops)
    if not 1 <= min_digits <= digits:
        raise ValueError(
            f"need 1 <= min_digits <= digits, got min_digits={min_digits}, digits={digits}"
        )
    at_least("terms", terms, 2)
    if style not in STYLES:
        raise ValueError(f"style must be one of {list(STYLES)}, got {style!r}")
    if answer_order not in ANSWER_ORDERS:
        raise ValueError(f"answer_order must be one of {list(ANSWER_ORDERS)}, got {answer_order!r}")
    if answer_order == "reversed" and (allow_negative or ops_ != ("+",)):
        raise ValueError('answer_order="reversed" is defined for additions (ops=["+"]) only')
    at_least("n", n, 0)
    lo = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    hi = 10**digits - 1
    exclude = exclude or set()
    space = (hi - lo + 1) ** terms * len(ops_) ** (terms - 1)
    if n + len(exclude) > space // 2:
        raise ValueError(
            f"asked for {n} distinct problems (plus {len(exclude)} excluded) but digits={digits}, "
            f"min_digits={min_digits}, terms={terms}, ops={list(ops_)} allow only about "
            f"{space}: ask for fewer or raise digits/terms"
        )
    width = len(str(terms * hi))  # the longest possible sum
    rng = random.Random(seed)
    seen: set[str] = set(exclude)
    out = []
    while len(out) < n:
        operands = [rng.randint(lo, hi) for _ in range(terms)]
        operators = [rng.choice(ops_) for _ in range(terms - 1)]
        expr = "".join(f"{a}{op}" for a, op in zip(operands, [*operators, ""], strict=True))
        # Integers and + - * only: Python's value, * before + and -, left to right otherwise.
        value = eval(expr)
        if value < 0 and not allow_negative:
            continue
        prompt = f"{expr}=" if style == "equation" else f"What is {expr}?"
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = str(value) if answer_order == "natural" else str(value).zfill(width)[::-1]
        out.append({"prompt": prompt, "completion": answer, "answer": answer, "label": "arith"})
    return out


def _settings(**kw: Any) -> dict[str, Any]:
    kw["ops"] = list(_norm_ops(kw["ops"]))
    return kw


def write_arith_dataset(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 2000,
    n_test: int = 200,
    digits: int = 2,
    min_digits: int = 1,
    ops: str | Sequence[str] = ("+",),
    terms: int = 2,
    style: str = "equation",
    allow_negative: bool = False,
    answer_order: str = "natural",
    dropped_carry: float = 0.0,
    seed: int = 0,
) -> Path:
    """Write ``train.jsonl``, ``test.jsonl`` (no problem in both) and ``meta.json``.

    ``dropped_carry`` makes a sloppy teacher for SFT: that share of the training problems whose
    sum carries into a new leading digit (``49+97=146``) get a completion without that carry
    (``46``; reversed: ``640``), drawn at random. Their ``answer``, the reference RL verifiers
    use, stays right, and so does every test record. An SFT model trained to convergence on
    such data settles where the teacher's habit puts it (greedy: the carry dropped whenever
    ``dropped_carry > 0.5``), a stable starting point from which RL against the answers has
    something to correct.
    """
    # What meta.json records: every argument but out_dir, ops normalised.
    settings = _settings(**{k: v for k, v in locals().items() if k != "out_dir"})
    if not 0.0 <= dropped_carry <= 1.0:
        raise ValueError(f"dropped_carry must be in [0, 1], got {dropped_carry}")
    if dropped_carry and (terms != 2 or settings["ops"] != ["+"]):
        raise ValueError("dropped_carry is defined for sums of two terms (ops=['+'], terms=2)")
    keys = ("digits", "min_digits", "ops", "terms", "style", "allow_negative", "answer_order")
    common = {k: settings[k] for k in keys}
    test = arith_records(n_test, seed=seed + 1, **common)
    train = arith_records(n_train, seed=seed, exclude={r["prompt"] for r in test}, **common)
    if dropped_carry:  # that share of the carrying sums gets the sloppy teacher's completion
        rng = random.Random(~seed)
        for j, rec in enumerate(train):
            sloppy = _dropped_carry(rec["answer"], 10**digits, answer_order == "reversed")
            if sloppy is not None and rng.random() < dropped_carry:
                train[j] = {**rec, "completion": sloppy}
    return write_made(Path(out_dir), [("train", train), ("test", test)], settings)


def _dropped_carry(answer: str, top: int, reversed_order: bool) -> str | None:
    """The answer ``sum - top`` to a sum of at least ``top`` (a carry into a new leading digit
    dropped), spelled as ``answer`` is; None for a smaller sum."""
    value = int(answer[::-1]) if reversed_order else int(answer)
    if value < top:
        return None
    return str(value - top).zfill(len(answer))[::-1] if reversed_order else str(value - top)


def ensure_arith_dataset(out_dir: str | os.PathLike, **settings: Any) -> Path:
    """:func:`write_arith_dataset` unless ``out_dir`` already holds it with these settings."""
    return ensure_made(
        write_arith_dataset, out_dir, ("train.jsonl", "test.jsonl"), settings, normalise=_settings
    )


# ------------------------------------------------------------------------------ preference pairs

NEAR_MISS_OFFSETS = (-10, -2, -1, 1, 2, 10)


def near_miss(answer: int, rng: random.Random) -> int:
    """A wrong answer close to ``answer``: off by 1, 2 or 10, or two digits swapped."""
    text = str(abs(answer))
    while True:
        if len(text) > 1 and rng.random() < 0.25:
            i = rng.randrange(len(text) - 1)
            swapped = text[:i] + text[i + 1] + text[i] + text[i + 2 :]
            wrong = int(swapped) * (1 if answer >= 0 else -1)
        else:
            wrong = answer + rng.choice(NEAR_MISS_OFFSETS)
        if wrong != answer and (wrong >= 0 or answer < 0):
            return wrong


def near_miss_text(answer: str, rng: random.Random, *, reversed_order: bool = False) -> str:
    """:func:`near_miss` of an answer as the data set spells it: for reversed-order answers
    (``"641"`` is 146) the wrong value is spelled the same way, zero-padded to the same width."""
    if not reversed_order:
        return str(near_miss(int(answer), rng))
    value, width = int(answer[::-1]), len(answer)
    while True:
        wrong = near_miss(value, rng)
        if len(str(wrong)) <= width:
            return str(wrong).zfill(width)[::-1]


def _source(src: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What derived data records of its arithmetic source (its path and its files' times), and
    the source's settings (its meta.json; none for data written without one)."""
    for split in ("train", "test"):
        if not (src / f"{split}.jsonl").is_file():
            raise ValueError(f"no {split}.jsonl in {src}: write the arithmetic data set first")
    stamp = [(src / f"{s}.jsonl").stat().st_mtime_ns for s in ("train", "test")]
    meta = json.loads((src / META).read_text()) if (src / META).is_file() else {}
    return {"source": str(src.resolve()), "source_mtime_ns": stamp}, meta


# The judge prompt of the arithmetic judgment data; GenerativeReward(template=...) must use it.
ARITH_JUDGE_TEMPLATE = "{prompt} A={response_a} B={response_b} better:"


def ensure_arith_judgments(
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    *,
    template: str = ARITH_JUDGE_TEMPLATE,
    seed: int = 0,
) -> Path:
    """Judgment data for a generative reward model: SFT records whose prompt shows a problem, its
    correct answer and a :func:`near_miss` in random order (``template``), and whose completion
    is the verdict, ``A`` or ``B``. Train with the SFT recipe (configs/tiny/judge_sft.yaml); use
    with ``GenerativeReward(mode="choice", template=template)``."""
    src = Path(source_dir)
    source, meta = _source(src)
    want = {**source, "template": template, "seed": seed, "kind": "judgments"}
    rev = meta.get("answer_order") == "reversed"

    def rows(rec: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
        answer = rec["answer"]
        wrong = near_miss_text(answer, rng, reversed_order=rev)
        first = rng.random() < 0.5  # where the correct answer goes
        a, b = (answer, wrong) if first else (wrong, answer)
        prompt = template.format(prompt=rec["prompt"], response_a=a, response_b=b)
        return [{"prompt": prompt, "completion": "A" if first else "B"}]

    return derive_splits(src, Path(out_dir), want, rows)


def ensure_arith_preferences(
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    *,
    per_problem: int = 1,
    seed: int = 0,
    rejected: str = "near_miss",
) -> Path:
    """Preference pairs from an arithmetic data set: the correct answer preferred over a near miss.

    Reads ``source_dir/{train,test}.jsonl`` (see :func:`write_arith_dataset`) and writes
    ``out_dir/{train,test}.jsonl`` with ``prompt``, ``chosen`` (the answer), ``rejected`` (a
    :func:`near_miss`, spelled as the source spells answers: reversed-order data gets reversed,
    zero-padded near misses), ``per_problem`` pairs per problem; skipped when already written from
    the same source and settings. ``rejected="dropped_carry"``: a sum that carries into a new
    leading digit gets the sloppy teacher's answer as the rejected one (the carry dropped, as
    :func:`write_arith_dataset`'s ``dropped_carry`` writes it), the others a near miss.
    """
    src = Path(source_dir)
    at_least("per_problem", per_problem, 1)
    if rejected not in ("near_miss", "dropped_carry"):
        raise ValueError(f"rejected must be 'near_miss' or 'dropped_carry', got {rejected!r}")
    source, meta = _source(src)
    want = {**source, "per_problem": per_problem, "seed": seed}
    if rejected != "near_miss":  # the key only when set: earlier pairs stay valid
        want["rejected"] = rejected
    rev = meta.get("answer_order") == "reversed"
    top = 10 ** int(meta.get("digits", 2))

    def wrong(answer: str, rng: random.Random) -> str:
        sloppy = _dropped_carry(answer, top, rev) if rejected == "dropped_carry" else None
        return sloppy if sloppy is not None else near_miss_text(answer, rng, reversed_order=rev)

    def rows(rec: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
        return [
            {
                "prompt": rec["prompt"],
                "chosen": rec["answer"],
                "rejected": wrong(rec["answer"], rng),
            }
            for _ in range(per_problem)
        ]

    return derive_splits(src, Path(out_dir), want, rows)
