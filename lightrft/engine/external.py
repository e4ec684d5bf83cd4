"""What the adapters over external engines (vLLM, SGLang) share, so that a rule lives once.

- :func:`tp_groups`: the consecutive-rank tensor-parallel groups of colocated engines.
- :func:`collapse_placeholders`: a media item's expanded placeholder run back to one token, the
  form both engines' own processors expand again (:func:`collapse_media`: every kind of a
  request's media).
- :func:`hf_weight_names`: the HF parameter names ``load_weights`` accepts and those a level-2
  sleep must see reloaded.
- :func:`kept_rng_state`: the trainer's RNG states, saved before an engine seeds the process's
  generators and restored after.
- The multi-turn loop of an engine whose ``generate`` blocks until its whole batch is done:
  :meth:`ExternalEngine._continue` over :class:`Trajectory` objects, with :func:`turn_seed`
  giving every later turn (and every sample of a seeded request) its own reproducible stream.
- :class:`ExternalEngine`: the base of both adapters, with what their ``generate`` and
  ``load_weights`` do alike around their backend's calls.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from lightrft.data.media import Media
from lightrft.engine.protocol import (
    Completion,
    Continuation,
    Request,
    SamplingParams,
    Turn,
    check_observation,
    sampled_mask,
)
from lightrft.models import modality
from lightrft.models.loading import model_auto_class

# The logit bias that keeps a multimodal model's placeholder ids out of sampling: vLLM's floor,
# and the same value for SGLang (no floor there) so both engines' log-probs carry the same bias.
MEDIA_LOGIT_BIAS = -100.0


def tp_groups(world_size: int, tp_size: int, key: str = "") -> list[list[int]]:
    """Consecutive ranks per tensor-parallel group: ``[[0, 1], [2, 3], ...]`` for ``tp_size=2``
    (``key``: ``"engine."`` when a config is checked)."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(
            f"{key}tensor_parallel_size={tp_size} must be >= 1 and divide the world size "
            f"{world_size}"
        )
    return [list(range(g * tp_size, (g + 1) * tp_size)) for g in range(world_size // tp_size)]


def collapse_placeholders(
    ids: Sequence[int], token: int, num_tokens: Sequence[int], kind: str = "image"
) -> list[int]:
    """``ids`` with the k-th image's (or audio's, or video's) run of ``num_tokens[k]``
    placeholder tokens ``token`` replaced by one."""
    out: list[int] = []
    k = j = 0
    while j < len(ids):
        if ids[j] == token:  # the k-th item's run: one token kept, the rest skipped
            if k >= len(num_tokens):
                raise ValueError(
                    f"the prompt has more {kind} tokens than its {len(num_tokens)} {kind}s"
                )
            if list(ids[j : j + num_tokens[k]]) != [token] * num_tokens[k]:
                raise ValueError(
                    f"{kind} {k} needs {num_tokens[k]} consecutive {kind} tokens in the prompt"
                )
            j += num_tokens[k] - 1
            k += 1
        out.append(ids[j])
        j += 1
    if k != len(num_tokens):
        raise ValueError(f"the prompt places {k} of its {len(num_tokens)} {kind}s")
    return out


# What a request is told when it carries a kind of media the model has no placeholder for.
NO_PLACEHOLDER = {
    "audio": "the request has audio but the model is not audio-language",
    "image": "the request has images but the model is not vision-language",
    "video": "the request has videos but the model takes no video",
}


def collapse_media(ids: Sequence[int], media: Media, tokens: dict[str, int | None]) -> list[int]:
    """``ids`` with the placeholder run of every media item collapsed to one token, kind by kind
    in the order of ``tokens`` (kind -> the model's placeholder id, None: it takes none)."""
    if not isinstance(media, Media):
        raise ValueError(
            f"a request's media is a {type(media).__name__}; pass the Media the prompt datasets "
            "give (lightrft.data.media)"
        )
    ids = list(ids)
    for kind, token in tokens.items():
        value = getattr(media, kind)
        if value is None:
            continue
        if token is None:
            raise ValueError(NO_PLACEHOLDER[kind])
        ids = collapse_placeholders(ids, token, value.num_tokens, kind=kind)
    return ids


def hf_weight_names(config) -> tuple[set[str], set[str]]:
    """``(accepted, required)`` HF parameter names of ``config``'s model (built on meta).

    ``accepted`` includes both names of tied weights; ``required`` names each tensor once.
    """
    with torch.device("meta"):
        model = model_auto_class(config).from_config(config)
    accepted = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return accepted, {name for name, _ in model.named_parameters()}


@contextlib.contextmanager
def kept_rng_state() -> Iterator[None]:
    """Python, NumPy, CPU and CUDA RNG states, saved before an external engine starts and
    restored after: engines seed the global generators of the process they run in, and the
    trainer's data order and dropout must not change because an engine was built."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def turn_seed(seed: int | None, sample_index: int, turn: int) -> int | None:
    """The seed of a sample's turn: its own stream, reproducible from the request's seed."""
    if seed is None:
        return None
    return (seed + 1_000_003 * (sample_index + 1) + 10_007 * turn) % 2**63


def check_finish_reason(reason: object, engine: str, request: int, sample: int) -> str:
    """An external engine's finish reason, refused unless it is one of the protocol's."""
    if reason not in ("stop", "length"):
        raise ValueError(
            f"{engine} finished request {request} sample {sample} with reason {reason!r}"
        )
    return reason  # type: ignore[return-value]


@dataclass
class Trajectory:
    """One sample's multi-turn trajectory being built: its completion grows turn by turn."""

    completion: Completion
    budget: int
    params: SamplingParams
    spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.spans.append((0, len(self.completion.token_ids)))

    def wants_turn(self) -> bool:
        """The last turn stopped and turns remain: ask the continuation."""
        limit = self.params.max_turns
        return self.completion.finish_reason == "stop" and (
            limit is None or len(self.spans) < limit
        )

    def turn(self) -> Turn:
        c = self.completion
        a, b = self.spans[-1]
        return Turn(
            request_index=c.request_index,
            sample_index=c.sample_index,
            turn_index=len(self.spans) - 1,
            token_ids=c.token_ids[a:b],
            logprobs=c.logprobs[a:b],
            response_token_ids=list(c.token_ids),
            max_observation_tokens=self.budget - len(c.token_ids) - 1,
        )

    def observe(self, obs: list[int] | None) -> bool:
        """Append the observation; False when the trajectory ends here (None: "stop"; an
        observation that leaves no room for one more sampled token: dropped, "length")."""
        c = self.completion
        if obs is None or len(c.token_ids) + len(obs) + 1 > self.budget:
            c.finish_reason = "stop" if obs is None else "length"
            return False
        c.token_ids = c.token_ids + obs
        c.logprobs = c.logprobs + [0.0] * len(obs)
        return True

    def add_turn(self, ids: list[int], logprobs: list[float], finish_reason: str) -> None:
        c = self.completion
        self.spans.append((len(c.token_ids), len(c.token_ids) + len(ids)))
        c.token_ids = c.token_ids + ids
        c.logprobs = c.logprobs + logprobs
        c.finish_reason = finish_reason  # type: ignore[assignment]

    def next_turn(self) -> tuple[Completion, SamplingParams, int, int | None]:
        """The next turn's ``_sample_on`` entry: its token limit (what is left of the budget)
        and its seed."""
        c = self.completion
        seed = turn_seed(self.params.seed, c.sample_index, len(self.spans))
        return c, self.params, self.budget - len(c.token_ids), seed


class ExternalEngine:
    """What ``VLLMEngine`` and ``SGLangEngine`` do alike: FIRE's second pass and the later turns
    of multi-turn generation (``generate`` checks its call with :func:`checked_call`,
    ``load_weights`` takes the names of :func:`hf_weight_names`).
    Each adapter gives its backend's calls: ``_sample_on`` (one ``n=1`` request per trajectory
    that goes on) and ``_budget`` (response tokens a sample may hold)."""

    def _setup(self, hf_config, max_model_len: int) -> None:
        """What both adapters keep of the model (its HF ``config``): vocabulary size, length,
        media placeholder ids (kept out of sampling) and the weight names of
        :func:`hf_weight_names`; and the protocol's state (nothing asleep or unloaded)."""
        self.vocab_size = int(hf_config.get_text_config().vocab_size)
        self.max_model_len = max_model_len
        ids = modality.placeholder_ids(hf_config)
        self.image_token_id, self.audio_token_id = ids.get("image"), ids.get("audio")
        self.video_token_id = ids.get("video")
        self.suppress_token_ids = modality.media_token_ids(hf_config)
        self._names, self._required = hf_weight_names(hf_config)
        self._asleep: set[str] = set()
        self._unloaded: set[str] = set()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _fire_rest(
        self, requests: list[Request], params: list[SamplingParams], firsts: list[Completion]
    ) -> list[Completion]:
        """FIRE's second pass over ``firsts`` (their first token sampled hot): each FIRE sample
        that did not stop goes on as one ``n=1`` request up to its budget, with a distinct
        stream per sample (:func:`turn_seed`, turn 0)."""
        going = []
        for c in firsts:
            p = params[c.request_index]
            left = self._budget(requests[c.request_index], p) - len(c.token_ids)
            if p.first_token_temperature is not None and c.finish_reason != "stop" and left > 0:
                going.append((c, p, left, turn_seed(p.seed, c.sample_index, 0)))
        for (c, p, *_), (ids, lps, reason) in zip(
            going, self._sample_on(requests, going) if going else [], strict=True
        ):
            c.token_ids, c.logprobs = c.token_ids + ids, c.logprobs + lps
            c.finish_reason = reason
            if p.detokenize:
                c.text = self._decode(c.token_ids)
        return firsts

    def _continue(
        self,
        requests: list[Request],
        params: list[SamplingParams],
        firsts: list[Completion],
        continuation: Continuation,
    ) -> list[Completion]:
        """The later turns of ``firsts`` (first-turn completions), in rounds: the continuations
        of every trajectory whose turn stopped run concurrently on a thread pool; those with an
        observation that fits sample their next turn together in one ``_sample_on`` call, each
        as one ``n=1`` request of prompt + response so far, with what is left of its budget.
        Fills in ``sampled_mask``, ``turn_spans`` and (when asked) ``text``."""
        trajs = []
        for c in firsts:
            p = params[c.request_index]
            trajs.append(Trajectory(c, self._budget(requests[c.request_index], p), p))
        forbidden = set(self.suppress_token_ids)
        going = trajs
        with ThreadPoolExecutor(min(max(len(trajs), 1), 64)) as pool:
            while going := [t for t in going if t.wants_turn()]:
                turns = [t.turn() for t in going]
                answers = list(pool.map(continuation, turns))
                going = [
                    t
                    for t, turn, obs in zip(going, turns, answers, strict=True)
                    if t.observe(check_observation(obs, turn, self.vocab_size, forbidden))
                ]
                if going:
                    sampled = self._sample_on(requests, [t.next_turn() for t in going])
                    for t, (ids, lps, reason) in zip(going, sampled, strict=True):
                        t.add_turn(ids, lps, reason)
        for t in trajs:
            c = t.completion
            c.sampled_mask = sampled_mask(t.spans, len(c.token_ids))
            c.turn_spans = t.spans
            if t.params.detokenize:
                c.text = self._decode(c.token_ids)
        return firsts
