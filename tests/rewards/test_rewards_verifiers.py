"""Math / GSM8K verifiers (including every GSM8K reference solution), exact match and the format
reward."""

import json
import re
import time
from pathlib import Path

import pytest

from lightrft.rewards import ExactMatch, GSM8KVerifier, MathVerifier, Sample, ThinkFormatReward

GSM8K_DIR = Path("/work/shared/data/gsm8k")


def _score(verifier, responses, references, prompts=None):
    prompts = prompts or ["q"] * len(responses)
    return verifier(
        Sample.batch(prompts, responses, references=references, labels=[None] * len(responses))
    )


def test_math_verifier_cases():
    v = MathVerifier()
    responses = [
        r"We add them: $1+2=3$. Therefore \boxed{3}.",
        r"\boxed{\dfrac{1}{2}}",
        "The answer is 0.75.",
        "<think>maybe 7? or \\boxed{7}</think> The answer is 8",
        "so it costs $1,200 in total",
        "I don't know",
        r"\boxed{4}",
    ]
    references = ["3", r"\frac12", "3/4", "8", "1200", "5", "#### 5"]
    assert _score(v, responses, references) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_verifier_think_is_skipped_only_when_asked():
    response = r"<think>\boxed{7}</think> so 8"
    assert _score(MathVerifier(), [response], ["8"]) == [1.0]
    assert _score(MathVerifier(strip_think=False), [response], ["7"]) == [1.0]


def test_verifier_rewards_and_extractors_are_configurable():
    v = MathVerifier(correct=2.0, incorrect=-1.0, extractors=["boxed"])
    assert _score(v, [r"\boxed{2}", "the answer is 2"], ["2", "2"]) == [2.0, -1.0]
    with pytest.raises(ValueError, match="extractors"):
        MathVerifier(extractors=["box"])


def test_gsm8k_verifier_prefers_hashes_and_strict_mode():
    response = "Half of 8 is 4, and \\boxed{4} was a guess.\n#### 5"
    assert _score(GSM8KVerifier(), [response], ["5"]) == [1.0]
    assert _score(MathVerifier(), [response], ["5"]) == [0.0]  # the box comes first there
    strict = GSM8KVerifier(extractors=["hashes"])
    assert _score(strict, ["so the answer is 5", "#### 5"], ["5", "5"]) == [0.0, 1.0]


def test_missing_reference_names_the_sample():
    v = MathVerifier()
    prompts = ["What is 2+2?", "Janet's ducks lay 16 eggs per day. How many are left?"]
    with pytest.raises(
        ValueError, match=r"sample 1 \(prompt .Janet's ducks lay 16 eggs.*no reference"
    ):
        v(Sample.batch(prompts, ["4", "9"], references=["4", None], labels=[None, None]))
    with pytest.raises(ValueError, match="sample 0"):
        v(Sample.batch(prompts[:1], ["4"], references=["  "], labels=[None]))


def test_exact_match_compares_spellings_not_values():
    refs = ["011", "641", "B", "011"]
    assert _score(ExactMatch(), [" 011\n", "641", "b", "11"], refs) == [1.0, 1.0, 0.0, 0.0]
    assert _score(MathVerifier(), ["11"], ["011"]) == [1.0]  # why ExactMatch exists
    v = ExactMatch(correct=2.0, incorrect=-1.0, ignore_case=True)
    assert _score(v, ["b", "<think>A?</think> B", "A"], ["B", "B", "B"]) == [2.0, 2.0, -1.0]
    assert _score(ExactMatch(strip_think=False), ["<think>x</think>B"], ["B"]) == [0.0]
    with pytest.raises(ValueError, match=r"ExactMatch: sample 1 \(prompt .two.*no reference"):
        ExactMatch()(
            Sample.batch(["one", "two"], ["a", "b"], references=["a", ""], labels=[None] * 2)
        )


def test_verifier_ignores_the_prompt():
    # The prompt holds the right answer in every form the extractors know; the response none.
    prompt = r"Example: \boxed{18}. #### 18. The answer is 18."
    assert _score(MathVerifier(), ["I am not sure."], ["18"], prompts=[prompt]) == [0.0]


