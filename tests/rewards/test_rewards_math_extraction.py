"""MathVerifier finds the answer with math-verify's own extraction (issue 28): whole responses
in the forms our rules used to lose, the plain-number fast path, the answers majority votes
count, and the guards (size bound, equation rule) that still hold on this path."""

import subprocess
import sys
from pathlib import Path

import pytest

from lightrft.rewards import GSM8KVerifier, MathVerifier, Sample, TTRLReward
from lightrft.rewards.math_answer import majority_vote


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout=5.0)
    yield v
    v.close()


def _score(v, responses, references):
    n = len(responses)
    return v(Sample.batch(["q"] * n, responses, references=references, labels=[None] * n))


# (response, reference, reward): one or two of each form the rules lost, and near misses.
CASES = [
    # display math
    ("The sum is\n$$\n\\frac{7}{2}\n$$", "3.5", 1.0),
    ("so \\[ 2\\sqrt{3} \\]", "\\sqrt{12}", 1.0),
    ("The sum is\n$$\n\\frac{7}{3}\n$$", "3.5", 0.0),
    # several boxes form the set / tuple the reference names
    ("The roots are \\boxed{-2} and \\boxed{1}.", "-2, 1", 1.0),
    ("The roots are \\boxed{1} and \\boxed{-2}.", "\\{-2, 1\\}", 1.0),
    ("So $x = \\boxed{3}$ and $y = \\boxed{4}$.", "(3, 4)", 1.0),
    ("The roots are \\boxed{-2} and \\boxed{3}.", "-2, 1", 0.0),
    ("So $x = \\boxed{4}$ and $y = \\boxed{3}$.", "(3, 4)", 0.0),
    # "The final answer is $...$" with a LaTeX thousands separator
    ("Final Answer: The final answer is $14{,}916$. I hope it is correct.", "14916", 1.0),
    ("Final Answer: The final answer is $14{,}916$. I hope it is correct.", "14915", 0.0),
    # \( ... \) without a box
    ("So the probability is \\(\\frac{3}{8}\\).", "\\frac{3}{8}", 1.0),
    ("So the probability is \\(\\frac{3}{8}\\).", "\\frac{3}{7}", 0.0),
    # text answers
    ("\\boxed{\\text{E}}", "E", 1.0),
    ("The answer is $\\text{E}$.", "\\text{E}", 1.0),
    ("\\boxed{\\text{D}}", "E", 0.0),
    # matrices
    (
        "$\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}$",
        "\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}",
        1.0,
    ),
    (
        "So $M = \\left[\\begin{array}{cc} 1 & 2 \\\\ 3 & 4 \\end{array}\\right]$.",
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        1.0,
    ),
    (
        "$\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}$",
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        0.0,
    ),
    # inequalities against intervals, both ways
    ("so $x \\in [2, 5)$", "2 \\le x < 5", 1.0),
    ("\\boxed{-2 \\le x \\le 7}", "[-2, 7]", 1.0),
    ("\\boxed{x > 3}", "(3, \\infty)", 1.0),
    ("\\boxed{x \\ge 3}", "(3, \\infty)", 0.0),
    # thousands separated by a space, a decimal comma
    ("The answer is 1 000.", "1000", 1.0),
    ("The answer is 3,5", "3.5", 1.0),
    ("The answer is 3,5", "35", 0.0),
    # malformed LaTeX a model writes
    ("so $p = \\frac13$", "1/3", 1.0),
    ("\\boxed{2\\sqrt3}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\cfrac{1}{3}}", "\\frac{1}{3}", 1.0),
    ("\\boxed{\\cfrac{1}{4}}", "\\frac{1}{3}", 0.0),
    # the equation rule still decides: a constant equation is not its right side
    ("\\boxed{100 = 7}", "7", 0.0),
    ("\\boxed{7}", "100 = 7", 0.0),
    ("So $AB = 4$.", "4", 1.0),  # a labelled value, as math-verify reads it
    # a reference is read like a response: its several boxes are one set, not its last box
    ("\\boxed{-2}", "The roots are \\boxed{1} and \\boxed{-2}.", 0.0),
    ("\\boxed{-2, 1}", "The roots are \\boxed{1} and \\boxed{-2}.", 1.0),
    # nothing to extract
    ("I am not sure.", "18", 0.0),
]


def test_forms_the_rules_lost_are_scored_by_math_verify(verifier):
    rewards = _score(verifier, [c[0] for c in CASES], [c[1] for c in CASES])
    wrong = [
        (r, ref, want) for (r, ref, want), got in zip(CASES, rewards, strict=True) if got != want
    ]
    assert wrong == []
    # Each of them went through a worker: none is one plainly spelled number on both sides.
    assert verifier._pool.stats["calls"] >= len(CASES) - 1


