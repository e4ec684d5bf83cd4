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

The judge runs in-process (``judge``: a local HF directory) on the engine its ``engine`` section
chooses (:class:`JudgeEngineConfig`: the native engine by default, or vLLM; built by the same
factory as the rollout engine, :meth:`~lightrft.engine.config.EngineConfig.build`), or remotely
(``url``: an OpenAI-compatible ``/v1/completions`` endpoint, e.g. ``vllm serve``). Greedy
decoding by default. Beside a policy on vLLM, a judge on vLLM shares its ``tensor_parallel_size``
(docs/engine.md, "Several engines in one process").

A vision-language judge (a local VLM directory) sees the conversation's images (and a Qwen2-VL /
Qwen2.5-VL judge its videos): it reads each sample's conversation (``Sample.conversation``), and
its judge prompt is one user turn holding the conversation's images, videos and audio, in order,
then the template filled with the conversation's text. That turn is rendered, its media
processed and its placeholders expanded by the prompt datasets' own functions
(:class:`~lightrft.data.records.MediaSamples`, :func:`~lightrft.data.templates.encode_prompt`),
and the engine request carries the :class:`~lightrft.data.media.Media`, as an actor's rollout
request does. Judgment data whose prompt is ``"<image>" + template`` with the board in
``images`` renders to the same tokens (:func:`lightrft.tasks.ensure_shapes_judgments`).

``pattern`` may name its groups: ``verdict`` is the verdict (else the first group, or the whole
match), and ``echo`` the judge's copy of the response it judges (score mode). A judge taught to
write the answer before its verdict (``"3 vs 4: no"``) can then be held to it: when the echo
differs from the response (both stripped), the judge judged something else (an answer it misread
or normalised: the door an actor walks through when it drifts to answers the judge never saw), so
the sample gets the ``fallback`` reward and is counted in ``last_metrics["echo_mismatches"]``
(``reward/<name>/echo_mismatches``), apart from the parse failures.

