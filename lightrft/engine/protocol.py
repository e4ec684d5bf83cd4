"""The rollout-engine protocol: requests in, completions out, plus sleep / wake-up and weight loading.

The method names and semantics mirror ``vllm.LLM`` (``generate``, ``sleep``, ``wake_up``,
``reset_prefix_cache``) so that the vLLM adapter stays thin and a recipe can swap engines without
touching its loop::

    engine.wake_up()
    completions = engine.generate(requests, sampling)
    engine.sleep(level)
    sync_weights(actor, engine)

Multi-turn rollouts (an agent calling tools, an environment giving feedback) pass a
``continuation``: after every assistant turn that ends at a stop token the engine calls it with a
:class:`Turn`; it answers with the observation's token ids to append (generation then goes on
after them) or ``None`` (the trajectory is done). The engine knows nothing of tools or chat
templates: the ids are appended exactly as given and the sampled ids are never re-encoded.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from lightrft.data.media import Media

FinishReason = Literal["stop", "length", "partial"]
WAKE_TAGS = ("weights", "kv_cache")


@dataclass
class Resume:
    """A response that a call's ``token_budget`` cut (``finish_reason="partial"``), to go on
    with (partial rollouts): sample ``sample_index`` of its request, with the ``token_ids``
    sampled so far and their ``logprobs`` (recorded by the policy that sampled each token).

    The engine prefills the prompt and these tokens (under its current weights) and samples
    on from the sample's own random stream at the position it stopped: with unchanged weights
    and the same seed the response equals the one generated in one go. The completion holds
    the whole response (these tokens and logprobs first, as given).
    """

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]


@dataclass
class Request:
    """One prompt to complete.

    ``prompt_token_ids``: the tokenised prompt (chat template already applied; media
    placeholders expanded). ``media``: its processed images / audio
    (:class:`~lightrft.data.media.Media`, as the prompt datasets give them) for a vision- or
    audio-language model; an engine whose model cannot take a kind rejects the request.
    ``resume``: continue a cut response (:class:`Resume`; its ``SamplingParams.n`` must be 1).
    """

    prompt_token_ids: list[int]
    media: Media | None = None
    resume: Resume | None = None


@dataclass
class SamplingParams:
    """How to sample completions of a request (names follow ``vllm.SamplingParams``).

    ``temperature=0`` is greedy decoding. ``top_k`` of 0 or -1 and ``top_p=1`` disable those
    filters. ``stop_token_ids`` are added to the tokenizer's end-of-sequence ids unless
    ``ignore_eos``; a stop token is kept as the last token of the response. ``seed`` makes the
    samples of a request reproducible regardless of what else is in the batch (sample ``j`` of
    ``n`` gets its own stream). ``first_token_temperature`` samples only the first response token at
    that temperature: FIRE sampling, Chen et al. 2024, "Flaming-hot Initiation with Regular
    Execution Sampling for Large Language Models" (arXiv:2410.21236). ``prompt_logprobs`` also
    returns the log-prob of every prompt token after the first under the same processing.

    With a continuation (multi-turn), ``max_tokens`` bounds the whole response of a trajectory,
    assistant and observation tokens together (verl's ``response_length``), and ``max_turns``
    the number of assistant turns (None: only the token budgets bound them); without one,
    ``max_turns`` has nothing to bound.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    first_token_temperature: float | None = None
    prompt_logprobs: bool = False
    detokenize: bool = True
    max_turns: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        for name, what, ok in _RULES:
            values = getattr(self, name)
            # stop_token_ids: every id is checked, and the bad one named.
            for value in values if name == "stop_token_ids" else [values]:
                if not ok(value):
                    raise ValueError(f"SamplingParams.{name} must {what}, got {value!r}")


def _finite_temperature(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


# SamplingParams' fields in checking order: (name, what it must be, the test of a good value).
_RULES = (
    ("n", "be an integer >= 1", lambda v: is_int(v) and v >= 1),
    ("temperature", "be a finite number >= 0", _finite_temperature),
    (
        "first_token_temperature",
        "be a finite number >= 0",
        lambda v: v is None or _finite_temperature(v),
    ),
    ("top_p", "be in (0, 1]", lambda v: isinstance(v, (int, float)) and 0.0 < v <= 1.0),
    ("top_k", "be a positive integer, or 0 / -1 to disable", lambda v: is_int(v) and v >= -1),
    ("max_tokens", "be an integer >= 1", lambda v: is_int(v) and v >= 1),
    ("stop_token_ids", "hold non-negative token ids", lambda t: is_int(t) and t >= 0),
    ("seed", "be an integer or None", lambda v: v is None or is_int(v)),
    ("max_turns", "be an integer >= 1 or None", lambda v: v is None or (is_int(v) and v >= 1)),
)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tokens(where: str, ids: Sequence[object], vocab_size: int) -> None:
    """Refuse ``ids`` (``where``: what holds them) with an entry that is not a token id in
    ``[0, vocab_size)``, naming the first (non-integers first)."""
    wrong = [t for t in ids if not is_int(t)]
    if bad := wrong + [t for t in ids if is_int(t) and not 0 <= t < vocab_size]:
        raise ValueError(f"{where} holds {bad[0]!r}, not a token id in [0, {vocab_size})")


@dataclass
class Completion:
    """One sampled response, with what a trainer needs to score and train on it.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the distribution it was sampled
    from (after temperature, top-k and top-p; for greedy rows, temperature 1). ``finish_reason``
    is ``"stop"`` when the last token is a stop token, ``"length"`` when ``max_tokens`` (or the
    engine's maximum length) ran out. ``prompt_logprobs`` (when asked for) has one entry per
    prompt token after the first.

    Multi-turn (a ``generate`` call with a continuation): ``token_ids`` is everything after the
    prompt, assistant and observation ids interleaved; an observation token's log-prob is 0.0
    (it was not sampled). ``sampled_mask[i]`` says whether ``token_ids[i]`` was sampled, and
    ``turn_spans`` holds each assistant turn's ``(start, end)`` in ``token_ids`` (observations
    fill the gaps). Both are None for a single-turn call, so nothing downstream changes.
    ``finish_reason`` is ``"stop"`` when the trajectory ended by itself (the continuation said
    None, or ``max_turns`` was spent), ``"length"`` when a budget cut it (its last observation,
    if it did not fit, is dropped).
    """

    request_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str | None = None
    prompt_logprobs: list[float] | None = None
    sampled_mask: list[bool] | None = None
    turn_spans: list[tuple[int, int]] | None = None

    @property
    def num_turns(self) -> int:
        """Assistant turns in the response (1 for a single-turn call)."""
        return 1 if self.turn_spans is None else len(self.turn_spans)


@dataclass
class Turn:
    """An assistant turn that ended at a stop token, handed to the continuation.

    ``token_ids`` / ``logprobs``: what was sampled in this turn (its stop token last).
    ``response_token_ids``: the trajectory after the prompt so far, this turn included.
    ``turn_index``: 0 for the first turn. ``max_observation_tokens``: the longest observation the
    engine will append (it must leave room to sample one more token under ``max_tokens`` and
    the engine's maximum length); a longer one is dropped and the trajectory ends ``"length"``,
    so an environment that wants to show a shortened observation should shorten it itself.
    """

    request_index: int
    sample_index: int
    turn_index: int
    token_ids: list[int]
    logprobs: list[float]
    response_token_ids: list[int]
    max_observation_tokens: int


# Called on a worker thread; returns the observation's ids to append, or None when done.
Continuation = Callable[[Turn], Sequence[int] | None]


@runtime_checkable
class Engine(Protocol):
    """What the recipes need from a rollout engine."""

    def generate(
        self,
        requests: Sequence[Request],
        sampling: SamplingParams | Sequence[SamplingParams],
        continuation: Continuation | None = None,
    ) -> list[Completion]:
        """Completions ordered by (request index, sample index): ``n`` per request; with a
        ``continuation``, whole multi-turn trajectories."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 also the weights (reload them before generating)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what sleep freed: ``["weights"]``, ``["kv_cache"]`` or both (None)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors, named as in the HF checkpoint, into the engine's weights."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget cached prompt KV states (call after every weight update)."""
        ...


def check_resumes(
    requests: Sequence[Request], params: Sequence[SamplingParams], vocab_size: int
) -> None:
    """Raise ``ValueError`` for a request's ``resume`` that cannot be continued."""
    for i, (req, p) in enumerate(zip(requests, params, strict=True)):
        res = req.resume
        if res is None:
            continue
        where = f"requests[{i}].resume"
        if not isinstance(res, Resume):
            raise ValueError(f"{where} is a {type(res).__name__}; pass a Resume")
        if not is_int(res.sample_index) or res.sample_index < 0:
            raise ValueError(f"{where}.sample_index must be an integer >= 0")
        if p.n != 1:
            raise ValueError(
                f"{where}: a resumed request is one sample; its SamplingParams.n is {p.n}"
            )
        _check_tokens(f"{where}.token_ids", res.token_ids, vocab_size)
        if len(res.logprobs) != len(res.token_ids):
            raise ValueError(
                f"{where} has {len(res.token_ids)} token ids but {len(res.logprobs)} logprobs"
            )
        if len(res.token_ids) >= p.max_tokens:
            raise ValueError(
                f"{where} holds {len(res.token_ids)} tokens, max_tokens is {p.max_tokens}: "
                "nothing is left to sample"
            )
        if p.prompt_logprobs:
            raise ValueError(f"{where}: prompt_logprobs cannot be asked of a resumed request")


def check_wake_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags to wake (all when None), rejecting unknown ones."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str):
        raise ValueError(
            f"wake_up tags must be a list such as ['weights'], got the string {tags!r}"
        )
    unknown = [t for t in tags if t not in WAKE_TAGS]
    if unknown:
        raise ValueError(f"unknown wake_up tag(s) {unknown}; choose from {list(WAKE_TAGS)}")
    return tuple(tags)


def checked_call(
    engine,
    requests: Sequence[Request],
    sampling: SamplingParams | Sequence[SamplingParams],
    token_budget: int | None = None,
) -> tuple[list[Request], list[SamplingParams]]:
    """A ``generate`` call's requests and one validated ``SamplingParams`` per request
    (``sampling``: one for all, or one per request), checked: refused while ``engine``'s memory
    is released (``engine._asleep``: the wake tags its sleep released) or while weights are not
    loaded since a level-2 sleep (``engine._unloaded``: their names), for a request that is not a
    ``Request`` or has token ids outside ``engine.vocab_size``, or with a ``token_budget`` that
    is not an integer >= 1."""
    if token_budget is not None and not (is_int(token_budget) and token_budget >= 1):
        raise ValueError(f"token_budget must be an integer >= 1 or None, got {token_budget!r}")
    if asleep := [tag for tag in WAKE_TAGS if tag in engine._asleep]:
        raise ValueError(
            f"generate called while the engine is asleep ({', '.join(asleep)} released); "
            "call wake_up() first"
        )
    if engine._unloaded:
        missing = sorted(engine._unloaded)
        raise ValueError(
            f"{len(missing)} weight(s) not loaded since the level-2 sleep, e.g. "
            f"{missing[:8]}; send every weight with load_weights (or sync_weights) first"
        )
    requests = list(requests)
    if isinstance(sampling, SamplingParams):
        params = [sampling] * len(requests)
    else:
        params = list(sampling)
        if len(params) != len(requests):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(requests)} requests; pass one "
                "SamplingParams, or one per request"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling must hold SamplingParams, got {type(p).__name__}")
    for p in {id(p): p for p in params}.values():
        p.validate()
    for i, req in enumerate(requests):
        if not isinstance(req, Request):
            raise ValueError(
                f"requests[{i}] is a {type(req).__name__}; wrap token ids as "
                "Request(prompt_token_ids=[...])"
            )
        if len(req.prompt_token_ids) == 0:
            raise ValueError(f"requests[{i}].prompt_token_ids is empty")
        _check_tokens(f"requests[{i}].prompt_token_ids", req.prompt_token_ids, engine.vocab_size)
    return requests, params


def check_weight_names(
    names: Sequence[str], known: Collection[str], asleep: bool, what: str
) -> None:
    """Refuse ``what`` (``load_weights``, ``weight_buffers``) before anything is copied: while
    the weights are ``asleep`` (released by a sleep; the native engine releases them at level 2
    only), or for a name that is not one of the model's ``known`` Hugging Face names (the
    closest one named)."""
    if asleep:
        raise ValueError(
            "the engine's weights are asleep (released by sleep); call "
            f"wake_up(['weights']) before {what}"
        )
    unknown = [name for name in names if name not in known]
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"{what}: unknown parameter name {', '.join(map(repr, unknown[:8]))}{hint}; the "
            "engine's model takes Hugging Face names"
        )


