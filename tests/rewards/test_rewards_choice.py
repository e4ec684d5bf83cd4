"""The multiple-choice verifier (audio QA in the style of R1-AQA)."""

import pytest

from lightrft.rewards import ChoiceVerifier, Sample


def _score(verifier, responses, references):
    n = len(responses)
    return verifier(Sample.batch(["q"] * n, responses, references=references, labels=[None] * n))


def test_choice_verifier_reads_the_last_answer_tag():
    refs = ["Dog barking"] * 7
    responses = [
        "<answer>Dog barking</answer>",
        "It is <answer> dog  BARKING. </answer>",  # case, spaces and a final period ignored
        "<answer>Cat</answer> no wait <answer>'Dog barking'</answer>",  # the last tag counts
        "Dog barking",  # no tag: the format is part of the reward
        "<answer>Dog</answer>",
        "<think><answer>Dog barking</answer></think><answer>Cat</answer>",  # after </think>
        "<answer>(A) Dog barking</answer>",  # a letter prefix is another answer
    ]
    assert _score(ChoiceVerifier(), responses, refs) == [1, 1, 1, 0, 0, 0, 0]
    loose = ChoiceVerifier(require_tag=False, correct=2.0, incorrect=-1.0)
    assert _score(loose, ["Dog barking.", "<answer>Cat</answer>"], refs[:2]) == [2.0, -1.0]
    assert ChoiceVerifier().choice("nothing") is None


def test_choice_verifier_needs_references():
    with pytest.raises(ValueError, match="ChoiceVerifier: sample 0 .* has no reference answer"):
        _score(ChoiceVerifier(), ["<answer>a</answer>"], [None])
