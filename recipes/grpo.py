"""GRPO-family reinforcement fine-tuning (RLVR and RLHF), with PPO and a critic as one option.

    lightrft run grpo --config tiny/arith_grpo
    lightrft run --nproc_per_node 8 grpo --config <config> optimizer.lr=1e-6 rollout.n=8

One step, as data flows (every rank runs the same code; the actor, the reference model, the
critic, the rollout engine and the rewards all live in this process):

    prompts (resumable loader) -> engine.wake_up -> engine.generate(n per prompt) -> engine.sleep
    -> rewards (RewardOutput: total + one part per function) -> overlong penalty
    -> dynamic sampling (draw again until enough informative groups) -> reward clip / norm
    -> reference log-probs (frozen copy, only with a KL), old log-probs (trainer, or engine
       log-probs with truncated importance sampling), critic values (gae only)
    -> KL in the reward (optional) -> advantages (any estimator of lightrft.algorithms)
    -> ppo_epochs x mini-batches x micro-batches: policy loss (+ KL in the loss, + entropy bonus),
       global token / sequence counts so accumulation equals one big batch; critic value loss
    -> weight sync into the engine -> log, eval, trajectories, checkpoint -> export at the end

The file reads top to bottom: this recipe's config sections (GRPOConfig; the shared ones, the
run contract and the strategy object come from the library), then GRPORecipe: setup, rollout
(one typed RolloutBatch per step), precompute, advantages, loss (the one function to edit to
change the algorithm), update, eval, the loop. Log-probs never materialise [tokens x vocab]
logits: the fused linear log-prob kernel works on the final hidden states (lightrft.kernels).

One self-contained file: copy it (`lightrft cp grpo my_grpo.py`), edit it, run the copy.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from lightrft import config
from lightrft.algorithms import (
    OBJECTIVES,
    DynamicSamplingAccumulator,
    RunningRewardNormalizer,
    build_kl_controller,
    clip_rewards,
    compute_advantages,
    entropy_bonus,
    estimate_kl,
    high_entropy_mask,
    kl_in_loss,
    kl_in_reward,
    overlong_penalty,
    policy_loss,
    value_loss,
)
from lightrft.algorithms.config import AlgorithmConfig
from lightrft.algorithms.distillation import (
    DistillationConfig,
    check_same_tokenizer,
    distillation_advantages,
)
from lightrft.algorithms.mismatch import mismatch_metrics
from lightrft.config import Component, Section, option, section
from lightrft.data import build_dataloader, collate_prompts, conversation, epoch_batches
from lightrft.distributed import DistInfo, exit_with_parent, sum_over_ranks
from lightrft.engine import Continuation, SamplingParams
from lightrft.engine.config import EngineConfig, RolloutConfig
from lightrft.environments import (
    Episodes,
    build_environment,
    check_environment,
    episode_metrics,
    stop_at_turn_end,
)
from lightrft.evaluation import evaluate_dataset, summarize
from lightrft.kernels import GradHint, response_grad_hint
from lightrft.models.critic import with_value_head
from lightrft.models.forward import causal_lm_token_logprobs, forward_on_hidden
from lightrft.models.loading import load_tokenizer
from lightrft.models.multimodal import (
    check_towers,
    checkpoint_is_multimodal,
    checkpoint_is_vision_language,
    load_processors,
    set_towers_trainable,
)
from lightrft.models.sharded import load_parallel
from lightrft.rewards import Sample, build_reward, reward_names
from lightrft.rollout import RolloutBatch
from lightrft.rollout.engine import ColocatedEngine
from lightrft.rollout.metrics import (
    RewardSideMetrics,
    rollout_metrics,
    step_metrics,
    write_trajectories,
)
from lightrft.rollout.micro import MicroBatch, build_micro_batch, rank_micro_batches
from lightrft.rollout.partial import PartialRollouts
from lightrft.rollout.remote import (
    GENERATOR,
    TRAINER,
    Evaluated,
    Generated,
    GeneratorError,
    RolloutLink,
    Start,
    WeightSender,
    generator_rank,
    leave_trainer_world,
)
from lightrft.sections import (
    PolicyModelConfig,
    ScheduleConfig,
    check_model_path,
    check_optimizer,
    check_sequence_parallel_checkpoint,
)
from lightrft.strategy import build_strategy
from lightrft.training import (
    MetricAccumulator,
    PhaseTimer,
    ProgressBar,
    optimizer_step,
    warmup_cosine_scheduler,
)
from lightrft.training.export import ExportSpec
from lightrft.training.run import TrainingConfig, TrainingRun, training_run

# ---------------------------------------------------------------------------------- config


@section
class CriticConfig(Section):
    """``critic:`` (gae only): a value model from an HF backbone, with its own optimizer."""

    path: str | None = option(None, doc="default model.path")
    optimizer: Component | None = option(None, doc="required when the section is there")
    lr_scheduler: ScheduleConfig = option(default_factory=ScheduleConfig, doc="")
    clip_grad_norm: float | None = option(None, doc="")


@section
class TrainConfig(Section):
    """``train:``: how a step's samples are cut into optimizer and micro-batches."""

    ppo_epochs: int = option(1, ge=1, doc="passes over the step's samples")
    mini_batch_size: int | None = option(None, ge=1, doc="samples per optimizer step (all ranks)")
    micro_batch_size: int = option(ge=1, doc="samples per forward/backward per rank (at most)")
    micro_batch_tokens: int | None = option(None, ge=1, doc="and at most this many tokens")
    packing: bool = option(False, doc="samples back to back in one row")
    shuffle: bool = option(True, doc="shuffle the samples between mini-batches")


@section
class GRPOEvalConfig(Section):
    """``eval:``: greedy accuracy on ``eval_dataset`` at the start, every N steps, at the end."""

    every: int | None = option(None, ge=1, doc="evaluate every this many steps")
    at_start: bool | None = option(None, doc="evaluate before the first step; default true")
    temperature: float | None = option(None, ge=0, doc="default 0: greedy")
    max_tokens: int | None = option(None, ge=1, doc="default rollout.max_tokens")
    accuracy_reward: str | None = option(None, doc="the reward function whose > 0 is correct")


@section
class RolloutEngineConfig(EngineConfig):
    """``engine:``: the library's engine section, and what the engine frees between rollouts."""

    sleep_level: Literal[0, 1, 2] = option(1, doc="1: free the KV cache, 2: the weights too")


