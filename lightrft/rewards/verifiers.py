"""Rule-based rewards: math and GSM8K answer verifiers, exact match, a multiple-choice verifier,
and a think-then-answer format reward.

All of them look at the response only. A prompt may quote example answers or tags; scoring it
would reward the question instead of the model.

How the math verifiers find a response's answer (after dropping everything up to the last
``</think>``), in order:

1. **Size bound** (in the caller): a final part holding a number past
   :func:`~lightrft.rewards.math_answer.oversized_number`'s bound, or a reference holding one,
   is scored wrong at once; nothing reaches a worker.
2. **Fast path** (``MathVerifier``, in the caller, no sympy): a response whose only
   ``\\boxed{}`` holds a plainly spelled number, or that is nothing but one
   (:func:`~lightrft.rewards.math_answer.plain_number_answer`), against a plain-number reference:
   compared exactly as rationals. Here math-verify could extract nothing else.
3. **math-verify** (``MathVerifier``, in a worker process, within ``timeout``): every other
   response is handed over whole (its last :data:`MAX_RESPONSE_CHARS` characters) and
   math-verify's own ``parse`` extracts the answer (``\\boxed{}`` first, several boxes forming
   a set; then "the final answer is $...$", display and inline math, ``\\( \\)``; then plain
   expressions and numbers), and ``verify`` compares it with the parsed reference
   (:func:`~lightrft.rewards.math_answer.math_verify_reference`). An equation never equals a
   value (:func:`~lightrft.rewards.math_answer.is_equation`).
4. **Rules** (``GSM8KVerifier``, ``MathVerifier(symbolic=False)`` or with ``extractors``
   given): the first of ``extractors`` that finds an answer (``#### N``, the last
   ``\\boxed{}``, "the answer is N", the last number), then the rule comparison
   (and, for ``MathVerifier(extractors=...)``, math-verify on the two answer strings).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightrft.rewards.base import RewardInputError, Sample, prompt_preview
from lightrft.rewards.math_answer import (
    EXTRACTORS,
    answers_match,
    equation_mismatch,
    extract_answer,
    extract_boxed,
    is_equation,
    math_verify_reference,
    normalize_answer,
    oversized_number,
    parse_number,
    plain_number_answer,
)
from lightrft.rewards.math_equiv import Verdict

__all__ = ["ChoiceVerifier", "ExactMatch", "GSM8KVerifier", "MathVerifier", "ThinkFormatReward"]

log = logging.getLogger(__name__)

# An extracted answer longer than this is wrong without being read further: no real answer is,
# and the comparisons are linear in it (the symbolic stage stops at 1000 characters already).
MAX_ANSWER_CHARS = 10_000
# math-verify reads this many characters from the end of a response's final part (the answer is
# stated last; its regexes and parses take about 4 ms per 16,000 characters on the dev machine).
MAX_RESPONSE_CHARS = 20_000

Extraction = Literal["math_verify", "rules"]


def _final_part(response: str, strip_think: bool) -> str:
    """The text after the last ``</think>``, where a reasoning model states its answer."""
    if strip_think and "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    return response


def _references(who: str, samples: Sequence[Sample]) -> list[str]:
    """The samples' references; refuse a batch in which one is missing."""
    for i, s in enumerate(samples):
        if s.reference is None or (isinstance(s.reference, str) and not s.reference.strip()):
            raise RewardInputError(
                f"{who}: sample {i} (prompt {prompt_preview(s.prompt)}) has no reference answer"
            )
    return [str(s.reference) for s in samples]


