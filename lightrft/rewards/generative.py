"""Generative reward models: a judge LM reads the response and writes a verdict we parse.

Two verdict kinds (``mode``):

- ``"score"``: the judge writes a number; ``pattern``'s first group of its last match is the
  reward (times ``scale``). Template fields: ``{prompt}``, ``{response}``, ``{reference}``.
- ``"choice"``: the judge compares the response with the sample's reference response and names
  the better one (``choices``, default ``A`` / ``B``); the reward is 1 when the response wins, 0
  when it loses. Template fields: ``{prompt}``, ``{response_a}``, ``{response_b}``. With
  ``both_orders`` each pair is judged twice, the response first and then second, and the two
  rewards are averaged, which cancels a judge's position bias (a judge that always says "A" gives
  every response 0.5).

The judge runs in-process through :class:`lightrft.engine.NativeEngine` (``judge``: a local HF
directory) or remotely (``url``: an OpenAI-compatible ``/v1/completions`` endpoint, e.g.
``vllm serve``). Greedy decoding by default.

A verdict that does not match ``pattern`` (or names no known choice) is a parse failure: it gets
the configured ``fallback`` reward (there is no default: a silent 0 would read as a verdict), is
counted in ``last_metrics["parse_failures"]`` (logged by :class:`~lightrft.rewards.CombinedReward`
as ``reward/<name>/parse_failures``) and in the running total ``parse_failures``.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.request
from collections.abc import Sequence
from typing import Literal

import torch

from lightrft.rewards.base import Prompt

__all__ = ["CHOICE_TEMPLATE", "SCORE_TEMPLATE", "GenerativeReward", "parse_verdict"]

log = logging.getLogger(__name__)

SCORE_TEMPLATE = (
    "Rate the response to the question from 0 to 10.\n"
    "Question: {prompt}\nResponse: {response}\nScore:"
)
CHOICE_TEMPLATE = (
    "Which response answers the question better? Answer A or B.\n"
    "Question: {prompt}\nA: {response_a}\nB: {response_b}\nBetter:"
)


def parse_verdict(text: str, pattern: re.Pattern[str]) -> str | None:
    """The first group (or whole match) of ``pattern``'s last match in ``text``; ``None`` if
    none."""
    last = None
    for m in pattern.finditer(text):
        last = m
    if last is None:
        return None
    return last.group(1) if last.groups() else last.group(0)


def _prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


class GenerativeReward:
    """A judge model as a reward function (see the module docstring).

    Args:
        fallback: reward of a sample whose verdict cannot be parsed (required).
        judge: local HF directory of the judge (run by the native engine); or
        url: an OpenAI-compatible completions endpoint (``http://host:port/v1/completions``).
        model_name: the ``model`` field sent to ``url``.
        mode: ``"score"`` or ``"choice"``.
        template: the judge prompt; default :data:`SCORE_TEMPLATE` / :data:`CHOICE_TEMPLATE`.
        pattern: regex of the verdict; default a number (score) or ``\\b(A|B)\\b`` (choice).
        choices: the names of the first and second response in a choice verdict.
        both_orders: choice mode: judge both presentation orders and average.
        scale: score mode: reward = ``scale * score``.
        chat_template: local judge: wrap the prompt as a user turn with the judge's template.
        max_tokens, temperature: decoding of the verdict.
        device, dtype: local judge placement.
        timeout: seconds per HTTP request.
    """

    name = "judge"

    def __init__(
        self,
        *,
        fallback: float,
        judge: str | None = None,
        url: str | None = None,
        model_name: str = "judge",
        mode: Literal["score", "choice"] = "score",
        template: str | None = None,
        pattern: str | None = None,
        choices: Sequence[str] = ("A", "B"),
        both_orders: bool = False,
        scale: float = 1.0,
        chat_template: bool = True,
        max_tokens: int = 16,
        temperature: float = 0.0,
        device: str | None = None,
        dtype: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        if (judge is None) == (url is None):
            raise ValueError("GenerativeReward: give exactly one of judge (a local dir) or url")
        if mode not in ("score", "choice"):
            raise ValueError(f"mode must be 'score' or 'choice', got {mode!r}")
        if both_orders and mode != "choice":
            raise ValueError("both_orders applies to mode='choice' (a score has no order)")
        if len(choices) != 2 or choices[0] == choices[1]:
            raise ValueError(f"choices must be two distinct names, got {list(choices)}")
        self.mode, self.both_orders, self.scale = mode, both_orders, float(scale)
        self.fallback = float(fallback)
        self.choices = tuple(str(c) for c in choices)
        self.template = template or (SCORE_TEMPLATE if mode == "score" else CHOICE_TEMPLATE)
        fields = ("{response}",) if mode == "score" else ("{response_a}", "{response_b}")
        missing = [f for f in fields if f not in self.template]
        if missing:
            raise ValueError(f"template has no {missing[0]} field (mode={mode!r})")
        default = (
            r"(-?\d+(?:\.\d+)?)"
            if mode == "score"
            else r"\b(" + "|".join(map(re.escape, self.choices)) + r")\b"
        )
        try:
            self.pattern = re.compile(pattern or default)
        except re.error as e:
            raise ValueError(f"pattern {pattern!r} is not a valid regex: {e}") from None
        self.max_tokens, self.temperature = max_tokens, temperature
        self.url, self.model_name, self.timeout = url, model_name, timeout
        self.chat_template = chat_template
        self.engine = None
        if judge is not None:
            from lightrft.engine import NativeEngine

            self.engine = NativeEngine(judge, device=device, dtype=dtype)
        self.parse_failures = 0  # running totals
        self.judged = 0
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ generation

    def _complete(self, texts: list[str]) -> list[str]:
        if self.engine is not None:
            return self._complete_local(texts)
        body = json.dumps(
            {
                "model": self.model_name,
                "prompt": texts,
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
            }
        ).encode()
        req = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            out = json.loads(resp.read())
        choices = sorted(out["choices"], key=lambda c: c.get("index", 0))
        if len(choices) != len(texts):
            raise ValueError(
                f"the judge at {self.url} returned {len(choices)} completions for "
                f"{len(texts)} prompts"
            )
        return [c.get("text", "") for c in choices]

    def _complete_local(self, texts: list[str]) -> list[str]:
        from lightrft.engine.protocol import Request, SamplingParams

        tok = self.engine.tokenizer
        if self.chat_template:
            texts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        sampling = SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens)
        done = self.engine.generate([Request(list(x)) for x in ids], sampling)
        return [
            c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True)
            for c in done
        ]

    # ------------------------------------------------------------------ scoring

    def _score_verdict(self, text: str) -> float | None:
        found = parse_verdict(text, self.pattern)
        if found is None:
            return None
        try:
            return self.scale * float(found)
        except ValueError:
            return None

    def _choice_verdict(self, text: str, response_first: bool) -> float | None:
        found = parse_verdict(text, self.pattern)
        if found is None or found.strip() not in self.choices:
            return None
        first_wins = found.strip() == self.choices[0]
        return 1.0 if first_wins == response_first else 0.0

    def __call__(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        references: Sequence[str | None] | None = None,
        labels: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        n = len(responses)
        refs = list(references) if references is not None else [None] * n
        texts: list[str] = []
        jobs: list[tuple[int, bool]] = []  # (sample, response shown first)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            q = _prompt_text(p)
            if self.mode == "score":
                texts.append(self.template.format(prompt=q, response=r, reference=refs[i] or ""))
                jobs.append((i, True))
                continue
            if refs[i] is None:
                raise ValueError(
                    f"GenerativeReward(mode='choice') compares each response with its reference "
                    f"response, but sample {i} has no reference"
                )
            orders = (True, False) if self.both_orders else (True,)
            for first in orders:
                a, b = (r, refs[i]) if first else (refs[i], r)
                texts.append(self.template.format(prompt=q, response_a=a, response_b=b))
                jobs.append((i, first))
        verdicts = self._complete(texts) if texts else []
        sums = torch.zeros(n, dtype=torch.float32)  # [B]
        counts = torch.zeros(n, dtype=torch.float32)  # [B]
        failures, example = 0, None
        for (i, first), text in zip(jobs, verdicts, strict=True):
            value = (
                self._score_verdict(text)
                if self.mode == "score"
                else self._choice_verdict(text, first)
            )
            if value is None:
                failures += 1
                example = example or text
                value = self.fallback
            sums[i] += value
            counts[i] += 1
        self.parse_failures += failures
        self.judged += len(jobs)
        self.last_metrics = {
            "parse_failures": float(failures),
            "parse_failure_rate": failures / max(len(jobs), 1),
        }
        if failures:
            log.warning(
                "GenerativeReward: %d of %d verdicts did not match %r (fallback %s); e.g. %r",
                failures,
                len(jobs),
                self.pattern.pattern,
                self.fallback,
                (example or "")[:80],
            )
        return sums / counts.clamp(min=1)
