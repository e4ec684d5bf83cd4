"""The rollout engine colocated with the trainer: one object owns its wake / sleep cycle and
keeps its weights those of the trained model.

Between rollouts the engine sleeps (``sleep_level`` 1: its KV cache is freed; 2: its weights
too). Generating wakes it, reloading released weights from the trainer first (a collective, so
every rank calls :meth:`ColocatedEngine.generate`, with or without prompts). After an optimizer
update :meth:`ColocatedEngine.sync` streams the new weights in: only what training changes while
the engine kept its weights (a frozen vision tower stays), everything after a release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from lightrft.config import option, section
from lightrft.data.media import Media
from lightrft.engine.config import EngineConfig
from lightrft.engine.protocol import Continuation, Request, Resume, SamplingParams
from lightrft.strategy.base import Strategy


@section
class RolloutEngineConfig(EngineConfig):
    """``engine:``: the library's engine section, and what the engine frees between rollouts."""

    sleep_level: Literal[0, 1, 2] = option(1, doc="1: free the KV cache, 2: the weights too")


class ColocatedEngine:
    """``engine`` (native or vLLM) beside the trainer whose ``strategy`` holds the weights."""

    def __init__(self, engine: Any, strategy: Strategy, sleep_level: int):
        self.engine, self.strategy, self.sleep_level = engine, strategy, sleep_level
        self.released = False  # weights dropped by a level-2 sleep

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        media: Sequence[Media | None] | None = None,
        continuation: Continuation | None = None,
        *,
        resumes: Sequence[Resume | None] | None = None,
        token_budget: int | None = None,
    ) -> list:
        """Wake the engine (reloading released weights) and generate. ``media``: per prompt,
        its :class:`~lightrft.data.media.Media` or None. ``continuation``: multi-turn (see
        :class:`~lightrft.engine.protocol.Turn`). ``resumes`` (per prompt, or None) and
        ``token_budget``: partial rollouts (the native engine's)."""
        if self.released:
            self.engine.wake_up(["weights"])
            self.strategy.sync_weights(self.engine)
            self.released = False
        self.engine.wake_up()
        if not prompt_ids:
            return []
        media = media or [None] * len(prompt_ids)
        resumes = resumes or [None] * len(prompt_ids)
        requests = [
            Request(ids, m, r) for ids, m, r in zip(prompt_ids, media, resumes, strict=True)
        ]
        budget = {} if token_budget is None else {"token_budget": token_budget}
        return self.engine.generate(requests, params, continuation=continuation, **budget)

    def sleep(self) -> None:
        """Free the engine's memory for training (nothing at ``sleep_level`` 0)."""
        if self.sleep_level:
            self.engine.sleep(self.sleep_level)
            self.released = self.sleep_level == 2

    def sync(self) -> None:
        """The trained weights into the engine after an update (collective)."""
        released = self.released
        if self.sleep_level:
            # Level 2 dropped the weights; at level 1 vLLM offloads them to host memory (the
            # native engine keeps them, and waking awake weights is a no-op): either way they
            # must be awake to be loaded into.
            self.engine.wake_up(["weights"])
            self.released = False
        # An engine that kept its weights (on the device or offloaded) still holds the frozen ones
        # (a frozen vision tower): send only what training changes; after a release, everything.
        self.strategy.sync_weights(self.engine, skip_frozen=not released)