class MathVerifier:
    """1.0 if the response's final answer equals the reference answer, else 0.0.

    **Extraction** (``extraction``; the order of the module docstring). ``"math_verify"`` (the
    default with ``symbolic=True`` and no ``extractors``): a response whose answer is one plainly
    spelled number (its only ``\\boxed{}``, or the whole response) is compared in the caller;
    every other response goes whole to math-verify, whose ``parse`` finds the answer (several
    boxes, display math, "The final answer is $14{,}916$", ``\\( \\)``, matrices, ``\\frac13``,
    ...) and whose ``verify`` compares it with the reference. ``"rules"`` (the default with
    ``symbolic=False`` or ``extractors`` given): the answer is taken by the first extractor in
    ``extractors`` that finds one: ``"boxed"`` (last ``\\boxed{...}``), ``"hashes"`` (GSM8K
    ``#### N``), ``"answer_is"`` ("the answer is N"), ``"last_number"``. The reference may be a
    bare answer (``"18"``, ``"\\frac{1}{2}"``) or a full solution ending in ``#### N`` or
    ``\\boxed{...}``, whose answer is extracted.

    :meth:`extract` (the answer majority votes count: TTRL, maj@k) follows the same path: the
    plain number of the fast path, else math-verify's extracted LaTeX string (``\\frac{1}{3}``
    for ``\\frac13``, ``1,2`` for ``\\boxed{1}, \\boxed{2}``), ``None`` if it finds none.

    Equivalence of two answer strings (:meth:`equivalent`, and the ``"rules"`` extraction) runs
    in two stages. First the built-in comparison
    (:func:`~lightrft.rewards.math_answer.answers_match`): exact rationals for plain numbers
    (``18 = 18.0 = $18``, ``3/4 = 0.75``, ``1,000 = 1000``) and normalised LaTeX strings; when
    both answers are plain numbers its verdict is final (the fast path: no sympy). Otherwise, with
    ``symbolic=True``, the pair goes to ``math-verify`` (intervals, sets, tuples, equations,
    ``\\text{}`` units, ``\\sqrt{8} = 2\\sqrt{2}``) in worker processes, each pair given at most
    ``timeout`` seconds (see :mod:`lightrft.rewards.math_equiv`); a pair that runs out is wrong.

    Hostile answers are refused before any comparison, scored ``incorrect`` with the reason in
    ``last_refusals`` (the first of each call is logged): an answer over
    :data:`MAX_ANSWER_CHARS` characters, or one holding a number past the size bound of
    :func:`~lightrft.rewards.math_answer.oversized_number` (``\\boxed{1e999999999}``). So the
    fast path runs in time linear in the answer, far inside ``timeout``. An equation whose left
    side is not a variable name (``100 = 7``) equals only an equation, never the value on its
    right (see :func:`~lightrft.rewards.math_answer.is_equation`); ``x = 7`` is the value 7.

    Args:
        correct: reward for a correct answer.
        incorrect: reward for a wrong or missing answer.
        extractors: extraction strategies, tried in order (``extraction="rules"`` only; giving
            them selects it).
        strip_think: look for the answer only after the last ``</think>`` if there is one.
        symbolic: use math-verify for answers that are not plain numbers.
        timeout: seconds a symbolic comparison (or math-verify's reading of a response) may take.
        workers: math-verify worker processes (started on first use).
        extraction: ``"math_verify"`` or ``"rules"`` (``None``: see above).
    """

    name = "math"
    requires_reference = True
    default_extractors: tuple[str, ...] = ("boxed", "hashes", "answer_is", "last_number")
    default_symbolic = True
    default_extraction: Extraction = "math_verify"

    def __init__(
        self,
        correct: float = 1.0,
        incorrect: float = 0.0,
        extractors: list[str] | None = None,
        strip_think: bool = True,
        symbolic: bool | None = None,
        timeout: float = 5.0,
        workers: int = 1,
        extraction: Extraction | None = None,
    ) -> None:
        self.extractors = tuple(extractors) if extractors is not None else self.default_extractors
        unknown = [e for e in self.extractors if e not in EXTRACTORS]
        if unknown or not self.extractors:
            raise ValueError(
                f"extractors must be a non-empty list from {sorted(EXTRACTORS)}, "
                f"got {list(self.extractors)}"
            )
        self.correct = float(correct)
        self.incorrect = float(incorrect)
        self.strip_think = strip_think
        self.symbolic = self.default_symbolic if symbolic is None else bool(symbolic)
        if extraction is None:  # the default of the class docstring, else a clear error
            extraction = (
                self.default_extraction if self.symbolic and extractors is None else "rules"
            )
        elif extraction not in ("math_verify", "rules"):
            raise ValueError(f"extraction must be 'math_verify' or 'rules', got {extraction!r}")
        elif extraction == "math_verify" and not self.symbolic:
            raise ValueError("extraction='math_verify' runs math-verify, so it needs symbolic=True")
        elif extraction == "math_verify" and extractors is not None:
            raise ValueError(
                "extractors are the rules of extraction='rules'; with extraction='math_verify' "
                "math-verify finds the answer: pass one or the other"
            )
        self.extraction: Extraction = extraction
        self.last_refusals: list[str] = []  # why answers of the last call were refused
        self._pool = None
        if self.symbolic:
            from lightrft.rewards.math_equiv import EquivalencePool

            self._pool = EquivalencePool(workers=workers, timeout=timeout)

    def extract(self, response: str) -> str | None:
        """The final answer the response commits to, or ``None`` (see the class docstring)."""
        return self.extract_many([response])[0]

    def extract_many(self, responses: Sequence[str]) -> list[str | None]:
        """:meth:`extract` of each response; the math-verify ones run on all workers."""
        if self.extraction == "rules":
            return [
                extract_answer(_final_part(r, self.strip_think), self.extractors) for r in responses
            ]
        return [v.answer for v in self._read(responses)]

    def _refused(self, *named: tuple[str, str], max_chars: int | None = None) -> bool:
        """Whether any of the ``(who, text)`` is longer than ``max_chars`` or holds a number past
        the size bound; the reason is kept in ``last_refusals`` (the first of a call is logged)."""
        for who, text in named:
            if max_chars is not None and len(text) > max_chars:
                why = f"{who} of {len(text)} characters (the bound is {max_chars})"
            elif number := oversized_number(text):
                why = f"{who} holds {number}"
            else:
                continue
            if not self.last_refusals:
                log.warning("%s: scored 0 without comparing: %s", type(self).__name__, why)
            self.last_refusals.append(why)
            return True
        return False

    def _fast(self, pred: str | None, ref: str) -> bool | None:
        """The verdict without sympy, or ``None`` if only the symbolic check can tell."""
        if pred is None:
            return False
        if self._refused(("answer", pred), ("reference", ref), max_chars=MAX_ANSWER_CHARS):
            return False
        if self.extraction == "math_verify":  # `AB = 4` is 4, as math-verify reads it
            mismatch = equation_mismatch(pred, ref)
        else:
            mismatch = is_equation(pred) != is_equation(ref)
        if mismatch:
            return False  # `100 = 7` is not 7, and 7 is not `100 = 7`
        if answers_match(pred, ref):
            return True
        if not self.symbolic:
            return False
        if parse_number(normalize_answer(pred)) and parse_number(normalize_answer(ref)):
            return False  # two plain numbers: the exact comparison is final
        return None

    def equivalent_many(self, preds: Sequence[str | None], refs: Sequence[str]) -> list[bool]:
        """:meth:`equivalent` of each pair; the symbolic ones run on all workers."""
        self.last_refusals = []
        verdicts = [self._fast(p, r) for p, r in zip(preds, refs, strict=True)]
        todo = [i for i, v in enumerate(verdicts) if v is None]
        if todo:
            slow = self._pool.equal_many([(preds[i], refs[i]) for i in todo])
            for i, ok in zip(todo, slow, strict=True):
                verdicts[i] = ok
        return verdicts

    def equivalent(self, pred: str | None, ref: str) -> bool:
        """Whether the extracted answer ``pred`` is equivalent to the reference answer ``ref``."""
        return self.equivalent_many([pred], [ref])[0]

    def close(self) -> None:
        """Stop the math-verify workers (they restart if the verifier is used again)."""
        if self._pool is not None:
            self._pool.close()

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        references = _references(type(self).__name__, samples)
        responses = [s.response for s in samples]
        if self.extraction == "math_verify":
            verdicts = [v.equal for v in self._read(responses, references)]
        else:
            # A reference's answer: the `#### N` or boxed answer of a solution, else itself.
            refs = [extract_answer(r, ("hashes", "boxed")) or r.strip() for r in references]
            verdicts = self.equivalent_many(self.extract_many(responses), refs)
        return [self.correct if ok else self.incorrect for ok in verdicts]

    def _read(
        self, responses: Sequence[str], references: Sequence[str] | None = None
    ) -> list[Verdict]:
        """math-verify's reading of each whole response (``extraction="math_verify"``): the
        answer it extracts and, with ``references``, whether it equals its reference. Refused
        past the size bound, the fast path for plain numbers, else a worker within ``timeout``."""
        self.last_refusals = []
        # What math-verify reads of a response: the tail of its final part.
        texts = [_final_part(r, self.strip_think)[-MAX_RESPONSE_CHARS:] for r in responses]
        refs = [None] * len(texts) if references is None else references
        verdicts = [self._fast_response(t, r) for t, r in zip(texts, refs, strict=True)]
        todo = [i for i, v in enumerate(verdicts) if v is None]
        # Against no reference (an empty gold) a worker only extracts the answer.
        golds = ["" if r is None else math_verify_reference(r) for r in refs]
        pairs = [(texts[i], golds[i]) for i in todo]
        for i, verdict in zip(todo, self._pool.judge_many(pairs), strict=True):
            verdicts[i] = verdict
        return verdicts

    def _fast_response(self, text: str, reference: str | None) -> Verdict | None:
        """The verdict without math-verify: unequal with no answer for a text or reference past
        the size bound (:meth:`_refused`), the response's answer when it is a plain number
        (:func:`~lightrft.rewards.math_answer.plain_number_answer`) and, given a reference that
        is one too, their comparison; else ``None``."""
        given = [("reference", reference)] if reference is not None else []
        if self._refused(("response", text), *given):
            return Verdict(False)
        pred = plain_number_answer(text)
        if reference is None:  # the answer only
            return None if pred is None else Verdict(False, pred)
        # The reference as math-verify gets it: a GSM8K `#### N` boxed, else the whole reference
        # (a solution with several boxes is a set, not its last box).
        ref = plain_number_answer(math_verify_reference(reference))
        if pred is None or ref is None:
            return None
        return Verdict(answers_match(pred, ref), pred)