def check_sleep_level(level: int) -> None:
    if level not in (1, 2):
        raise ValueError(
            f"sleep level must be 1 (free the KV cache) or 2 (also free the weights), got {level!r}"
        )


def check_observation(
    obs: object, turn: Turn, vocab_size: int, forbidden: Collection[int] = ()
) -> list[int] | None:
    """A continuation's answer as a list of token ids (or None), refusing anything else.

    ``forbidden``: ids an observation may not hold (a multimodal model's media placeholders:
    observations are text).
    """
    if obs is None:
        return None
    where = (
        f"the continuation's observation for request {turn.request_index} sample "
        f"{turn.sample_index}"
    )
    if isinstance(obs, (str, bytes)) or not isinstance(obs, Sequence):
        raise ValueError(f"{where} is a {type(obs).__name__}; return a list of token ids or None")
    ids = list(obs)
    _check_tokens(where, ids, vocab_size)
    if media := [t for t in ids if t in forbidden]:
        raise ValueError(
            f"{where} holds the media placeholder id {media[0]}; observations are text"
        )
    return ids


def sampled_mask(spans: Sequence[tuple[int, int]], length: int) -> list[bool]:
    """True on response tokens inside an assistant turn's span, False on observation tokens."""
    mask = [False] * length
    for a, b in spans:
        mask[a:b] = [True] * (b - a)
    return mask
