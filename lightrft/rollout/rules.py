"""The rules of the rollout modes: which settings each mode (asynchronous, partial rollouts)
and each kind of actor (vision- or audio-language, sequence-parallel) cannot run with.

Checked while a config resolves (``lightrft validate`` and ``run``, before anything loads) by
:func:`check_rollout`, and again in setup once a ``prepare`` step has written the checkpoint
(:func:`check_models`). ``opts``: a GRPO-family config (``rollout``, ``engine``, ``environment``,
``algorithm``, ``strategy``, ``model``, ``critic``)."""

from __future__ import annotations

from typing import Any

from lightrft.algorithms.distillation import check_same_tokenizer
from lightrft.models.loading import load_tokenizer
from lightrft.models.multimodal import (
    check_towers,
    checkpoint_is_multimodal,
    checkpoint_is_vision_language,
)
from lightrft.sections import (
    check_model_path,
    check_sequence_parallel_checkpoint,
    check_sequence_parallel_critic,
)


def _check_off_policy(opts: Any, key: str, *, engine: str, episodes: str, samples: str):
    """The rules of every setting that trains on samples an engine drew under older weights
    (partial rollouts' carried tokens, asynchronous rollout's batches); ``key`` names the
    setting, the other arguments say why each rule holds for it."""
    e = opts.engine
    if e.backend not in ("native", "vllm") or (e.tensor_parallel_size or 1) > 1:
        got = f"engine.backend={e.backend}, tensor_parallel_size={e.tensor_parallel_size or 1}"
        raise ValueError(
            f"{key} needs engine.backend=native or vllm with tensor_parallel_size 1 ({engine}), "
            f"got {got}"
        )
    if opts.environment is not None:
        raise ValueError(
            f"{key} does not take an environment: {episodes}; remove the environment section"
        )
    alg = opts.algorithm
    if alg.old_logprobs == "trainer" and alg.tis.mode is None:
        # Without either, an exactly on-policy step takes the ratio as 1: the older policy's
        # samples would be trained on as if the current policy had drawn them.
        raise ValueError(
            f"{key}: {samples}, which need an importance correction towards the behaviour "
            "log-probs: set algorithm.old_logprobs=engine (the ratio's denominator is then the "
            "generating policy's log-prob) or algorithm.tis.mode (token or sequence_mask)"
        )


def check_rollout(opts: Any) -> None:
    """The rules of ``rollout.asynchronous`` and ``rollout.partial`` (asynchronous first: its
    message names its key before the engine's device rules)."""
    ro = opts.rollout
    if ro.asynchronous:  # what one-step-off rollout cannot run with
        key = "rollout.asynchronous=true"
        _check_off_policy(
            opts,
            key,
            engine="it generates in one process of its own",
            episodes="the generating process does not play multi-turn episodes",
            samples="it trains on samples of an older policy",
        )
        if ro.partial.token_budget is not None:
            raise ValueError(
                f"{key} and rollout.partial.token_budget: the generating process does not "
                "carry cut rows across steps; use one of them"
            )
        if opts.strategy.sequence_parallel > 1:
            raise ValueError(
                f"{key} and sequence_parallel={opts.strategy.sequence_parallel}: the sequence-"
                "parallel groups span every process, and one of them generates; use one of them"
            )
    if ro.partial.token_budget is not None:  # what partial rollouts cannot work with
        key = "rollout.partial.token_budget"
        _check_off_policy(
            opts,
            key,
            engine="an engine that cuts and resumes its own rows",
            episodes="a multi-turn row cannot be cut",
            samples="carried tokens were sampled by older weights",
        )
        if opts.algorithm.shaping.dynamic:
            raise ValueError(
                f"{key} and algorithm.shaping.dynamic_sampling both decide which groups a step "
                "trains on; use one"
            )


def check_models(opts: Any, *, prepare=None, loading: bool = False) -> None:
    """The model paths (the actor's, the critic's, the distillation teacher's, which must share
    the actor's tokenizer), then the rules for vision- and audio-language actors and for
    ``sequence_parallel``, from the checkpoint's config.json (cheap; a checkpoint a ``prepare``
    step writes is checked again in setup, ``loading=True``, before any model loads)."""
    check_model_path(opts.model.path, prepare=prepare, loading=loading)
    if opts.critic is not None and opts.critic.path != opts.model.path:
        check_model_path(opts.critic.path, "critic.path", prepare=prepare, loading=loading)
    if (d := opts.distillation) is not None:
        check_model_path(d.path, "distillation.path", prepare=prepare, loading=loading)
        if loading:
            rc = opts.model.trust_remote_code
            check_same_tokenizer(load_tokenizer(opts.model.path, trust_remote_code=rc),
                                 load_tokenizer(d.path, trust_remote_code=rc))  # fmt: skip
    check_towers(opts.model)
    sp = opts.strategy.sequence_parallel
    check_sequence_parallel_critic(sp, opts.critic is not None)
    check_sequence_parallel_checkpoint(sp, opts.model.path)
    if checkpoint_is_multimodal(opts.model.path) and opts.critic is not None:
        vlm = checkpoint_is_vision_language(opts.model.path)
        kind = "a vision-language" if vlm else "an audio-language"
        raise ValueError(
            f"estimator=gae trains a critic, which is not supported with {kind} actor "
            f"({opts.model.path}): use a critic-free estimator (grpo, rloo, reinforce_pp, ...)"
        )