class GSM8KVerifier(MathVerifier):
    """:class:`MathVerifier` that looks for the GSM8K ``#### N`` answer first.

    GSM8K references are solutions ending in ``#### N`` (or just ``N``); all answers are integers.
    Pass ``extractors=["hashes"]`` for the strict variant that requires the ``####`` format.
    Its extraction defaults to our rules (``extraction="rules"``), with or without ``symbolic``.
    """

    name = "gsm8k"
    default_extractors = ("hashes", "boxed", "answer_is", "last_number")
    default_symbolic = False  # integer answers: the exact comparison is complete
    default_extraction: Extraction = "rules"  # GSM8K's own `#### N` rules, unchanged


@dataclass(eq=False)
class _MatchVerifier:
    """``correct`` for a response that the subclass's ``matches`` accepts for its reference (the
    reference as a string), else ``incorrect``."""

    requires_reference = True
    correct: float = 1.0
    incorrect: float = 0.0

    def __post_init__(self) -> None:
        self.correct, self.incorrect = float(self.correct), float(self.incorrect)

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        references = _references(type(self).__name__, samples)
        return [
            self.correct if self.matches(s.response, ref) else self.incorrect
            for s, ref in zip(samples, references, strict=True)
        ]


@dataclass(eq=False)
class ExactMatch(_MatchVerifier):
    """``correct`` if the response equals the reference string, else ``incorrect``.

    For answers whose spelling is the answer: a choice letter, a label, digits in a fixed format
    (``"011"`` is not ``"11"``, which :class:`MathVerifier` would call equal as numbers).
    Surrounding whitespace is ignored on both sides, and with ``strip_think`` the response is
    read after its last ``</think>``; ``ignore_case`` compares case-folded strings.
    """

    name = "exact"
    ignore_case: bool = False
    strip_think: bool = True

    def _key(self, text: str) -> str:
        text = text.strip()
        return text.casefold() if self.ignore_case else text

    def matches(self, response: str, reference: str) -> bool:
        return self._key(_final_part(response, self.strip_think)) == self._key(reference)


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _choice_key(text: str) -> str:
    """A choice compared loosely: case folded, inner whitespace collapsed, surrounding quotes and
    a trailing period dropped (``" 'Dog.' "`` is ``"dog"``; ``"(B) dog"`` is not ``"dog"``)."""
    text = " ".join(text.split()).casefold()
    return text.strip(" \"'`").rstrip(".").strip()