@section
class GRPOConfig(TrainingConfig):
    """The whole config: the library's shared sections, then this recipe's own."""

    model: PolicyModelConfig = option(doc="the policy")
    dataset: Component = option(doc="prompts: lightrft.data.PromptDataset")
    eval_dataset: Component | None = option(None, doc="held-out prompts for greedy eval")
    reward: Component = option(doc="a CombinedReward or a single reward function")
    engine: RolloutEngineConfig = option(default_factory=RolloutEngineConfig, doc="")
    rollout: RolloutConfig = option(doc="")
    algorithm: AlgorithmConfig = option(doc="")
    critic: CriticConfig | None = option(None, doc="")
    train: TrainConfig = option(doc="")
    max_steps: int = option(ge=1, doc="RL steps")
    eval: GRPOEvalConfig = option(default_factory=GRPOEvalConfig, doc="")
    trajectories: bool = option(False, doc="write every sample to trajectories/step_N.jsonl")
    trajectory_tokens: bool = option(
        False,
        doc="trajectory lines add per-token text, entropy, trainer and engine log-probs and "
        "advantages (for `lightrft view`; large, and one more forward pass per step)",
    )
    environment: Component | None = option(
        None, doc="multi-turn: builds one Environment per trajectory (ToolEnvironment + tools)"
    )
    distillation: DistillationConfig | None = option(
        None, doc="on-policy distillation: a frozen teacher grades every sampled token"
    )
    CHECKPOINT_MODELS: ClassVar[tuple[str, ...]] = ("model", "policy")

    def global_batch(self, world: int) -> int:
        return self.rollout.prompts_per_step  # all ranks together, whatever their number

    def resolve(self, at: str) -> GRPOConfig:
        """Every default that depends on another key and every rule across sections."""
        super().resolve(at)
        ro = self.rollout
        if ro.asynchronous:  # before the engine's device rule: it names the async key
            _check_asynchronous(self)
        self.engine.check_device(self.run.device, self.engine.sleep_level)
        alg = self.algorithm.for_rollout(ro.sampling())
        critic = self._critic()
        ev = self.eval
        if self.trajectory_tokens and not self.trajectories:
            raise ValueError(
                "trajectory_tokens: true adds to the trajectory files: set trajectories: true"
            )
        if ev.is_set() and self.eval_dataset is None:
            raise ValueError("the eval section needs an eval_dataset")
        names = reward_names(self.reward)  # a CombinedReward's parts
        if ev.accuracy_reward is not None and ev.accuracy_reward not in names:
            raise ValueError(
                f"eval.accuracy_reward={ev.accuracy_reward!r} is not a reward function; they "
                f"are {names}"
            )
        ev = replace(
            ev,
            at_start=ev.at_start is not False,
            temperature=float(ev.temperature or 0.0),
            max_tokens=ev.max_tokens or ro.max_tokens,
        )
        for key, schedule in (
            ("lr_scheduler.", self.optim.lr_scheduler),
            ("critic.lr_scheduler.", critic.lr_scheduler if critic else None),
        ):
            if schedule is not None:
                schedule.check_steps(self.max_steps, key)
        if critic is not None and self.strategy.sequence_parallel > 1:
            raise ValueError(
                f"sequence_parallel={self.strategy.sequence_parallel} does not support a GAE "
                "critic (estimator=gae) yet; set sequence_parallel=1 or another estimator"
            )
        opts = replace(self, algorithm=alg, critic=critic, eval=ev)
        _check_partial(opts)
        _check_media(opts, prepare=self.run.prepare)
        if (d := opts.distillation) is not None:
            check_model_path(d.path, "distillation.path", prepare=self.run.prepare)
        m = opts.model
        check_environment(opts.environment, m.path, trust_remote_code=m.trust_remote_code)
        return opts

    def _critic(self) -> CriticConfig | None:
        critic, estimator = self.critic, self.algorithm.advantage.estimator
        if estimator != "gae":
            if self.algorithm.value.is_set() or (critic is not None and critic.is_set()):
                raise ValueError(
                    f"algorithm.value and critic train a critic, used only by estimator=gae "
                    f"(estimator is {estimator!r}); remove them"
                )
            return None
        if critic is None or critic.optimizer is None:
            raise ValueError(
                "estimator=gae needs a critic: add a `critic:` section with its optimizer"
            )
        check_optimizer(critic.optimizer, "critic.optimizer")
        return replace(critic, path=critic.path or self.model.path)


