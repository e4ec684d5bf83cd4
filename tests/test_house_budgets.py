"""Issue 42's standing budgets for the recipe a user copies, read from the code
(``tests/benchmarks/house_size.py`` prints them with the house's line counts)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
from house_size import GRPO_MAX_LINES, GRPO_MAX_METHODS, grpo_budgets, house, line_kinds  # noqa: E402


def test_line_kinds_tell_docstrings_comments_and_blanks_from_code():
    source = (
        '"""Module."""\n\n# a comment\ndef f():\n    """Two\n    lines."""\n    return 1  # code\n'
    )
    assert line_kinds(source) == ["doc", "blank", "comment", "code", "doc", "doc", "code"]


def test_the_grpo_recipe_keeps_its_budgets():
    g = grpo_budgets()
    assert g["lines"] <= GRPO_MAX_LINES, f"recipes/grpo.py has {g['lines']} lines"
    assert g["methods"] <= GRPO_MAX_METHODS, f"GRPORecipe has {g['methods']} methods"
    assert g["asynchronous"] == 0, "a code line of recipes/grpo.py names asynchronous"


def test_the_count_is_the_files_lines():
    root = Path(__file__).parents[1]
    files = [p for d in ("lightrft", "recipes", "kernels") for p in (root / d).rglob("*.py")]
    assert sum(c.total() for c in house().values()) == sum(
        len(p.read_text().splitlines()) for p in files
    )