@dataclass(eq=False)
class ChoiceVerifier(_MatchVerifier):
    """``correct`` if the response chooses the reference option, else ``incorrect``.

    For multiple-choice question answering (audio QA in the style of R1-AQA, Li et al. 2025,
    arXiv:2503.11197): the choice is the text of the response's last ``<answer>...</answer>``
    (``require_tag=False``: the whole final part when there is no tag), compared with the
    reference option text case-insensitively, ignoring surrounding whitespace and quotes and a
    trailing period. A response without the tag (when required) is ``incorrect``, so the tag
    format is part of the reward. With ``strip_think`` the response is read after its last
    ``</think>``.
    """

    name = "choice"
    require_tag: bool = True
    strip_think: bool = True

    def choice(self, response: str) -> str | None:
        """The option a response chose (None: no ``<answer>`` tag where one is required)."""
        final = _final_part(response, self.strip_think)
        tags = _ANSWER_TAG.findall(final)
        if tags:
            return tags[-1]
        return None if self.require_tag else final

    def matches(self, response: str, reference: str) -> bool:
        chosen = self.choice(response)
        return chosen is not None and _choice_key(chosen) == _choice_key(reference)


@dataclass(eq=False)
class ThinkFormatReward:
    """``reward`` if the response is ``<think>reasoning</think> answer``, else ``penalty``.

    The response must open with the think tag (after whitespace), contain exactly one opening and
    one closing tag, and have non-blank reasoning and a non-blank answer after it. ``answer``
    adds a requirement on the answer part: ``"boxed"`` a complete ``\\boxed{...}``, ``"tag"`` the
    whole answer wrapped as ``<answer>...</answer>``. Trailing whitespace is allowed; other text
    after the answer is not.

    Args:
        tag: the reasoning tag's name (``think`` -> ``<think>``/``</think>``).
        answer: ``"any"``, ``"boxed"`` or ``"tag"``.
        open_tag_in_prompt: the chat template's generation prompt already ends with ``<think>``
            (DeepSeek-R1 style), so the response starts inside the reasoning. The prompt is still
            not read: the opening tag is assumed.
        reward: reward of a well-formed response.
        penalty: reward of any other response.
    """

    name = "format"
    tag: str = "think"
    answer: Literal["any", "boxed", "tag"] = "any"
    open_tag_in_prompt: bool = False
    reward: float = 1.0
    penalty: float = 0.0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"tag must be a tag name such as 'think', got {self.tag!r}")
        if self.answer not in ("any", "boxed", "tag"):
            raise ValueError(f"answer must be 'any', 'boxed' or 'tag', got {self.answer!r}")
        self.open, self.close = f"<{self.tag}>", f"</{self.tag}>"
        self.reward, self.penalty = float(self.reward), float(self.penalty)

    def is_well_formed(self, response: str) -> bool:
        text = self.open + response if self.open_tag_in_prompt else response.lstrip()
        if not text.startswith(self.open):
            return False
        if text.count(self.open) != 1 or text.count(self.close) != 1:
            return False
        thought, _, final = text[len(self.open) :].partition(self.close)
        final = final.strip()
        if not thought.strip() or not final:
            return False
        if self.answer == "boxed":
            return extract_boxed(final) is not None
        if self.answer == "tag":
            m = re.fullmatch(r"<answer>(.*)</answer>", final, re.DOTALL)
            return m is not None and bool(m.group(1).strip()) and "<answer>" not in m.group(1)
        return True

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.reward if self.is_well_formed(s.response) else self.penalty for s in samples]
