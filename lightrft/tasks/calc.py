"""Multiplication with a calculator: the tool-use CPU demo's task (configs/tiny/tool_*.yaml).

Problems ``"623*514="``: two ``digits``-digit factors whose product has ``2 * digits`` digits.
A tiny model cannot multiply them in its head, but it can copy the expression into a ``calculator``
call and copy the result back. :func:`write_calc_dataset` writes

- ``sft.jsonl``: tool-use transcripts for :class:`~lightrft.environments.ToolSFTDataset`. A
  share ``tool_share`` calls the calculator and answers with its result; of those, a share
  ``recover_share`` first makes a failed call (an expression the calculator refuses: the
  prompt's ``=`` copied, or ``x`` for ``*``), reads the error and calls again; the rest answer
  at once with an estimate (each factor rounded to one significant digit: ``25*762=`` ->
  ``24000``), mostly wrong. A teacher who wrote the exact products there would give the model
  an answer it cannot learn in its head, whose noise drowns, at this size and budget, the
  lesson of the tool transcripts: copy the calculator's result (measured: SFT models that
  call the tool and then answer a product of their own). The observations are what :class:`~lightrft.environments.ToolEnvironment`
  with :func:`~lightrft.environments.calculator_tool` answers, played here.
- ``train.jsonl`` / ``test.jsonl``: prompts (``prompt``, ``answer``, ``label``) for GRPO and
  the held-out evaluation, no problem in two files.

An SFT model that calls the tool about as rarely as its transcripts do answers most held-out
problems from its head (greedy), so RL with the calculator environment has something to find:
that calling it pays.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from lightrft.config import at_least
from lightrft.tasks.made import ensure_made, write_made

TOOLS = ["calculator"]
# The failed first calls of the recovering transcripts: the prompt's "=" copied into the
# expression, or "x" written for "*". The calculator refuses both (a tool_exception). Calls that
# do not parse or do not fit the schema cannot be in SFT data: ToolSFTDataset refuses them, so
# that SFT never teaches a malformed call.
FAILURES = ("equals_sign", "x_for_times")


def calc_call(expression: str) -> str:
    """The assistant text of one calculator call of ``expression``."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def calc_problems(
    n: int,
    *,
    digits: int = 3,
    seed: int = 0,
    exclude: set[str] | None = None,
) -> list[tuple[str, int, int]]:
    """``n`` distinct ``(prompt, a, b)`` with ``prompt == f"{a}*{b}="`` (none in ``exclude``),
    deterministic for the arguments: both factors have ``digits`` digits and the product
    ``2 * digits`` (``623*514=``), so every prompt, call and answer has the same length."""
    at_least("digits", digits, 2)
    at_least("n", n, 0)
    lo, hi, floor = 10 ** (digits - 1), 10**digits - 1, 10 ** (2 * digits - 1)
    space = sum(hi - max(lo, -(-floor // a)) + 1 for a in range(lo, hi + 1))
    exclude = exclude or set()
    if n + len(exclude) > space // 2:
        raise ValueError(
            f"asked for {n} distinct problems (plus {len(exclude)} excluded) but digits={digits} "
            f"allows only {space}: ask for fewer or raise digits"
        )
    rng = random.Random(seed)
    seen = set(exclude)
    out = []
    while len(out) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        prompt = f"{a}*{b}="
        if a * b < floor or prompt in seen:
            continue
        seen.add(prompt)
        out.append((prompt, a, b))
    return out


def estimate(a: int, b: int) -> int:
    """The direct answers' teacher, who multiplies in its head by rounding each factor to one
    significant digit (half up): ``estimate(25, 762) == 30 * 800 == 24000``. Exact only when
    rounding changes nothing (``20*300``), and simple enough for a tiny model to learn."""

    def one_digit(x: int) -> int:  # a one-digit x is its own rounding (unit 1)
        unit = 10 ** (len(str(x)) - 1)
        return (x + unit // 2) // unit * unit

    return one_digit(a) * one_digit(b)


def calc_transcript(prompt: str, a: int, b: int, *, mode: str) -> dict[str, Any]:
    """One SFT record (``{"tools": ["calculator"], "messages": [...]}``) for ``a*b``.

    ``mode``: ``"direct"`` (the teacher's :func:`estimate` at once), ``"tool"`` (one call, then its result) or one
    of :data:`FAILURES` (that failed call, its error, the right call, the result). Observations
    are played by a calculator :class:`~lightrft.environments.ToolEnvironment`.
    """
    from lightrft.environments import ToolEnvironment, calculator_tool

    expression = f"{a}*{b}"
    turns = [] if mode == "direct" else [calc_call(expression)]
    if mode in FAILURES:
        failed = expression + "=" if mode == "equals_sign" else expression.replace("*", "x")
        turns.insert(0, calc_call(failed))
    env = ToolEnvironment([calculator_tool()], max_turns=len(turns) + 1)
    messages = list(env.reset({"prompt": prompt}))
    for text in turns:
        step = env.step(text)
        assert not step.done and step.observation, (mode, step)
        messages += [{"role": "assistant", "content": text}, *step.observation]
    if mode in FAILURES:
        assert sum(env.stats.errors.values()) == 1, (mode, env.stats.errors)
    answer = str(estimate(a, b) if mode == "direct" else a * b)
    if mode != "direct":
        assert messages[-1]["content"] == answer, messages[-1]
    messages.append({"role": "assistant", "content": answer})
    return {"tools": TOOLS, "messages": messages}


def write_calc_dataset(
    out_dir: str | os.PathLike,
    *,
    n_sft: int = 2000,
    n_train: int = 2000,
    n_test: int = 200,
    digits: int = 3,
    tool_share: float = 0.25,
    recover_share: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write ``sft.jsonl``, ``train.jsonl``, ``test.jsonl`` (disjoint problems) and ``meta.json``
    (see the module docstring). Of the ``n_sft`` transcripts, ``round(tool_share * n_sft)`` call
    the calculator, and ``round(recover_share * that)`` of those recover from a failed call
    (the failure kinds in turn)."""
    settings = {k: v for k, v in locals().items() if k != "out_dir"}  # what meta.json records
    for key, share in (("tool_share", tool_share), ("recover_share", recover_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{key} must be in [0, 1], got {share}")
    test = calc_problems(n_test, digits=digits, seed=seed + 1)
    seen = {p for p, _, _ in test}
    train = calc_problems(n_train, digits=digits, seed=seed + 2, exclude=seen)
    seen |= {p for p, _, _ in train}
    sft = calc_problems(n_sft, digits=digits, seed=seed, exclude=seen)
    n_tool = round(tool_share * n_sft)
    n_recover = round(recover_share * n_tool)
    modes = (
        [FAILURES[i % len(FAILURES)] for i in range(n_recover)]
        + ["tool"] * (n_tool - n_recover)
        + ["direct"] * (n_sft - n_tool)
    )
    random.Random(~seed).shuffle(modes)
    splits = [
        ("sft", [calc_transcript(p, a, b, mode=m) for (p, a, b), m in zip(sft, modes, strict=True)])
    ]
    for name, problems in (("train", train), ("test", test)):
        rows = [{"prompt": p, "answer": str(a * b), "label": "calc"} for p, a, b in problems]
        splits.append((name, rows))
    return write_made(Path(out_dir), splits, settings)


def ensure_calc_dataset(out_dir: str | os.PathLike, **settings: Any) -> Path:
    """:func:`write_calc_dataset` unless ``out_dir`` already holds it with these settings."""
    return ensure_made(
        write_calc_dataset, out_dir, ("sft.jsonl", "train.jsonl", "test.jsonl"), settings
    )