A verdict that does not match ``pattern`` (or names no known choice or verdict) is a parse
failure: it gets the configured ``fallback`` reward (there is no default: a silent 0 would read as
a verdict), is counted in ``last_metrics["parse_failures"]`` (logged by
:class:`~lightrft.rewards.CombinedReward` as ``reward/<name>/parse_failures``) and in the running
total ``parse_failures``. With ``max_parse_failures``, that many failures in a row (no verdict
parsed in between) stop the run with an error showing the last verdicts: a judge whose pattern
never matches is refused instead of training on the fallback.
"""

from __future__ import annotations

import json
import logging
import re
import string
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from lightrft.config import section
from lightrft.data.io import Records
from lightrft.data.media import MediaOptions
from lightrft.data.records import MediaSamples
from lightrft.data.templates import encode_prompt
from lightrft.engine.config import EngineConfig
from lightrft.engine.protocol import Request, SamplingParams
from lightrft.models.multimodal import load_processors
from lightrft.rewards.base import Prompt, RewardInputError, Sample, finite_number, media_parts

log = logging.getLogger(__name__)

SCORE_TEMPLATE = (
    "Rate the response to the question from 0 to 10.\n"
    "Question: {prompt}\nResponse: {response}\nScore:"
)
CHOICE_TEMPLATE = (
    "Which response answers the question better? Answer A or B.\n"
    "Question: {prompt}\nA: {response_a}\nB: {response_b}\nBetter:"
)


@section
class JudgeEngineConfig(EngineConfig):
    """A local judge's ``engine:`` section: the library's engine section, whose device rules a
    backend other than the native one (it takes no ``device``) meets when the config is read."""

    # The judge's former top-level key: ``lightrft validate`` names its new place.
    moved = {"dtype": "dtype"}

    def resolve(self, at: str) -> JudgeEngineConfig:
        try:  # the section's messages say engine.<key>: name where this one is
            super().resolve(at)
            if self.backend != "native":
                self.check_device(None)
        except ValueError as e:
            raise ValueError(f"{at.rstrip('.')}: the judge's {e}") from None
        return self


def _last_match(text: str, pattern: re.Pattern[str]) -> re.Match[str] | None:
    matches = list(pattern.finditer(text))
    return matches[-1] if matches else None


def parse_verdict(text: str, pattern: re.Pattern[str]) -> str | None:
    """The ``verdict`` group (else the first group, else the whole match) of ``pattern``'s last
    match in ``text``; ``None`` if none."""
    m = _last_match(text, pattern)
    if m is None:
        return None
    if "verdict" in pattern.groupindex:
        return m.group("verdict") or ""
    return m.group(1) if m.groups() else m.group(0)


def _message_text(content: Any) -> str:
    """A message's text: a string as is; of content parts, the text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _prompt_text(prompt: Prompt) -> str:
    """A prompt's text for the template's ``{prompt}``: a string as is; a conversation of one
    message its text, of several ``role: text`` lines (media parts left out)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return _message_text(prompt[0]["content"])
    return "\n".join(f"{m['role']}: {_message_text(m['content'])}" for m in prompt)


class GenerativeReward:
    """A judge model as a reward function (see the module docstring).

    Args:
        fallback: reward of a sample whose verdict cannot be parsed (required).
        judge: local HF directory of the judge (run in-process on ``engine``); or
        url: an OpenAI-compatible completions endpoint (``http://host:port/v1/completions``).
        model_name: the ``model`` field sent to ``url``.
        mode: ``"score"`` or ``"choice"``.
        template: the judge prompt; default :data:`SCORE_TEMPLATE` / :data:`CHOICE_TEMPLATE`.
        pattern: regex of the verdict; default a number (score) or ``\\b(A|B)\\b`` (choice).
            Named groups ``verdict`` and ``echo`` (the judge's copy of the response; score mode):
            see the module docstring.
        choices: the names of the first and second response in a choice verdict.
        both_orders: choice mode: judge both presentation orders and average.
        scale: score mode: reward = ``scale * score``.
        chat_template: local judge: wrap the prompt as a user turn with the judge's template.
        max_tokens, temperature: decoding of the verdict.
        device: a local judge on the native engine: where it runs (default: CUDA if
            available); vLLM places its engine itself.
        engine: a local judge's engine (:class:`JudgeEngineConfig`, the ``engine`` section;
            default: the native engine; fp32 on CPU, bf16 on CUDA, as every engine).
        timeout: seconds per HTTP request.
        verdicts: score mode: verdict word -> reward value (e.g. ``{"yes": 1.0, "no": 0.0}``),
            instead of a number; the default pattern then matches these words.
        max_parse_failures: refuse (``ValueError`` with the last verdicts) once this many
            verdicts in a row failed to parse; None never refuses.
        media: a local vision- or audio-language judge's media options (the ``media``
            section, :class:`~lightrft.data.media.MediaOptions`: image bounds, how videos are
            sampled and sized, the audio bound; the prompt datasets' keys and defaults; give
            those of the judge's own training data).

    A local vision-language judge needs each sample's conversation (``Sample.conversation``, as
    the recipes give it) and the chat template; a text judge scores the prompts as given.
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
        engine: JudgeEngineConfig | None = None,
        timeout: float = 60.0,
        verdicts: Mapping[str, float] | None = None,
        max_parse_failures: int | None = None,
        media: MediaOptions | None = None,
    ) -> None:
        if (judge is None) == (url is None):
            raise ValueError("GenerativeReward: give exactly one of judge (a local dir) or url")
        if mode not in ("score", "choice"):
            raise ValueError(f"mode must be 'score' or 'choice', got {mode!r}")
        if both_orders and mode != "choice":
            raise ValueError("both_orders applies to mode='choice' (a score has no order)")
        if len(choices) != 2 or choices[0] == choices[1]:
            raise ValueError(f"choices must be two distinct names, got {list(choices)}")
        if verdicts is not None:
            if mode != "score":
                raise ValueError("verdicts applies to mode='score' (choice verdicts are choices)")
            if not verdicts or not all(isinstance(k, str) and k for k in verdicts):
                raise ValueError(f"verdicts must map non-empty words to rewards, got {verdicts!r}")
            bad = [k for k, v in verdicts.items() if not finite_number(v)]
            if bad:
                raise ValueError(f"verdicts.{bad[0]} must be a finite number")
        if max_parse_failures is not None and (
            isinstance(max_parse_failures, bool)
            or not isinstance(max_parse_failures, int)
            or max_parse_failures < 1
        ):
            raise ValueError(f"max_parse_failures must be >= 1 or None, got {max_parse_failures}")
        self.verdicts = None if verdicts is None else {k: float(v) for k, v in verdicts.items()}
        self.max_parse_failures = max_parse_failures
        self.mode, self.both_orders, self.scale = mode, both_orders, float(scale)
        self.fallback = float(fallback)
        self.choices = tuple(str(c) for c in choices)
        self.template = template or (SCORE_TEMPLATE if mode == "score" else CHOICE_TEMPLATE)
        fields = ("response",) if mode == "score" else ("response_a", "response_b")
        named = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        missing = [f for f in fields if f not in named]
        if missing:
            raise ValueError(f"template has no {{{missing[0]}}} field (mode={mode!r})")
        if unknown := sorted(named - {"prompt", "reference", *fields}):
            raise ValueError(f"template field {{{unknown[0]}}} is not one of mode={mode!r}'s")
        words = self.choices if mode == "choice" else list(self.verdicts or ())
        default = (
            r"\b(" + "|".join(map(re.escape, words)) + r")\b" if words else r"(-?\d+(?:\.\d+)?)"
        )
        try:
            self.pattern = re.compile(pattern or default)
        except re.error as e:
            raise ValueError(f"pattern {pattern!r} is not a valid regex: {e}") from None
        self.echo = "echo" in self.pattern.groupindex
        if self.echo and mode != "score":
            raise ValueError(
                "pattern: an 'echo' group applies to mode='score' (a choice verdict names a "
                "response, it does not copy one)"
            )
        self.max_tokens, self.temperature = max_tokens, temperature
        self.url, self.model_name, self.timeout = url, model_name, timeout
        self.chat_template = chat_template
        self.engine = None
        self.tokenizer = None
        self.media = None  # MediaSamples of a vision- or audio-language judge
        if judge is None:
            if engine is not None:
                raise ValueError("engine: a remote judge (url) runs on its server's engine")
            if media is not None:
                MediaSamples(None, media, given="a remote judge (url) takes its media as sent")
        else:
            engine = engine or JudgeEngineConfig()
            if engine.backend != "native" and device is not None:
                raise ValueError(
                    f"device applies to a judge on engine.backend=native; engine.backend="
                    f"{engine.backend} places the judge itself (remove device)"
                )
            engine = engine.checked("engine.")  # a section built in Python is checked here
            # A text model's tokenizer twice, or a vision- or audio-language model's processor.
            processor, self.tokenizer = load_processors(judge)
            # Media only from the conversations' parts, bounded as the prompt datasets bound them.
            samples = MediaSamples(processor, media, given=f"judge {judge} is text-only")
            if samples.kinds and not self.chat_template:
                raise ValueError(
                    f"judge {judge} is a vision- or audio-language model: it needs "
                    "chat_template=true (the chat template places the image and audio tokens)"
                )
            if samples.kinds:
                self.media = samples
            # The rollout engines' factory; a fixed seed, as a judge is greedy by default.
            self.engine = engine.build(judge, self.tokenizer, device=device, seed=0)
        self.parse_failures = 0  # running totals
        self.echo_mismatches = 0
        self.judged = 0
        self.failure_streak = 0  # verdicts in a row that did not parse
        self._recent_failures: deque[str] = deque(maxlen=3)
        self.last_verdicts: list[str] = []  # the judge's texts of the last call, job by job
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ generation

    def _complete(self, texts: list[str], media: list[list[dict[str, Any]]]) -> list[str]:
        """The judge's verdict for each judge prompt; ``media``: each one's image, video and
        audio parts (a vision-language judge only)."""
        if self.engine is None:  # a remote judge
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
        if self.media is not None:
            requests = self.media_requests(texts, media)
        elif self.chat_template:  # each judge prompt one user turn
            requests = [Request(encode_prompt(self.tokenizer, t)[1]) for t in texts]
        else:
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            requests = [Request(list(x)) for x in ids]
        # Verdict texts decoded here, by the judge's tokenizer, whichever engine generated.
        sampling = SamplingParams(
            temperature=self.temperature, max_tokens=self.max_tokens, detokenize=False
        )
        done = self.engine.generate(requests, sampling)
        return [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in done]

    def media_requests(self, texts: list[str], media: list[list[dict[str, Any]]]) -> list:
        """The engine requests of a vision- or audio-language judge: each judge prompt as one
        user turn, its media parts first, then the text; rendered, processed and expanded as a
        prompt dataset renders an ``"<image>" + text`` record."""
        assert self.media is not None
        src = Records.from_list([{} for _ in texts], name="judge prompt")
        requests = []
        for i, (text, parts) in enumerate(zip(texts, media, strict=True)):
            chat = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
            msgs, decoded = self.media.messages(src, i, chat)
            _, ids = encode_prompt(self.tokenizer, msgs, apply_chat_template=True)
            ids, _, inputs = self.media.expand(ids, None, decoded, src.where(i))
            requests.append(Request(ids, inputs))
        return requests

    # ------------------------------------------------------------------ scoring

    def _reward_of(self, text: str, response_first: bool) -> float | None:
        """The reward a verdict gives (``None``: it does not parse); ``response_first``: choice
        mode, whether the response was shown first."""
        found = parse_verdict(text, self.pattern)
        if found is None:
            return None
        found = found.strip()
        if self.mode == "choice":
            if found not in self.choices:
                return None
            return 1.0 if (found == self.choices[0]) == response_first else 0.0
        if self.verdicts is not None:
            value = self.verdicts.get(found)
            return None if value is None else self.scale * value
        try:
            return self.scale * float(found)
        except ValueError:
            return None

    def judge_prompts(
        self, samples: Sequence[Sample]
    ) -> tuple[list[str], list[list[dict[str, Any]]], list[tuple[int, bool]]]:
        """What the judge is asked: each judge prompt's text, its media parts (a vision- or
        audio-language judge: the conversation's, in order; else none) and its job ``(sample,
        response shown first)``; two jobs per sample with ``both_orders``."""
        if self.media is not None and any(s.conversation is None for s in samples):
            raise RewardInputError(
                "a vision-language judge reads each sample's conversation with its images: "
                "give each sample its conversation (the recipes do; a prompt dataset needs "
                "apply_chat_template=true)"
            )
        texts: list[str] = []
        media: list[list[dict[str, Any]]] = []
        jobs: list[tuple[int, bool]] = []
        for i, s in enumerate(samples):
            p = s.prompt if self.media is None else s.conversation
            r, ref = s.response, s.reference
            if self.mode == "choice" and ref is None:
                raise RewardInputError(
                    f"GenerativeReward(mode='choice') compares each response with its reference "
                    f"response, but sample {i} has no reference"
                )
            # Every field of either mode (a template ignores those it does not name).
            fields = dict(prompt=_prompt_text(p), response=r, reference=ref or "")
            for first in (True, False) if self.both_orders else (True,):  # both: choice only
                a, b = (r, ref) if first else (ref, r)
                texts.append(self.template.format(**fields, response_a=a, response_b=b))
                media.append(media_parts(p) if self.media is not None else [])
                jobs.append((i, first))
        return texts, media, jobs

    def __call__(self, samples: Sequence[Sample]) -> torch.Tensor:
        n = len(samples)
        texts, media, jobs = self.judge_prompts(samples)
        verdicts = self._complete(texts, media) if texts else []
        self.last_verdicts = verdicts
        sums = torch.zeros(n, dtype=torch.float32)  # [B]
        failures, mismatches, example = 0, 0, None
        for (i, first), text in zip(jobs, verdicts, strict=True):
            value = self._reward_of(text, first)
            if value is None:
                failures += 1
                example = example or text
                self.failure_streak += 1
                self._recent_failures.append(text)
            else:
                self.failure_streak = 0  # the pattern matched: the judge works
                m = _last_match(text, self.pattern)  # not None: the verdict parsed
                # The judge's copy of the response (the echo group) must be the response.
                if self.echo and (m.group("echo") or "").strip() != samples[i].response.strip():
                    mismatches += 1
                    value = None
            sums[i] += self.fallback if value is None else value
        self.parse_failures += failures
        self.judged += len(jobs)
        self.last_metrics = {
            "parse_failures": float(failures),
            "parse_failure_rate": failures / max(len(jobs), 1),
        }
        if self.echo:
            self.echo_mismatches += mismatches
            self.last_metrics["echo_mismatches"] = float(mismatches)
        if failures:
            log.warning(
                "GenerativeReward: %d of %d verdicts did not match %r (fallback %s); e.g. %r",
                failures,
                len(jobs),
                self.pattern.pattern,
                self.fallback,
                (example or "")[:80],
            )
        if self.max_parse_failures is not None and self.failure_streak >= self.max_parse_failures:
            raise ValueError(
                f"GenerativeReward: the judge's last {self.failure_streak} verdicts did not match "
                f"the pattern {self.pattern.pattern!r} (max_parse_failures="
                f"{self.max_parse_failures}); the last ones: "
                + ", ".join(repr(t[:80]) for t in self._recent_failures)
                + ". Check the judge, its template and max_tokens, or the pattern"
            )
        return sums / (2 if self.both_orders else 1)  # each sample's jobs: 2 with both_orders