def test_plain_numbers_take_the_fast_path_without_a_worker():
    v = MathVerifier()
    responses = ["so \\boxed{42}.", "42", "\\boxed{1,000}", "\\boxed{\\frac{3}{4}}", "\\boxed{41}"]
    references = ["42", "#### 42", "1000", "0.75", "42"]
    assert _score(v, responses, references) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert v.extract_many(responses) == ["42", "42", "1,000", "\\frac{3}{4}", "41"]
    assert v._pool._live == set() and v._pool.stats["calls"] == 0  # no worker was started


def test_extract_gives_the_answer_majority_votes_count(verifier):
    answers = verifier.extract_many(
        [
            "Final Answer: The final answer is $14{,}916$.",
            "\\boxed{14916}",
            "The roots are \\boxed{1} and \\boxed{2}.",
            "I am not sure.",
        ]
    )
    assert answers == ["14,916", "14916", "1,2", None]
    assert majority_vote(answers) == ("14,916", 2)  # one key for both spellings
    assert verifier.extract("so $p = \\frac13$") == "p = \\frac{1}{3}"


def test_ttrl_agreement_on_math_verify_answers(verifier):
    reward = TTRLReward(verifier)
    responses = [
        "Final Answer: The final answer is $14{,}916$.",
        "\\boxed{14916}",
        "\\boxed{7}",
    ]
    out = reward(Sample.batch(["p"] * 3, responses, references=None, labels=None))
    assert out == [1.0, 1.0, 0.0]


def test_a_hostile_number_anywhere_is_refused_before_any_worker():
    v = MathVerifier(timeout=1.0)
    responses = ["First 1e999999999, then \\boxed{7} and \\boxed{8}", "$$ 7 $$"]
    assert _score(v, responses, ["7, 8", "1" + "0" * 2000]) == [0.0, 0.0]
    assert v.last_refusals[0].startswith("response holds an exponent")
    assert v.last_refusals[1].startswith("reference holds a number of 2001 digits")
    assert v.extract_many(responses[:1]) == [None]
    assert v._pool.stats["calls"] == 0


def test_a_long_response_is_read_from_its_end(verifier):
    filler = "We keep checking the cases one by one. " * 1000  # ~39,000 characters
    assert _score(verifier, [filler + "So $$\\frac{1}{2}$$"], ["0.5"]) == [1.0]


def test_gsm8k_keeps_its_rules():
    v = GSM8KVerifier()
    assert v.extraction == "rules" and v._pool is None
    two_boxes = "The roots are \\boxed{1} and \\boxed{2}."
    assert _score(v, [two_boxes, "#### 5\nor maybe 6"], ["2", "5"]) == [1.0, 1.0]  # last box
    assert v.extract(two_boxes) == "2"


def test_extraction_is_chosen_clearly():
    assert MathVerifier(symbolic=False).extraction == "rules"
    assert MathVerifier(extractors=["boxed"]).extraction == "rules"
    assert MathVerifier().extraction == "math_verify"
    with pytest.raises(ValueError, match="needs symbolic=True"):
        MathVerifier(symbolic=False, extraction="math_verify")
    with pytest.raises(ValueError, match="pass one or the other"):
        MathVerifier(extractors=["boxed"], extraction="math_verify")
    with pytest.raises(ValueError, match="'math_verify' or 'rules'"):
        MathVerifier(extraction="sympy")


def test_the_caller_never_imports_math_verify_or_sympy():
    code = (
        "import sys\n"
        "from lightrft.rewards import MathVerifier, Sample\n"
        "v = MathVerifier(timeout=5.0)\n"
        "scores = v(Sample.batch(['q'] * 2, [r'so $$\\frac{1}{2}$$', r'\\boxed{1} and \\boxed{2}'],"
        " ['0.5', r'\\{1,2\\}']))\n"
        "answers = v.extract_many([r'\\(\\frac13\\)'])\n"
        "v.close()\n"
        "print(scores, answers, 'math_verify' in sys.modules, 'sympy' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[2],  # the repository root, so `lightrft` imports from here
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.split("\n")[-2] == "[1.0, 1.0] ['\\\\frac{1}{3}'] False False"


FAST = [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{42}", "43"),
    ("42", "#### 42"),
    (r"\boxed{-5}", "5"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{12,345,678}", "12345678"),
    (r"\boxed{1,234}", "1235"),
    (r"\boxed{\frac{3}{4}}", "0.75"),
    (r"\boxed{\dfrac{6}{8}}", "3/4"),
    (r"\boxed{2/4}", r"\frac{1}{2}"),
    (r"\boxed{100.0}", "100"),
    (r"\boxed{0.3333333}", "1/3"),
    (r"\boxed{0.33}", "1/3"),
    (r"\boxed{3.14159}", "3.1416"),
    ("011", "11"),
    (r"The answer: \boxed{7}", "Half of 14.\n#### 7"),
]


@pytest.mark.parametrize("response, reference", FAST)
def test_the_fast_path_agrees_with_math_verify(verifier, response, reference):
    from lightrft.rewards.math_answer import math_verify_reference

    fast = verifier._fast_response(response, reference)
    assert fast is not None  # these are the fast path's
    assert fast.equal == verifier._pool.judge(response, math_verify_reference(reference)).equal