def _gsm8k_rows():
    rows = []
    for split in ("train", "test"):
        path = GSM8K_DIR / f"{split}.jsonl"
        if path.is_file():
            with open(path) as f:
                rows += [json.loads(line) for line in f]
    return rows


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason="GSM8K files not present")
def test_gsm8k_every_reference_verifies_and_perturbed_fails():
    rows = _gsm8k_rows()
    assert len(rows) > 8000
    solutions = [r["answer"] for r in rows]
    questions = [r["question"] for r in rows]
    finals = [s.rsplit("####", 1)[1].strip() for s in solutions]
    # The answer with its final number moved by one: the same solution text, a wrong answer.
    perturbed = [
        s.rsplit("####", 1)[0] + "#### " + str(int(f.replace(",", "")) + 1)
        for s, f in zip(solutions, finals, strict=True)
    ]
    v = GSM8KVerifier()
    start = time.perf_counter()
    as_solution = v(Sample.batch(questions, solutions, solutions))
    as_number = v(Sample.batch(questions, solutions, finals))
    wrong = v(Sample.batch(questions, perturbed, solutions))
    elapsed = time.perf_counter() - start
    bad = [i for i, r in enumerate(as_solution) if r != 1.0]
    assert not bad, f"{len(bad)} reference solutions fail, first: {solutions[bad[0]][-80:]!r}"
    assert all(r == 1.0 for r in as_number)
    assert all(r == 0.0 for r in wrong)
    assert any("," in f for f in finals) and any(f.startswith("-") for f in finals)
    assert elapsed < 10, f"{3 * len(rows)} verifications took {elapsed:.1f}s"


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason="GSM8K files not present")
def test_gsm8k_free_form_answer_styles():
    row = _gsm8k_rows()[0]
    final = row["answer"].rsplit("####", 1)[1].strip()
    v = GSM8KVerifier()
    styles = [
        f"#### {final}",
        f"\\boxed{{{final}}}",
        f"The answer is ${final}.",
        f"She earns {final} dollars a day",
        f"{final}.00",
    ]
    assert _score(v, styles, [row["answer"]] * len(styles)) == [1.0] * len(styles)


FORMAT_CASES = [
    ("<think>add 2 and 2</think> 4", 1.0),
    ("  <think>\nreasoning\n</think>\n\nThe answer is 4\n", 1.0),
    ("4", 0.0),
    ("<think>reasoning</think>", 0.0),  # no answer
    ("<think> </think> 4", 0.0),  # no reasoning
    ("<think>a</think> 4 <think>b</think> 5", 0.0),  # two thoughts
    ("<think>a <think> b</think> 4", 0.0),
    ("intro <think>a</think> 4", 0.0),  # text before the thought
    ("<think>a 4", 0.0),  # never closed
]


@pytest.mark.parametrize("response, expected", FORMAT_CASES)
def test_think_format(response, expected):
    assert ThinkFormatReward()(Sample.batch(["q"], [response])) == [expected]


def test_think_format_is_computed_on_the_response_only():
    fmt = ThinkFormatReward()
    # The prompt is well formed, the response is not: 0. And the other way round: 1.
    assert fmt(Sample.batch(["<think>plan</think> 3"], ["3"])) == [0.0]
    assert fmt(Sample.batch(["no tags"], ["<think>plan</think> 3"])) == [1.0]


def test_think_format_answer_requirements_and_options():
    boxed = ThinkFormatReward(answer="boxed", reward=0.5, penalty=-0.5)
    assert boxed(
        Sample.batch(["q"] * 2, [r"<think>a</think> \boxed{3}", "<think>a</think> 3"])
    ) == [0.5, -0.5]
    tag = ThinkFormatReward(answer="tag")
    responses = [
        "<think>a</think><answer>3</answer>",
        "<think>a</think><answer>3</answer> x",
        "<think>a</think><answer> </answer>",
        "<think>a</think> 3",
    ]
    assert tag(Sample.batch(["q"] * 4, responses)) == [1.0, 0.0, 0.0, 0.0]
    r1 = ThinkFormatReward(open_tag_in_prompt=True)
    assert r1(Sample.batch(["q"] * 2, ["plan</think> 3", "<think>plan</think> 3"])) == [1.0, 0.0]
    custom = ThinkFormatReward(tag="reasoning")
    assert custom(Sample.batch(["q"], ["<reasoning>x</reasoning> 1"])) == [1.0]
    with pytest.raises(ValueError, match="tag"):
        ThinkFormatReward(tag="<think>")
    with pytest.raises(ValueError, match="answer"):
        ThinkFormatReward(answer="box")


def test_hashes_in_gsm8k_solutions_are_single():
    # The GSM8K check above relies on each solution having exactly one `####` line.
    rows = _gsm8k_rows()[:200]
    assert all(len(re.findall(r"^#### ", r["answer"], re.M)) == 1 for r in rows)