def _check_off_policy(opts: GRPOConfig, key: str, *, engine: str, episodes: str, samples: str):
    """The rules of every setting that trains on samples the native engine drew under older
    weights (partial rollouts' carried tokens, asynchronous rollout's batches); ``key`` names the
    setting, the other arguments say why each rule holds for it."""
    if opts.engine.backend != "native":
        raise ValueError(
            f"{key} needs engine.backend=native ({engine}), got engine.backend="
            f"{opts.engine.backend}: use engine.backend=native"
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


def _check_partial(opts: GRPOConfig) -> None:
    """Partial rollouts (``rollout.partial.token_budget``) with what they cannot work with."""
    key = "rollout.partial.token_budget"
    if opts.rollout.partial.token_budget is None:
        return
    _check_off_policy(
        opts,
        key,
        engine="the engine that cuts and resumes rows",
        episodes="a multi-turn row cannot be cut",
        samples="carried tokens were sampled by older weights",
    )
    if opts.algorithm.shaping.dynamic:
        raise ValueError(
            f"{key} and algorithm.shaping.dynamic_sampling both decide which groups a step "
            "trains on; use one"
        )


def _check_asynchronous(opts: GRPOConfig) -> None:
    """What one-step-off rollout (``rollout.asynchronous``) cannot run with."""
    key = "rollout.asynchronous=true"
    _check_off_policy(
        opts,
        key,
        engine="it generates in a process of its own; the others are colocated only",
        episodes="the generating process does not play multi-turn episodes",
        samples="it trains on samples of an older policy",
    )
    if opts.rollout.partial.token_budget is not None:
        raise ValueError(
            f"{key} and rollout.partial.token_budget: the generating process does not carry "
            "cut rows across steps; use one of them"
        )
    if opts.strategy.sequence_parallel > 1:
        raise ValueError(
            f"{key} and sequence_parallel={opts.strategy.sequence_parallel}: the sequence-"
            "parallel groups span every process, and one of them generates; use one of them"
        )


def _check_media(opts: GRPOConfig, *, prepare=None, loading: bool = False) -> None:
    """The model paths, then the rules for vision- and audio-language actors and for
    ``sequence_parallel``, from the checkpoint's config.json (cheap; a checkpoint a ``prepare`` step writes is checked again in
    setup, ``loading=True``, before any model loads)."""
    check_model_path(opts.model.path, prepare=prepare, loading=loading)
    if opts.critic is not None and opts.critic.path != opts.model.path:
        check_model_path(opts.critic.path, "critic.path", prepare=prepare, loading=loading)
    check_towers(opts.model)
    check_sequence_parallel_checkpoint(opts.strategy.sequence_parallel, opts.model.path)
    if checkpoint_is_multimodal(opts.model.path) and opts.critic is not None:
        vlm = checkpoint_is_vision_language(opts.model.path)
        kind = "a vision-language" if vlm else "an audio-language"
        raise ValueError(
            f"estimator=gae trains a critic, which is not supported with {kind} actor "
            f"({opts.model.path}): use a critic-free estimator (grpo, rloo, reinforce_pp, ...)"
        )


# What `lightrft validate` and `run` check before anything loads (lightrft.config.parse).
CONFIG_SCHEMA = GRPOConfig.schema()
build_options = GRPOConfig.read


# ---------------------------------------------------------------------------------- loss


@dataclasses.dataclass
class LossInputs:
    """One micro-batch as the loss sees it: ``[b, R]`` response-aligned tensors on the device
    (``mask``: sampled response tokens, observations of a multi-turn trajectory left out;
    ``loss_mask``: the tokens the policy loss trains on)."""

    logprobs: torch.Tensor  # current policy, with gradient
    entropy: torch.Tensor | None  # with gradient only when the entropy bonus is on
    mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None  # None: exactly on-policy (ratio 1)
    rollout_logprobs: torch.Tensor | None  # engine log-probs (TIS only)
    ref_logprobs: torch.Tensor | None  # reference model (KL in the loss only)
    values: torch.Tensor | None  # critic, with gradient (gae only)
    old_values: torch.Tensor | None
    returns: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class Counts:
    """Global normalisers of one optimizer step, divided by the world size (gradients are
    averaged over ranks): ``loss`` counts the policy loss's tokens / sequences, ``response``
    every sampled response token / sequence (KL, entropy and value terms). Observation tokens
    of a multi-turn trajectory are in neither: they were not sampled."""

    loss: dict[str, float]
    response: dict[str, float]


# ---------------------------------------------------------------------------------- recipe


class GRPORecipe:
    """Build everything in ``setup``, then ``train``; the run contract is ``run``'s."""

    def __init__(
        self,
        cfg: DictConfig,
        opts: GRPOConfig,
        run: TrainingRun | None,
        dist: DistInfo | None = None,
    ):
        """``run``: the training run (None in the generating process of an asynchronous run,
        which trains nothing and runs alone: ``dist``)."""
        self.cfg, self.opts, self.run = cfg, opts, run
        self.dist = dist if dist is not None else run.dist
        self.link: RolloutLink | None = None  # asynchronous: to the generating process
        self.kl_ctl = None
        if (kl := opts.algorithm.kl) is not None:
            self.kl_ctl = build_kl_controller(
                kl.controller, kl.coef, target=kl.target, horizon=kl.horizon
            )

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        if self.opts.rollout.asynchronous and self.dist.rank == 0:
            # Past the prepare steps: the generator builds its engine and data (and evaluates the
            # initial policy) while this process loads its models.
            ro = self.opts.rollout
            self.link = RolloutLink.connect(TRAINER, ro.generator_timeout_s, ro.generator_timeout_s)
        self._setup_environment()
        self._setup_models()
        if self.opts.rollout.asynchronous:  # the generator holds the only engine
            self.rollout_engine, self.sampling = None, self.opts.rollout.sampling()
        else:
            self._setup_engine()
        # Asynchronous trainers score nothing: the generator builds the rewards (a reward model
        # would load here for nothing) and sends the scores under their names.
        self._setup_rewards_and_data(rewards=not self.opts.rollout.asynchronous)
        self.reward_side = RewardSideMetrics()
        self.partial, self.policy_version = None, 0  # partial rollouts: groups in flight
        self.prompt_queue: list[dict[str, Any]] = []  # drawn prompts not yet in flight
        if (budget := self.opts.rollout.partial.token_budget) is not None:
            self.partial = PartialRollouts(budget // self.dist.world_size)
        self.step, self.epoch = 0, 0
        self.eval_history: list[tuple[int, float, float]] = []
        self.evals_pending = 0  # asynchronous: evaluations the generator has not sent yet
        # (step, eval/env/* means) of this process's evals: not checkpointed, printed at the end.
        self.eval_env_history: list[tuple[int, dict[str, float]]] = []
        state = self.run.resume(**self._state())
        if state is not None:
            self.step, extra = state.step, state.extra
            self.epoch = extra["epoch"]
            self.eval_history = [tuple(e) for e in extra.get("eval_history", [])]
            if self.kl_ctl is not None:
                self.kl_ctl.load_state_dict(extra["kl_ctl"])
            if self.normalizer is not None:
                self.normalizer.load_state_dict(extra["reward_norm"])
            if self.rollout_engine is not None:  # asynchronous: the generator gets them at start
                self.strategy.sync_weights(self.rollout_engine.engine)
        # The step whose policy was evaluated last (or, asynchronous, is being evaluated).
        self.last_eval = self.eval_history[-1][0] if self.eval_history else None
        if self.opts.rollout.asynchronous:
            self._start_generator()
        else:
            self.prompts = epoch_batches(self.loader, self.epoch)  # from the resumed position
        self.logger = self.run.open_logger(self.step, getattr(self.dataset, "stats", None))

    # ------------------------------------------------------------------ asynchronous rollout

    def _start_generator(self) -> None:
        """Trainer side of one-step-off rollout (:mod:`lightrft.rollout.remote`): rank 0 (on the
        link since ``setup`` began) tells the generator where to start; after a resume the
        generator gets the checkpoint's weights first (a resumed run refills the pipeline: its
        first steps lag 0)."""
        if self.dist.rank != 0:
            if self.step:
                self.strategy.sync_weights(None)  # the gathers of rank 0's send
            return
        if self._evaluates_at_start():  # the generator did it while this process set up
            self.evals_pending, self.last_eval = 1, 0
        state = self.loader.state_dict() if self.step else None
        self.link.send(Start(self.step, self.epoch, state), wait=False)
        self.sender = WeightSender(self.link, self.opts.engine.dtype)
        if self.step:
            self._send_weights(self.step, evaluate=False)

    def _send_weights(self, version: int, evaluate: bool) -> None:
        """The policy after ``version`` steps to the generator, through the strategy's weight
        sync (a collective of the trainers; rank 0 sends, without waiting for it to be taken);
        ``evaluate``: the generator evaluates it and sends the metrics later."""
        if evaluate:
            self.evals_pending, self.last_eval = self.evals_pending + 1, version
        if self.link is None:
            self.strategy.sync_weights(None)
            return
        self.link.flush()  # the previous set was taken: at most one set in flight
        self.sender.version, self.sender.evaluate = version, evaluate
        self.strategy.sync_weights(self.sender)

    def _from_generator(self, kinds: tuple[type, ...], what: str) -> Generated | None:
        """Trainer rank 0: the generator's next message of ``kinds``; an evaluation is logged
        (None returned). A failed generator's error names the checkpoint that is kept."""
        try:
            msg = self.link.receive(kinds, what)
        except GeneratorError as e:
            last = self.run.checkpointer.latest()
            kept = f"the last checkpoint, {last}, is kept" if last else "no checkpoint yet"
            raise GeneratorError(f"{e} ({kept})") from e
        if isinstance(msg, Evaluated):
            self.evals_pending -= 1
            self._record_eval(msg.step, msg.metrics)
            return None
        return msg

    def _receive(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, RolloutBatch, dict]:
        """The step's batch from the generator (rank 0 receives, the other trainers get it from
        rank 0); ``rollout/policy_lag``: optimizer steps between its policy and this one."""
        msg: Generated | None = None
        with timer("rollout"):  # what the trainers wait for generation: its exposed part
            if self.link is not None:
                while msg is None:  # the evaluations sent before it are logged
                    msg = self._from_generator(
                        (Generated, Evaluated), f"the samples of step {step}"
                    )
                if msg.step != step:
                    raise RuntimeError(f"the generator sent step {msg.step}, expected {step}")
            if self.dist.world_size > 1:
                box = [msg]
                torch.distributed.broadcast_object_list(box, src=0)
                msg = box[0]
        lag = step - 1 - msg.version
        assert 0 <= lag <= self.opts.rollout.max_staleness, (step, msg.version)
        self.epoch = msg.epoch
        self.loader.load_state_dict(msg.loader_state)  # checkpointed: where a resume starts
        self.reward_names = list(msg.drawn.reward_parts)  # the generator's reward functions
        metrics = {**msg.metrics, "rollout/policy_lag": float(lag)}
        return msg.batch, msg.drawn, metrics

    def setup_generator(self) -> None:
        """The generating process of an asynchronous run: the engine (its own weights, freed
        never), the rewards and the prompt loader; no trainer, no process group."""
        m = self.opts.model
        self.environment, self.tool_schemas = None, None  # refused with asynchronous
        self.processor, self.tokenizer = load_processors(
            m.path, trust_remote_code=m.trust_remote_code
        )
        self.pad_id = self.tokenizer.pad_token_id
        self.strategy = None
        self._setup_engine(sleep_level=0)
        self._setup_rewards_and_data()
        self.reward_side = RewardSideMetrics()
        self.partial = None  # refused with asynchronous

    def generate_ahead(self, link: RolloutLink, start: Start) -> None:
        """Generate step after step from ``start``, ``rollout.max_staleness`` steps ahead of the
        trainers: step ``k``'s samples come from the policy after step ``k - 1 - max_staleness``."""
        self.epoch, version = start.epoch, start.step
        if start.loader_state is not None:
            self.loader.load_state_dict(start.loader_state)
        self.prompts = epoch_batches(self.loader, self.epoch)
        o = self.opts
        if start.step:
            version = self._take_weights(link)
        for step in range(start.step + 1, o.max_steps + 1):
            while version < step - 1 - o.rollout.max_staleness:
                version = self._take_weights(link)
            timer = PhaseTimer()
            batch, drawn, stats = self.rollout(step, timer)
            metrics = {**stats, **self.reward_side.reduce()}
            metrics["time/generate"] = timer.summary().get("time/rollout", 0.0)
            state = self.loader.state_dict()
            msg = Generated(step, version, batch, drawn, metrics, self.epoch, state)
            link.flush()  # the previous step's batch was taken: at most one in flight
            link.send(msg, wait=False)  # the next step generates while this one is taken
        while self._take_weights(link, or_bye=True) is not None:  # the final evaluations
            pass
        link.flush()
        link.answer_bye()

    def _take_weights(self, link: RolloutLink, *, or_bye: bool = False) -> int | None:
        """The generator: load the trainers' next policy; evaluate it when they ask (it stays
        loaded until the next set is taken); its version, None at the trainer's goodbye."""
        got = link.receive_weights(self.rollout_engine.engine, or_bye=or_bye)
        if got is None:
            return None
        version, evaluate = got
        if evaluate:
            self.evaluate_for(link, version)
        return version

    def evaluate_for(self, link: RolloutLink, step: int) -> None:
        """The generator: the held-out evaluation of the loaded policy (the one after ``step``
        steps), sent to the trainers without waiting; it overlaps their training."""
        link.send(Evaluated(step, self.evaluate()), wait=False)

    def _load_model(self, path: str, prepare=None, *, trained: bool = False, **kw) -> nn.Module:
        """Load and shard one model (actor, reference, critic): under torchrun each rank builds
        it on the meta device and reads only its shards (lightrft.models.sharded). The trained
        actor loads as the strategy says (DeepSpeed: whole, partitioned later)."""
        m = self.opts.model
        return load_parallel(
            path,
            dtype=m.dtype,
            device=self.dist.device,
            trust_remote_code=m.trust_remote_code,
            prepare=prepare,
            **kw,
            **(self.strategy.loading() if trained else self.strategy.frozen_loading()),
        )

    def _prepare_actor(self, model: nn.Module) -> nn.Module:
        """Before sharding: freeze (or not) the vision / audio towers, add LoRA adapters."""
        m = self.opts.model
        set_towers_trainable(model, vision=m.train_vision_tower, audio=m.train_audio_tower)
        return self.strategy.adapt(model)

    def _setup_models(self) -> None:
        """Actor (+ optimizer, scheduler), the frozen reference (KL only), the critic (gae)."""
        o, m = self.opts, self.opts.model
        _check_media(o, loading=True)  # the checkpoint exists now, whatever prepare wrote
        self.strategy = build_strategy(o.strategy, self.dist)
        self.strategy.check_model(m.path, trust_remote_code=m.trust_remote_code)
        if (d := o.distillation) is not None:  # refused before any model loads
            check_model_path(d.path, "distillation.path", loading=True)
            rc = m.trust_remote_code
            check_same_tokenizer(load_tokenizer(m.path, trust_remote_code=rc),
                                 load_tokenizer(d.path, trust_remote_code=rc))  # fmt: skip
            self.strategy.check_model(d.path, trust_remote_code=rc)  # fits it like the actor
        self.model = self._load_model(
            m.path,
            self._prepare_actor,
            trained=True,
            activation_checkpointing=m.activation_checkpointing,
            compile=m.compile,
        )
        # A vision- or audio-language actor: datasets take its processor (images / audio +
        # text), the towers are frozen unless model.train_vision_tower / train_audio_tower;
        # everything else is the text path.
        self.processor, self.tokenizer = load_processors(
            m.path, trust_remote_code=m.trust_remote_code, config=self.model.config
        )
        self.pad_id = self.tokenizer.pad_token_id
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(o.optim.optimizer, params)
        # The reference and the critic stay FSDP2-sharded whichever the actor's strategy: one
        # backward of the combined loss reaches both, each reduces its own gradients.
        self.strategy.setup(
            self.model,
            self.optimizer,
            micro_batch_size=o.train.micro_batch_size,
            accum=1,
            clip_grad_norm=o.optim.clip_grad_norm,
        )
        # One scheduler step per RL step (as verl), whatever the number of optimizer steps.
        self.scheduler = warmup_cosine_scheduler(
            self.optimizer,
            warmup_steps=o.optim.lr_scheduler.warmup_steps,
            total_steps=o.max_steps,
            min_lr_ratio=o.optim.lr_scheduler.min_lr_ratio,
        )
        self.ref = None  # with LoRA the reference is the actor with its adapters off
        if o.algorithm.kl is not None and self.strategy.needs_reference_copy:
            # Frozen before sharding: parallelize then gives its LM head a group of its own.
            self.ref = self._load_model(m.path, lambda model: model.requires_grad_(False))
            self.ref.eval()
        self.teacher = None  # frozen and sharded like the reference
        if o.distillation is not None:
            freeze = lambda model: model.requires_grad_(False)  # noqa: E731
            self.teacher = self._load_model(o.distillation.path, freeze).eval()
        self.critic = self.critic_opt = self.critic_sched = None
        if (c := o.critic) is not None:
            self.critic = self._load_model(
                c.path, with_value_head, activation_checkpointing=m.activation_checkpointing
            )
            self.critic_opt = config.instantiate(c.optimizer, self.critic.parameters())
            self.critic_sched = warmup_cosine_scheduler(
                self.critic_opt,
                warmup_steps=c.lr_scheduler.warmup_steps,
                total_steps=o.max_steps,
                min_lr_ratio=c.lr_scheduler.min_lr_ratio,
            )

    def _setup_environment(self) -> None:
        """Before any model loads: the ``environment:`` factory (one environment per
        trajectory), one environment built to check it, the checkpoint's chat template."""
        self.environment, self.tool_schemas = None, None
        if self.opts.environment is not None:
            m = self.opts.model  # a checkpoint a prepare step wrote exists now
            check_environment(self.opts.environment, m.path, trust_remote_code=m.trust_remote_code)
            self.environment = functools.partial(config.instantiate, self.opts.environment)
            self.tool_schemas = build_environment(self.environment).schemas or None

    def _setup_engine(self, sleep_level: int | None = None) -> None:
        o = self.opts
        engine = o.engine.build(
            o.model.path, self.tokenizer, device=self.dist.device, seed=o.run.seed
        )
        level = o.engine.sleep_level if sleep_level is None else sleep_level
        self.rollout_engine = ColocatedEngine(engine, self.strategy, level)
        self.sampling = o.rollout.sampling()
        if self.environment is not None:
            self.sampling = stop_at_turn_end(self.sampling, self.tokenizer, self.tool_schemas)

    def _setup_rewards_and_data(self, rewards: bool = True) -> None:
        """The reward functions (``rewards``; an asynchronous trainer has none, it takes the
        names with each batch), the reward normaliser, the datasets and the prompt loader."""
        o = self.opts
        self.reward_fn = build_reward(o.reward) if rewards else None
        self.reward_names = list(getattr(self.reward_fn, "functions", {}) or [])
        self.normalizer = None
        if o.algorithm.shaping.reward_norm:
            self.normalizer = RunningRewardNormalizer(clip=o.algorithm.shaping.reward_clip)
        self.dataset = config.instantiate(o.dataset, self.processor)
        # The engine's prompt limit (asynchronous trainers have no engine: their loader never
        # draws, it only keeps the generator's position).
        if self.rollout_engine is not None and hasattr(self.dataset, "fit_to_engine"):
            engine = self.rollout_engine.engine
            if limit := getattr(engine, "max_model_len", None) or o.engine.max_model_len:
                self.dataset.fit_to_engine(limit)
        # Asynchronous: one process draws every prompt of a step; the trainers keep the same
        # loader only for its position (checkpointed), which the generator sends with a batch.
        rank, world = (0, 1) if o.rollout.asynchronous else (self.dist.rank, self.dist.world_size)
        self.loader = build_dataloader(
            self.dataset,
            batch_size=o.rollout.prompts_per_step // world,
            shuffle=True,
            seed=o.run.seed,
            collate_fn=collate_prompts,
            rank=rank,
            world_size=world,
            drop_last=True,
        )
        self.eval_dataset = None
        if o.eval_dataset is not None:
            self.eval_dataset = config.instantiate(o.eval_dataset, self.processor)

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds: the actor (and its optimizer, as the strategy keeps them),
        the critic, the schedulers and the prompt loader."""
        actor = self.strategy.checkpoint_state()
        if self.critic is None:
            return {**actor, "schedulers": self.scheduler, "dataloaders": self.loader}
        named = {k: {"policy": v} for k, v in actor.items()}
        named["models"]["critic"] = self.critic
        named.setdefault("optimizers", {})["critic"] = self.critic_opt
        scheds = {"policy": self.scheduler, "critic": self.critic_sched}
        return {**named, "schedulers": scheds, "dataloaders": self.loader}

    # ------------------------------------------------------------------ rollout

    def _request_params(self, count: int, step: int, draw: int) -> list[SamplingParams]:
        """One seed per request, a pure function of (seed, step, draw, the prompt's place in
        the step over all ranks): rank r of W holds the step's prompts r, r + W, ... (the
        loader's order), so it takes those seeds of one stream. A resumed run samples what the
        uninterrupted run sampled, also on another number of processes, and a run on W
        processes samples what one process would (one process draws the stream it always did).
        """
        world = self.dist.world_size
        gen = torch.Generator().manual_seed(
            ((self.opts.run.seed * 1_000_003 + step) * 1_009 + draw) * 1_013
        )
        seeds = torch.randint(0, 2**62, (count * world,), generator=gen)
        seeds = seeds[self.dist.rank :: world].tolist()
        return [dataclasses.replace(self.sampling, seed=s) for s in seeds]

    def _score(self, prompts, texts, references, labels, wheres, conversations) -> tuple:
        """Rewards of this rank's samples: ``(total [B], parts, applied)``, float64 (exactly the
        python floats the reward functions returned). ``conversations``: each sample's prompt as
        its chat with its images (:func:`~lightrft.data.conversation`), for reward models."""
        if not texts and not self.reward_fn.collective:  # a sharded RM needs every rank
            empty = torch.zeros(0, dtype=torch.float64)
            names = self.reward_names
            return empty, {n: empty for n in names}, {n: empty.bool() for n in names}
        out = self.reward_fn(Sample.batch(prompts, texts, references, labels, conversations))
        out.check_finite(prompts, wheres)
        self.reward_side.add(out)
        return out.as_float64()

    def _draw(self, step: int, draw: int, timer: PhaseTimer) -> RolloutBatch:
        """One rollout draw: this rank's prompts, n samples each, scored; then gathered so every
        rank holds every sample (groups stay consecutive and whole)."""
        episodes, groups = None, None
        if self.partial is not None:
            prompts, completions, groups = self._partial_generate(step, timer)
            count = len(prompts.get("prompt_ids", []))
        else:
            self.epoch, prompts = next(self.prompts)  # this rank's, epoch after epoch
            count = len(prompts["prompt_ids"])
            with timer("rollout"):
                params = self._request_params(count, step, draw)
                prompt_ids, continuation = prompts["prompt_ids"], None
                if self.environment is not None:  # multi-turn: the first prompt names the tools
                    items = [{k: v[i] for k, v in prompts.items()} for i in range(count)]
                    episodes = Episodes(
                        self.environment, items, self.opts.rollout.n, self.tokenizer
                    )
                    prompt_ids, continuation = episodes.prompt_ids, episodes.continuation
                completions = self.rollout_engine.generate(
                    prompt_ids, params, prompts.get("media"), continuation
                )
        rows = [c.request_index for c in completions]
        meta = {k: [prompts[k][i] for i in rows] for k in ("prompt", "reference", "label", "where")}
        messages = prompts.get("messages") or [None] * count
        media = prompts.get("media") or [None] * count
        chats = [conversation(messages[i], media[i]) for i in rows]
        texts = [c.text or "" for c in completions]
        done = None
        if episodes is not None:
            # Verifiers score the final answer (the last assistant turn); reward models read
            # the whole conversation before it, with the answer as the response.
            done = episodes.finish(completions)
            texts = [e.final_text for e in done]
            chats = [e.conversation() for e in done]
        with timer("scoring"):
            raw, parts, applied = self._score(
                meta["prompt"], texts, meta["reference"], meta["label"], meta["where"], chats
            )
            if done is not None:  # per-turn rewards join the outcome reward
                raw = raw + torch.tensor([e.stats.reward for e in done], dtype=torch.float64)
            overlong, rewards, ov = None, raw, self.opts.algorithm.shaping.overlong
            if ov.buffer is not None:  # the section is set
                lengths = [len(c.token_ids) for c in completions]
                penalty = overlong_penalty(lengths, ov.max_len, ov.buffer, ov.factor)
                overlong = torch.tensor([float(p) for p in penalty], dtype=torch.float64)
                rewards = raw + overlong  # [B]
        batch = RolloutBatch.from_completions(
            completions,
            prompts,
            groups=groups or [(step, draw, self.dist.rank, i) for i in rows],
            reward_raw=raw,
            rewards=rewards,
            overlong=overlong,
            reward_parts=parts,
            reward_applied=applied,
        )
        batch.episodes = done
        return batch.all_gather()

    def _partial_generate(self, step: int, timer: PhaseTimer) -> tuple[dict, list, list]:
        """Partial rollouts: top the groups in flight up to this rank's prompts per step with
        new prompts, generate under the token budget, and return the groups that finished (the
        prompt loader's fields, their completions, each row's group key); ``self.partial_stats``
        says what the step carried."""
        per_rank = self.opts.rollout.prompts_per_step // self.dist.world_size
        added, params = 0, self._request_params(per_rank, step, 0)
        while len(self.partial.groups) < per_rank:
            if not self.prompt_queue:
                self.epoch, batch = next(self.prompts)
                count = len(batch["prompt_ids"])
                self.prompt_queue += [{k: v[i] for k, v in batch.items()} for i in range(count)]
            item = self.prompt_queue.pop(0)
            self.partial.add(item, params[added], (step, 0, self.dist.rank, added))
            added += 1
        with timer("rollout"):
            done, self.partial_stats = self.partial.step(self.rollout_engine, self.policy_version)
        return PartialRollouts.completions(done)

    def rollout(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, RolloutBatch, dict]:
        """The step's train batch (after dynamic sampling), every sample drawn (to log, with
        ``kept`` set) and the dynamic-sampling metrics."""
        o, shaping = self.opts, self.opts.algorithm.shaping
        stats: dict[str, float] = {}
        if not shaping.dynamic:
            drawn = self._draw(step, 0, timer)
            keep = list(range(len(drawn)))
            if self.partial is not None:
                stats.update(self.partial_stats.metrics())
        else:
            acc = DynamicSamplingAccumulator(
                o.rollout.prompts_per_step,
                o.rollout.n,
                max_draws=shaping.dynamic_sampling.draws,
            )
            draws: list[RolloutBatch] = []
            while not acc.done:
                d = self._draw(step, len(draws), timer)
                start = sum(len(b) for b in draws)
                acc.add(list(range(start, start + len(d))), d.rewards.float())
                draws.append(d)
            drawn = RolloutBatch.cat(draws)
            keep, stats = acc.take()
        self.rollout_engine.sleep()
        drawn.kept = torch.zeros(len(drawn), dtype=torch.bool)
        drawn.kept[keep] = True
        return drawn.select(keep), drawn, stats

    # ------------------------------------------------------------------ forward passes

    def _policy_logprobs(
        self,
        model,
        mb,
        *,
        entropy: bool,
        entropy_grad: bool = False,
        grad_hint: GradHint | None = None,
    ):
        mb = mb.to(self.dist.device)
        out = causal_lm_token_logprobs(
            model,
            mb.input_ids,
            targets=mb.targets,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            temperature=self.opts.rollout.temperature,
            return_entropy=entropy,
            entropy_grad=entropy_grad,
            grad_hint=grad_hint,
            media=mb.media,
            sequence_parallel=self.strategy.sequence_parallel,  # this rank's slice of the row
        )
        if entropy:
            return mb.gather(out[0]), mb.gather(out[1])
        return mb.gather(out), None

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        def head(hidden, weight, bias):
            return F.linear(hidden, weight, bias).squeeze(-1).float()  # [rows, L-1]

        mb = mb.to(self.dist.device)
        out = forward_on_hidden(
            self.critic,
            mb.input_ids,
            head,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
        )
        return mb.gather(out)

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        tr = self.opts.train
        lengths = (batch.prompt_lens + batch.response_lens).tolist()
        # The ranks of one sequence-parallel group train on the same rows.
        data = self.strategy.data_dist
        return rank_micro_batches(
            rows, lengths, tr.micro_batch_size, tr.micro_batch_tokens, tr.packing, data
        )

    @torch.no_grad()
    def precompute(self, batch: RolloutBatch, timer: PhaseTimer) -> None:
        """Old log-probs, entropy, reference log-probs and values of every sample, in place.

        Each rank computes its shard in micro-batches; a sum over ranks of the zero-filled
        ``[B, R]`` tensors gives every rank the whole batch (advantages and the high-entropy
        quantile are computed over the whole batch)."""
        o, alg = self.opts, self.opts.algorithm
        exact_on_policy = o.train.ppo_epochs == 1 and (
            o.train.mini_batch_size is None or o.train.mini_batch_size >= len(batch)
        )
        kl_reward = alg.kl is not None and alg.kl.placement == "reward"
        need_old = alg.old_logprobs == "trainer" and (
            not exact_on_policy or alg.tis.mode is not None or kl_reward
        )
        need_entropy = alg.entropy.top_rho is not None
        # trajectory_tokens: the trainer's log-probs and entropy before the update, for the
        # trajectory files only. Kept apart from batch.old_logprobs, whose presence changes
        # the loss (None means exactly on-policy), so the switch changes no trained number.
        need_tokens = o.trajectory_tokens and not (need_old and need_entropy)
        # An external engine's samples: the trainer's log-probs for rollout/mismatch/* (one
        # forward more) when no other pass gives them.
        need_mismatch = o.engine.backend != "native" and not need_old
        jobs = [
            ("old_logprobs", self.model, need_old or need_entropy),
            ("mismatch", self.model, need_mismatch),
            ("reference", self.ref if self.ref is not None else self.model, alg.kl is not None),
            ("teacher", self.teacher, self.teacher is not None),
            ("values", self.critic, self.critic is not None),
            ("trajectories", self.model, need_tokens),
        ]
        micro = self._micro_batches(batch, list(range(len(batch))))
        self.token_stats: dict[str, torch.Tensor] = {}
        for name, model, flag in jobs:
            if not flag:
                continue
            model.eval()
            outs: dict[str, torch.Tensor] = {}
            # The strategy's reference: the frozen base under LoRA, else a no-op.
            reference = self.strategy.reference() if name == "reference" else nullcontext()
            with timer(name), reference:
                for idx in micro:
                    mb = build_micro_batch(batch, idx, self.pad_id, packing=o.train.packing)
                    if name == "values":
                        found = {"values": self._values(mb)}
                    elif name == "trajectories":
                        lp, ent = self._policy_logprobs(model, mb, entropy=True)
                        found = {"token_logprobs": lp, "token_entropy": ent}
                    elif name == "mismatch":
                        found = {
                            "token_mismatch": self._policy_logprobs(model, mb, entropy=False)[0]
                        }
                    else:
                        lp, ent = self._policy_logprobs(
                            model, mb, entropy=name == "old_logprobs" and need_entropy
                        )
                        found = {"entropy": ent} if ent is not None else {}
                        if name in ("reference", "teacher"):
                            found[f"{'ref' if name == 'reference' else name}_logprobs"] = lp
                        elif need_old:
                            found["old_logprobs"] = lp
                    for field, t in found.items():
                        buf = outs.setdefault(field, torch.zeros(batch.response_ids.shape))
                        if idx and self.strategy.writes_shared:  # once per SP group
                            buf[idx, : t.shape[1]] = t.float().cpu()
            if model is not self.ref and model is not self.teacher:
                model.train()
            for field, buf in outs.items():
                if field.startswith("token_"):
                    self.token_stats[field[len("token_") :]] = sum_over_ranks(buf)
                else:
                    setattr(batch, field, sum_over_ranks(buf))
        if o.trajectory_tokens and not need_tokens:  # the old log-prob pass had both
            self.token_stats = {"logprobs": batch.old_logprobs, "entropy": batch.entropy}

    def _mismatch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """``rollout/mismatch/*``: the engine's log-probs against the trainer's pre-update
        ones, where the step has them (always with an external engine)."""
        trainer = batch.old_logprobs
        if trainer is None:
            trainer = self.token_stats.pop("mismatch", None)
        if trainer is None:
            return {}
        return mismatch_metrics(trainer, batch.rollout_logprobs, batch.response_mask)

    # ------------------------------------------------------------------ advantages

    def advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Reward clip / normalisation, KL in the reward, then the configured estimator;
        fills ``batch.advantages`` (and ``returns``, ``loss_mask``)."""
        alg, metrics = self.opts.algorithm, {}
        rewards = batch.rewards.float()  # [B]
        if self.normalizer is not None:
            rewards = self.normalizer(rewards)
        elif alg.shaping.reward_clip is not None:
            rewards = clip_rewards(rewards, alg.shaping.reward_clip)
        mask = batch.response_mask  # [B, R] sampled tokens: observations get no advantage
        token_rewards = None
        if alg.kl is not None and alg.kl.placement == "reward":
            old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
            kl = estimate_kl(old, batch.ref_logprobs, alg.kl.estimator)  # [B, R]
            token_rewards, kl_metrics = kl_in_reward(rewards, kl, mask, self.kl_ctl.coef)
            metrics["train/kl"] = float(kl_metrics["kl"])
        adv, returns = compute_advantages(
            alg.advantage.estimator,
            mask=mask,
            rewards=rewards,
            token_rewards=token_rewards,
            values=batch.values,
            group_size=self.opts.rollout.n,
            **alg.advantage.options(),
        )  # [B, R]
        if (d := self.opts.distillation) is not None:  # the teacher grades every sampled token
            own = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
            task = adv if d.reward_weight else None
            adv, dm = distillation_advantages(
                own, batch.teacher_logprobs, mask, task, d.reward_weight
            )
            metrics["train/distill/reverse_kl"] = float(dm["reverse_kl"])
        zero = torch.zeros((), dtype=torch.float32)
        batch.advantages = torch.where(mask, adv.float(), zero)
        if returns is not None:
            batch.returns = torch.where(mask, returns.float(), zero)
        valid = adv[mask]
        metrics["train/advantage/mean"] = float(valid.mean()) if valid.numel() else 0.0
        metrics["train/advantage/abs_mean"] = float(valid.abs().mean()) if valid.numel() else 0.0
        if alg.entropy.top_rho is not None:
            batch.loss_mask = high_entropy_mask(batch.entropy, mask, alg.entropy.top_rho) & mask
            frac = batch.loss_mask.sum() / mask.sum().clamp_min(1)
            metrics["train/high_entropy_frac"] = float(frac)
        return metrics

    # ------------------------------------------------------------------ loss

    def loss(self, mb: LossInputs, counts: Counts) -> tuple[torch.Tensor, dict[str, Any]]:
        """The whole loss of one micro-batch: edit this to change the algorithm.

        Policy loss (the configured objective), + entropy bonus, + KL to the reference, + the
        critic's value loss. Returns the sum to backpropagate and metrics (``actor_loss``: the
        policy-side total, logged as ``train/loss``)."""
        alg = self.opts.algorithm
        tis = {}
        if alg.tis.mode is not None:
            tis = {"rollout_logprobs": mb.rollout_logprobs, "tis_mode": alg.tis.mode}
            tis["tis_cap"] = self.opts.algorithm.tis_cap
        loss, pm = policy_loss(
            mb.logprobs,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            **alg.policy_loss.kwargs(),
            **counts.loss,
            **tis,
        )
        metrics: dict[str, Any] = {"policy_loss": loss.detach(), **pm}
        pl = alg.policy_loss
        norm = {"agg": pl.agg, "norm_len": pl.norm_len, **counts.response}
        if alg.entropy.coef:
            term, _ = entropy_bonus(mb.entropy, mb.mask, alg.entropy.coef, **norm)
            loss = loss + term
        if mb.entropy is not None:
            ent = mb.entropy.detach()
            metrics["entropy"] = (ent * mb.mask).sum() / mb.mask.sum().clamp_min(1)
        if mb.ref_logprobs is not None:
            kl = estimate_kl(mb.logprobs, mb.ref_logprobs, alg.kl.estimator)
            term, km = kl_in_loss(kl, mb.mask, self.kl_ctl.coef, **norm)
            loss = loss + term
            metrics["kl"] = km["kl"]
            metrics["kl_loss"] = term.detach()
        metrics["actor_loss"] = loss.detach()
        if mb.values is not None:
            vloss, vm = value_loss(
                mb.values,
                mb.old_values,
                mb.returns,
                mb.mask,
                clip=self.opts.algorithm.value_clip,
                num_tokens=counts.response["num_tokens"],
            )
            loss = loss + vloss
            metrics.update({"value_loss": vloss.detach(), **vm})
        return loss, metrics

    def _loss_inputs(
        self, batch: RolloutBatch, idx: list[int], mb: MicroBatch, counts: Counts
    ) -> LossInputs:
        """The micro-batch's forward passes and ``[b, R]`` slices of the rollout batch."""
        alg, dev = self.opts.algorithm, self.dist.device
        mask = mb.mask.to(dev)  # [b, R] sampled response tokens
        width = mask.shape[1]
        zeros = torch.zeros(mask.shape, device=dev)

        def rows(t: torch.Tensor | None, *, fallback: torch.Tensor | None = None):
            if not idx:  # a rank without data: a dummy row the mask zeroes out
                return fallback
            return None if t is None else t[idx, :width].to(dev)

        kl_loss = alg.kl is not None and alg.kl.placement == "loss"
        old = batch.rollout_logprobs if alg.old_logprobs == "engine" else batch.old_logprobs
        data = LossInputs(
            logprobs=zeros,  # the policy's, below
            entropy=None,
            mask=mask,
            loss_mask=mask if batch.loss_mask is None else rows(batch.loss_mask, fallback=mask),
            advantages=rows(batch.advantages, fallback=zeros),
            old_logprobs=rows(old),
            rollout_logprobs=rows(batch.rollout_logprobs) if alg.tis.mode else None,
            ref_logprobs=rows(batch.ref_logprobs, fallback=zeros) if kl_loss else None,
            values=None,
            old_values=None,
            returns=None,
        )
        # Entropy with a gradient only for the bonus; otherwise a cheap no-grad value to log.
        lp, ent = self._policy_logprobs(
            self.model,
            mb,
            entropy=True,
            entropy_grad=bool(alg.entropy.coef),
            grad_hint=self._grad_hint(data, counts, mb),
        )  # [b, R]
        values = self._values(mb) if self.critic is not None else None
        return dataclasses.replace(
            data,
            logprobs=lp,
            entropy=ent,
            values=values,
            old_values=None if values is None else rows(batch.values, fallback=values.detach()),
            returns=None if values is None else rows(batch.returns, fallback=values.detach()),
        )

    def _grad_hint(self, data: LossInputs, counts: Counts, mb: MicroBatch) -> GradHint | None:
        """For a per-token objective (ppo, cpgd; the KL and entropy terms are per token too),
        the loss's gradient w.r.t. a chunk of log-probs follows from their values, so the fused
        kernel computes the LM-head gradients during the forward (3 vocabulary-sized matmuls
        instead of 4) from :meth:`loss` itself. If an edited :meth:`loss` is not per token, the
        kernel notices in backward, warns and recomputes exactly."""
        alg = self.opts.algorithm
        if not OBJECTIVES[alg.policy_loss.objective].per_token:
            return None  # gspo, gmpo: a token's gradient depends on its whole sequence
        if self.strategy.sequence_parallel is not None:
            return None  # the log-probs are gathered over the SP group: no per-slice hint
        if data.old_logprobs is None and alg.tis.mode == "sequence_mask":
            return None  # sequence weights from the current log-probs (not reached: TIS has old)

        def loss(logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
            inputs = dataclasses.replace(data, logprobs=logprobs, entropy=entropy)
            return self.loss(inputs, counts)[0]

        return response_grad_hint(
            loss,
            mb.index.to(self.dist.device),
            data.mask,
            mb.targets.numel(),
            entropy_grad=bool(alg.entropy.coef),
        )

    # ------------------------------------------------------------------ update

    def _counts(self, batch: RolloutBatch, rows: list[int]) -> Counts:
        world = self.dist.world_size
        mask = batch.response_mask[rows]  # [m, R]
        lmask = mask if batch.loss_mask is None else batch.loss_mask[rows]
        return Counts(
            loss={
                "num_tokens": int(lmask.sum()) / world,
                "num_seqs": int(lmask.any(dim=1).sum()) / world,
            },
            response={"num_tokens": int(mask.sum()) / world, "num_seqs": len(rows) / world},
        )

    def _order(self, n: int, step: int, epoch: int) -> list[int]:
        if not self.opts.train.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.opts.run.seed * 7_919 + step * 131 + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def update(self, batch: RolloutBatch, step: int, timer: PhaseTimer) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches; one optimizer step per mini-batch."""
        o, n = self.opts, len(batch)
        mbs = min(o.train.mini_batch_size or n, n)
        # The loss terms are each micro-batch's part of the mini-batch's term (normalised by the
        # mini-batch's counts over all ranks, / world): they add up, like ``loss``. A weighted
        # mean of them would shrink with the number of micro-batches and grow with the ranks.
        terms = ("policy_loss", "kl_loss", "value_loss")
        acc = MetricAccumulator(
            {
                "ratio_min": "min",
                "ratio_max": "max",
                "loss": "sum",
                "tokens": "sum",
                **dict.fromkeys(terms, "sum"),
            },
            empty={"ratio_min": 1.0, "ratio_max": 1.0},
        )
        grad_norms, critic_norms = [], []
        for epoch in range(o.train.ppo_epochs):
            order = self._order(n, step, epoch)
            for start in range(0, n, mbs):
                mini = order[start : start + mbs]
                counts = self._counts(batch, mini)
                loss_sum = 0.0
                # Similar lengths share a micro-batch: less padding, same gradient (the loss is
                # normalised by the counts of the whole mini-batch).
                for idx in self._micro_batches(batch, mini):
                    with timer("training"):
                        mb = build_micro_batch(batch, idx, self.pad_id, packing=o.train.packing)
                        inputs = self._loss_inputs(batch, idx, mb, counts)
                        total, metrics = self.loss(inputs, counts)
                        self.strategy.backward(total)
                    loss_sum += float(metrics.pop("actor_loss"))
                    acc.add("tokens", mb.tokens)
                    weight = float(mb.mask.sum())  # the micro-batch's sampled tokens
                    for k, v in metrics.items():
                        acc.add(k, v, weight)
                with timer("training"):
                    grad_norms.append(self.strategy.step())
                    if self.critic is not None:
                        norm = o.critic.clip_grad_norm or None
                        critic_norms.append(optimizer_step(self.critic, self.critic_opt, norm))
                acc.add("loss", loss_sum)
        reduced = acc.reduce()
        metrics = {f"train/{k}": v for k, v in reduced.items()}
        # Each rank's loss is its part of sum / (global count / world): the sum over ranks is
        # world x the loss of the whole mini-batch (x the SP degree: an SP group's ranks all
        # compute their micro-batch's loss, from the gathered log-probs).
        per = self.dist.world_size * self.strategy.sequence_parallel_size * len(grad_norms)
        metrics["train/loss"] = reduced["loss"] / per
        for k in terms:
            if k in reduced:
                metrics[f"train/{k}"] = reduced[k] / per
        metrics["train/tokens"] = reduced["tokens"] / self.strategy.sequence_parallel_size
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["train/grad_norm_max"] = max(grad_norms)
        metrics["train/optimizer_steps"] = float(len(grad_norms))
        if critic_norms:
            metrics["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
        return metrics

    # ------------------------------------------------------------------ eval

    def evaluate(self) -> dict[str, float]:
        """Greedy (``eval.temperature`` 0) generation on the held-out prompts, scored and summarised
        by the same code as the eval recipe (lightrft.evaluation); each rank takes every
        world_size-th prompt and the records of all ranks are summarised together."""
        ev = self.opts.eval
        params = dataclasses.replace(
            self.sampling,
            n=1,
            temperature=ev.temperature,
            first_token_temperature=None,
            max_tokens=ev.max_tokens,
            seed=self.opts.run.seed,
        )
        name = ev.accuracy_reward or (self.reward_names[0] if self.reward_names else None)

        def generate(
            prompt_ids: list[list[int]], items: list, continuation: Continuation | None
        ) -> list:
            media = [it.get("media") for it in items]
            completions = self.rollout_engine.generate(prompt_ids, params, media, continuation)
            self.rollout_engine.sleep()  # the engine's memory goes back before scoring
            return completions

        # With an environment the held-out prompts are played with the tools, as in training,
        # and the final answers are scored.
        records = evaluate_dataset(
            self.eval_dataset,
            generate,
            self.reward_fn,
            1,
            self.dist,
            accuracy=name,
            environment=self.environment,
            tokenizer=self.tokenizer,
        )
        s = summarize(records, [1])
        out = {
            "eval/accuracy": s["pass@1"],
            "eval/reward": s["reward"],
            "eval/response_length": s["response_length"],
            "eval/samples": s["prompts"],
        }
        for k in self.reward_names:
            out[f"eval/reward/{k}"] = s[f"reward/{k}"]
        # With an environment: the held-out episodes' env/* means (tool use, errors by kind).
        out.update({f"eval/{k}": v for k, v in s.items() if k.startswith("env/")})
        return out

    def _evaluates_at_start(self) -> bool:
        """The initial policy is evaluated (a resumed run's was already)."""
        return (
            self.eval_dataset is not None and self.opts.eval.at_start and not self.opts.run.resume
        )

    def _evaluates_after(self, step: int) -> bool:
        """The policy after ``step`` is evaluated in the loop (the last step's in ``_finish``)."""
        every = self.opts.eval.every
        return bool(self.eval_dataset is not None and every and step % every == 0) and (
            step != self.opts.max_steps
        )

    def _log_eval(self, step: int) -> None:
        self.last_eval = step
        self._record_eval(step, self.evaluate())

    def _record_eval(self, step: int, m: dict[str, float]) -> None:
        self.logger.log(step, m)
        self.eval_history.append((step, m["eval/accuracy"], m["eval/reward"]))
        if "eval/env/tool_use_frac" in m:
            self.eval_env_history.append((step, {k: v for k, v in m.items() if "/env/" in k}))

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        o = self.opts
        bar = ProgressBar(o.max_steps, initial=self.step, desc="grpo")
        timer = PhaseTimer(cuda_sync=self.dist.device.type == "cuda")
        # Asynchronous: the generator evaluates (the initial policy while this process set up).
        if self._evaluates_at_start() and not o.rollout.asynchronous:
            with timer("eval"):
                self._log_eval(0)
            timer.reset()
        for step in self.run.steps(self.step, o.max_steps, save=self._save):
            metrics = self.step_once(step, timer)
            bar.update(1, reward=metrics["reward/total/mean"])
            if self._evaluates_after(step) and not o.rollout.asynchronous:
                self._log_eval(step)
        bar.close()
        self._finish()

    def step_once(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        """One RL step: rollout, scoring, advantages, update, schedules, weight sync, logging."""
        t0 = time.perf_counter()
        if self.opts.rollout.asynchronous:
            batch, drawn, metrics = self._receive(step, timer)
        else:
            batch, drawn, metrics = self.rollout(step, timer)
            metrics.update(self.reward_side.reduce())
        metrics.update(rollout_metrics(drawn, batch, self.reward_names))
        if drawn.episodes is not None:
            sampled = int(drawn.response_mask.sum())
            metrics.update(episode_metrics(drawn.episodes, int(drawn.response_lens.sum()), sampled))
        self.token_stats = {}
        if len(batch):
            self.precompute(batch, timer)
            metrics.update(self._mismatch_metrics(batch))
            metrics.update(self.advantages(batch))
            metrics.update(self.update(batch, step, timer))
        else:  # dynamic sampling found no informative group: no update, no NaN
            metrics["train/skipped"] = 1.0
        self._step_schedules(metrics, len(batch))
        if self.opts.rollout.asynchronous:
            # The versions the generator samples from (it stops at max_steps) or evaluates.
            evaluate = self._evaluates_after(step)
            if evaluate or step <= self.opts.max_steps - 1 - self.opts.rollout.max_staleness:
                with timer("weight_sync"):
                    self._send_weights(step, evaluate)
        elif len(batch):  # weights changed (released weights are reloaded by the next rollout)
            with timer("weight_sync"):
                self.rollout_engine.sync()
            self.policy_version += 1
        self.step = step
        if self.opts.trajectories and self.dist.is_main:
            with timer("trajectories"):
                write_trajectories(
                    self.run.output_dir / "trajectories",
                    step,
                    drawn,
                    batch,
                    decode=self._decode_tokens if self.opts.trajectory_tokens else None,
                    token_stats=self.token_stats,
                )
        elapsed = time.perf_counter() - t0
        phases = timer.summary()
        metrics.update(step_metrics(drawn, phases, elapsed, metrics, self.dist.device))
        if "time/generate" in metrics:  # asynchronous: the generator's own time, not the wait
            tokens = metrics["perf/rollout_tokens_per_s"] * max(metrics["time/rollout"], 1e-9)
            metrics["perf/rollout_tokens_per_s"] = tokens / max(metrics["time/generate"], 1e-9)
        if self.opts.trajectory_tokens:  # its extra forward pass and the token files
            metrics["time/trajectories"] = phases.get("time/trajectories", 0.0)
        if self.run.should_log(step, self.opts.max_steps):
            self.logger.log(step, metrics)
        return metrics

    def _decode_tokens(self, rows: list[list[int]]) -> list[str]:
        """The trajectory files' token pieces: every token shown, special ones too."""
        return self.tokenizer.batch_decode(
            rows, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _step_schedules(self, metrics: dict[str, float], batch_size: int) -> None:
        """The KL controller (one place, whichever the KL placement) and the LR schedules."""
        if self.kl_ctl is not None:
            if "train/kl" in metrics:
                self.kl_ctl.update(metrics["train/kl"], batch_size)
            metrics["train/kl_coef"] = self.kl_ctl.coef
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            # A skipped update still advances the schedule: the LR is a function of the step.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
            if self.critic_sched is not None:
                self.critic_sched.step()

    def _finish(self) -> None:
        final_eval = self.eval_dataset is not None and self.last_eval != self.step
        if final_eval and self.opts.rollout.asynchronous:
            self._send_weights(self.step, evaluate=True)  # evaluated while this one exports
        elif final_eval:
            self._log_eval(self.step)
        final = self.run.output_dir / "final"
        self.strategy.export(self.processor, final)
        if self.link is not None:
            while self.evals_pending:
                self._from_generator((Evaluated,), "its evaluations")
            self.link.bye()
        if self.dist.is_main and self.eval_history:
            first, last = self.eval_history[0], self.eval_history[-1]
            print(
                f"grpo: eval/accuracy {first[1]:.3f} (step {first[0]}) -> {last[1]:.3f} "
                f"(step {last[0]}); eval/reward {first[2]:.3f} -> {last[2]:.3f}; "
                f"final model in {final}"
            )
        if self.dist.is_main and self.eval_env_history:
            (s0, e0), (s1, e1) = self.eval_env_history[0], self.eval_env_history[-1]
            errors = [
                f"{k.removeprefix('eval/env/errors/')} {e0[k]:.3f} -> {e1[k]:.3f}"
                for k in sorted(e1)
                if k.startswith("eval/env/errors/") and (e0.get(k) or e1[k])
            ]
            print(
                f"grpo: held-out tool use (step {s0} -> {s1}): eval/env/tool_use_frac "
                f"{e0['eval/env/tool_use_frac']:.3f} -> {e1['eval/env/tool_use_frac']:.3f}; "
                f"errors per episode: {', '.join(errors) or 'none'}"
            )

    def _save(self) -> None:
        extra: dict[str, Any] = {"epoch": self.epoch, "eval_history": self.eval_history}
        if self.kl_ctl is not None:
            extra["kl_ctl"] = self.kl_ctl.state_dict()
        if self.normalizer is not None:
            extra["reward_norm"] = self.normalizer.state_dict()
        # What `lightrft export` needs to turn this checkpoint into the run's final/.
        name = "model" if self.critic is None else "policy"
        spec = ExportSpec.of("causal_lm", self.opts.model, self.opts.strategy, name=name)
        self.run.save(self.step, **self._state(), extra=extra, export=spec.to_json())


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: GRPOConfig) -> None:
    if opts.rollout.asynchronous:  # the last process generates, the others train
        if int(os.environ["RANK"]) == generator_rank():
            return generate(cfg, opts)
        leave_trainer_world()
    with training_run(cfg, opts.run) as run:
        recipe = GRPORecipe(cfg, opts, run)
        recipe.setup(cfg)
        recipe.train()


def generate(cfg: DictConfig, opts: GRPOConfig) -> None:
    """The generating process of an asynchronous run (no process group but the link)."""
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()  # a torchrun worker: do not outlive the launcher
    torch.manual_seed(opts.run.seed)
    # It joins at once and waits for the trainers' prepare steps (which may write the model and
    # data it reads), then sets up while they set up; the waits for the trainers (join, then
    # their setup and resume) are bounded by the run's collective_timeout_s, else torch's 30
    # minutes; every later wait by generator_timeout_s.
    join = opts.run.collective_timeout_s or 1800.0
    link = RolloutLink.connect(GENERATOR, opts.rollout.generator_timeout_s, join)
    device = torch.device(opts.run.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recipe = GRPORecipe(cfg, opts, None, DistInfo(0, 1, 0, device))
    recipe.setup_generator()
    if recipe._evaluates_at_start():
        recipe.evaluate_for(link, 0)  # the initial weights: the checkpoint the engine loaded
    start = link.receive(Start, "the trainer's start", timeout_s=join)
    recipe.generate_ahead(link, start)


if __name__ == "__main__":
    sys.exit(recipe_main())
