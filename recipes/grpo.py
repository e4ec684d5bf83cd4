"""GRPO-family reinforcement fine-tuning (RLVR and RLHF), with PPO and a critic as one option.

    lightrft run grpo --config tiny/arith_grpo
    lightrft run --nproc_per_node 8 grpo --config <config> optimizer.lr=1e-6 rollout.n=8

One step, as data flows (every rank runs the same code):

    rollout = source.next(step): prompts -> engine.generate(n per prompt) -> rewards -> overlong
       penalty -> dynamic sampling (lightrft.rollout; one typed Rollout whatever the mode)
    -> precompute: reference log-probs (with a KL), old log-probs (trainer, or the engine's with
       truncated importance sampling), critic values (gae only)
    -> advantages(): reward clip / norm, KL in the reward (optional), any estimator
    -> update: ppo_epochs x mini-batches x micro-batches of loss() (policy loss + KL in the loss
       + entropy bonus + value loss), global token / sequence counts so accumulation equals one
       big batch
    -> source.publish (weight sync) -> eval, log, trajectories, checkpoint -> export at the end

The file reads top to bottom in that order, after its config sections; edit `loss` and
`advantages` to change the algorithm. Log-probs never materialise [tokens x vocab] logits.

One self-contained file: copy it (`lightrft cp grpo my_grpo.py`), edit it, run the copy.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import warnings
from contextlib import nullcontext
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from lightrft import config
from lightrft.algorithms import (
    OBJECTIVES,
    RunningRewardNormalizer,
    build_kl_controller,
    clip_rewards,
    compute_advantages,
    entropy_bonus,
    estimate_kl,
    high_entropy_mask,
    kl_in_loss,
    kl_in_reward,
    policy_loss,
    value_loss,
)
from lightrft.algorithms.config import AlgorithmConfig
from lightrft.algorithms.distillation import (
    DistillationConfig,
    distillation_advantages,
)
from lightrft.config import Component, Section, option, section
from lightrft.distributed import sum_over_ranks
from lightrft.engine.config import RolloutConfig
from lightrft.environments import check_environment
from lightrft.evaluation import EvalHistory
from lightrft.kernels import (
    GradHint,
    response_grad_hint,
)
from lightrft.models.critic import with_value_head
from lightrft.models.multimodal import load_processors
from lightrft.rollout.batch import Advantages, Precomputed, RolloutBatch, TrainBatch
from lightrft.rollout.build import (
    HeldOutEvalConfig,
    build_parts,
    evaluates_after,
    evaluates_at_start,
    generates_here,
    open_source,
    serve_rollouts,
)
from lightrft.rollout.engine import RolloutEngineConfig
from lightrft.rollout.metrics import step_metrics, update_metrics, write_trajectories
from lightrft.rollout.micro import (
    Counts,
    LossInputs,
    MicroBatch,
    build_micro_batch,
    rank_micro_batches,
    shuffled,
)
from lightrft.rollout.rules import check_models, check_rollout
from lightrft.rollout.source import turns_for
from lightrft.sections import PolicyModelConfig, ScheduleConfig, check_optimizer
from lightrft.strategy import build_strategy
from lightrft.training import (
    MetricAccumulator,
    PhaseTimer,
    ProgressBar,
    lr_scheduler,
    optimizer_step,
)
from lightrft.training.export import ExportSpec
from lightrft.training.plan import check_teacher_fits
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
    eval: HeldOutEvalConfig = option(default_factory=HeldOutEvalConfig, doc="")
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
        check_rollout(self)  # the modes' rules, before the engine's device rule names its key
        self.engine.check_device(self.run.device, self.engine.sleep_level)
        alg = self.algorithm.for_rollout(self.rollout.sampling())
        critic = self._critic()
        if self.trajectory_tokens and not self.trajectories:
            raise ValueError(
                "trajectory_tokens: true adds to the trajectory files: set trajectories: true"
            )
        ev = self.eval.resolved(self)
        self.optim.lr_scheduler.check_steps(self.max_steps)
        opts = dataclasses.replace(self, algorithm=alg, critic=critic, eval=ev)
        check_models(opts, prepare=self.run.prepare)
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
        critic.lr_scheduler.check_steps(self.max_steps, "critic.lr_scheduler.")
        return dataclasses.replace(critic, path=critic.path or self.model.path)


# What `lightrft validate` and `run` check before anything loads (lightrft.config.parse).
CONFIG_SCHEMA = GRPOConfig.schema()
build_options = GRPOConfig.read


# ---------------------------------------------------------------------------------- recipe


class GRPORecipe:
    """Build everything in ``setup``, then ``train``; the run contract is ``run``'s."""

    def __init__(self, cfg: DictConfig, opts: GRPOConfig, run: TrainingRun):
        self.cfg, self.opts, self.run, self.dist = cfg, opts, run, run.dist
        self.kl_ctl = None
        if (kl := opts.algorithm.kl) is not None:
            self.kl_ctl = build_kl_controller(
                kl.controller, kl.coef, target=kl.target, horizon=kl.horizon
            )

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        o = self.opts
        # The rollout source (lightrft.rollout): draws, scores and shapes each step's samples.
        self.source = open_source(
            o, self.dist, record_eval=self._record_eval, checkpointer=self.run.checkpointer
        )
        # Before any model loads: the ``environment:`` section's transform (or single turn).
        self.turns = turns_for(o.environment, o.model)
        self._setup_models()
        self.normalizer = None
        if o.algorithm.shaping.reward_norm:
            self.normalizer = RunningRewardNormalizer(clip=o.algorithm.shaping.reward_clip)
        self.source.build(
            self.strategy,
            lambda: build_parts(
                o, self.dist, self.processor, self.tokenizer, self.strategy, self.turns
            ),
            lambda: config.instantiate(o.dataset, self.processor),
        )
        self.step, epoch = 0, 0
        self.evals = EvalHistory()
        state = self.run.resume(**self._state())
        if state is not None:
            self.step, extra = state.step, state.extra
            epoch = extra["epoch"]
            self.evals = EvalHistory(extra.get("eval_history", []))
            if self.kl_ctl is not None:
                self.kl_ctl.load_state_dict(extra["kl_ctl"])
            if self.normalizer is not None:
                self.normalizer.load_state_dict(extra["reward_norm"])
        # The step whose policy was evaluated last (or is being evaluated).
        self.last_eval = self.evals.history[-1][0] if self.evals.history else None
        if evaluate := evaluates_at_start(self.opts):
            self.last_eval = 0
        self.source.start(self.step, epoch, evaluate=evaluate)
        self.logger = self.run.open_logger(
            self.step, getattr(self.source.loader.dataset, "stats", None)
        )

    def _setup_models(self) -> None:
        """Actor (+ optimizer, scheduler), the frozen reference (KL only), the critic (gae)."""
        o, m = self.opts, self.opts.model
        check_models(o, loading=True)  # the checkpoints exist now, whatever prepare wrote
        self.strategy = build_strategy(o.strategy, self.dist)
        for path in (m.path, *([o.distillation.path] if o.distillation else [])):
            self.strategy.check_model(path, trust_remote_code=m.trust_remote_code)  # it fits
        check_teacher_fits(o, self.dist.device, self.dist.world_size)  # in memory, as planned
        # Towers trainable as model.train_vision_tower / train_audio_tower say, LoRA adapters;
        # under torchrun each rank reads only its shards (lightrft.models.sharded).
        self.model = self.strategy.load_policy(m)
        # A vision- or audio-language actor: datasets take its processor (images / audio +
        # text); everything else is the text path. Renders pass model.chat_template_args.
        self.processor, self.tokenizer = load_processors(
            m.path,
            trust_remote_code=m.trust_remote_code,
            config=self.model.config,
            template_args=m.chat_template_args,
        )
        self.pad_id = self.tokenizer.pad_token_id
        # How the trainer scores tokens: at the sampling temperature, on its sequence slice.
        self.lp_kw = {
            "temperature": o.rollout.temperature,
            "sequence_parallel": self.strategy.sequence_parallel,
        }
        # The trajectory files' token pieces: every token shown, special ones too.
        self._decode = functools.partial(
            self.tokenizer.batch_decode,
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        # The reference and the critic stay FSDP2-sharded whichever the actor's strategy: one
        # backward of the combined loss reaches both, each reduces its own gradients.
        self.optimizer = self.strategy.setup(
            self.model, o.optim, micro_batch_size=o.train.micro_batch_size, accum=1
        )
        # One scheduler step per RL step (as verl), whatever the number of optimizer steps.
        self.scheduler = lr_scheduler(self.optimizer, o.optim.lr_scheduler, o.max_steps)
        self.ref = None  # with LoRA the reference is the actor with its adapters off
        if o.algorithm.kl is not None and self.strategy.needs_reference_copy:
            # Frozen before sharding: parallelize then gives its LM head a group of its own.
            self.ref = self.strategy.load_beside(m.path, m)
        self.teacher = None  # frozen and sharded like the reference
        if o.distillation is not None:
            self.teacher = self.strategy.load_beside(o.distillation.path, m)
        self.critic = self.critic_opt = self.critic_sched = None
        if (c := o.critic) is not None:
            self.critic = self.strategy.load_beside(
                c.path, m, with_value_head, activation_checkpointing=m.activation_checkpointing
            )
            self.critic_opt = config.instantiate(c.optimizer, self.critic.parameters())
            self.critic_sched = lr_scheduler(self.critic_opt, c.lr_scheduler, o.max_steps)

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds: the actor (and its optimizer, as the strategy keeps them),
        the critic, the schedulers and the prompt loader."""
        actor = self.strategy.checkpoint_state()
        if self.critic is None:
            return {**actor, "schedulers": self.scheduler, "dataloaders": self.source.loader}
        named = {k: {"policy": v} for k, v in actor.items()}
        named["models"]["critic"] = self.critic
        named.setdefault("optimizers", {})["critic"] = self.critic_opt
        scheds = {"policy": self.scheduler, "critic": self.critic_sched}
        return {**named, "schedulers": scheds, "dataloaders": self.source.loader}

    # ------------------------------------------------------------------ forward passes

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        tr = self.opts.train
        lengths = (batch.prompt_lens + batch.response_lens).tolist()
        # The ranks of one sequence-parallel group train on the same rows.
        data = self.strategy.data_dist
        return rank_micro_batches(
            rows, lengths, tr.micro_batch_size, tr.micro_batch_tokens, tr.packing, data
        )

    @torch.no_grad()
    def precompute(
        self, batch: RolloutBatch, timer: PhaseTimer
    ) -> tuple[Precomputed, dict[str, float]]:
        """Old log-probs, entropy, reference log-probs and values of every sample, and the
        ``rollout/mismatch/*`` metrics.

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
        # trajectory files only. Kept apart from the old log-probs, whose presence changes
        # the loss (None means exactly on-policy), so the switch changes no trained number.
        need_tokens = o.trajectory_tokens and not (need_old and need_entropy)
        # An external engine's samples: the trainer's log-probs for rollout/mismatch/* (one
        # forward more) when no other pass gives them.
        need_mismatch = (o.engine.backend != "native" or alg.mismatch.is_set()) and not need_old
        # Each pass: its model, whether it runs, with entropy, and the fields its log-probs and
        # entropy fill (``token_*``: the trajectory files' and rollout/mismatch/*'s only).
        ref = self.ref if self.ref is not None else self.model
        old = "old_logprobs" if need_old else None  # the entropy pass's log-probs: not kept
        jobs = [
            ("old_logprobs", self.model, need_old or need_entropy, need_entropy, old, "entropy"),
            ("mismatch", self.model, need_mismatch, False, "token_mismatch", None),
            ("reference", ref, alg.kl is not None, False, "ref_logprobs", None),
            ("teacher", self.teacher, self.teacher is not None, False, "teacher_logprobs", None),
            ("values", self.critic, self.critic is not None, False, "values", None),
            ("trajectories", self.model, need_tokens, True, "token_logprobs", "token_entropy"),
        ]
        micro, dev = self._micro_batches(batch, list(range(len(batch)))), self.dist.device
        outs: dict[str, torch.Tensor] = {}  # each field's [B, R] rows, this rank's filled in
        for name, model, flag, entropy, lp_field, ent_field in jobs:
            if not flag:
                continue
            model.eval()
            # The strategy's reference: the frozen base under LoRA, else a no-op.
            reference = self.strategy.reference() if name == "reference" else nullcontext()
            with timer(name), reference:
                for idx in micro:
                    mb = build_micro_batch(batch, idx, self.pad_id, packing=o.train.packing)
                    if name == "values":
                        lp, ent = mb.values(model, dev), None
                    else:
                        lp, ent = mb.logprobs(model, dev, entropy=entropy, **self.lp_kw)
                    found = ((lp_field, lp), (ent_field, ent))
                    for field, t in ((f, t) for f, t in found if f and t is not None):
                        buf = outs.setdefault(field, torch.zeros(batch.response_ids.shape))
                        if idx and self.strategy.writes_shared:  # once per SP group
                            buf[idx, : t.shape[1]] = t.float().cpu()
            if model is not self.ref and model is not self.teacher:
                model.train()
        whole = {field: sum_over_ranks(buf) for field, buf in outs.items()}  # every rank's rows
        pre = Precomputed(**{k: v for k, v in whole.items() if not k.startswith("token_")})
        self.token_stats = {
            k[len("token_") :]: v for k, v in whole.items() if k.startswith("token_")
        }
        if o.trajectory_tokens and not need_tokens:  # the old log-prob pass had both
            self.token_stats = {"logprobs": pre.old_logprobs, "entropy": pre.entropy}
        # rollout/mismatch/*: the engine's log-probs against the trainer's pre-update ones,
        # where the step has them (always with an external engine or algorithm.mismatch), and
        # the tokens algorithm.mismatch's corrections keep.
        trainer = self.token_stats.pop("mismatch", pre.old_logprobs)
        if trainer is None:
            return pre, {}
        keep, metrics = alg.mismatch.apply(trainer, batch.rollout_logprobs, batch.response_mask)
        return dataclasses.replace(pre, keep=keep), metrics

    # ------------------------------------------------------------------ advantages

    def advantages(
        self, batch: RolloutBatch, pre: Precomputed
    ) -> tuple[Advantages, dict[str, float]]:
        """Reward clip / normalisation, KL in the reward, then the configured estimator;
        ``Advantages`` (and ``returns``, ``loss_mask``) and their metrics."""
        alg, metrics = self.opts.algorithm, {}
        rewards = batch.rewards.float()  # [B]
        if self.normalizer is not None:
            rewards = self.normalizer(rewards)
        elif alg.shaping.reward_clip is not None:
            rewards = clip_rewards(rewards, alg.shaping.reward_clip)
        mask = batch.response_mask  # [B, R] sampled tokens: observations get no advantage
        own = pre.old_logprobs if pre.old_logprobs is not None else batch.rollout_logprobs
        token_rewards = None
        if alg.kl is not None and alg.kl.placement == "reward":
            kl = estimate_kl(own, pre.ref_logprobs, alg.kl.estimator)  # [B, R]
            token_rewards, kl_metrics = kl_in_reward(rewards, kl, mask, self.kl_ctl.coef)
            metrics["train/kl"] = float(kl_metrics["kl"])
        adv, returns = compute_advantages(
            alg.advantage.estimator,
            mask=mask,
            rewards=rewards,
            token_rewards=token_rewards,
            values=pre.values,
            group_size=self.opts.rollout.n,
            **alg.advantage.options(),
        )  # [B, R]
        if (d := self.opts.distillation) is not None:  # the teacher grades every sampled token
            task = adv if d.reward_weight else None
            adv, dm = distillation_advantages(
                own, pre.teacher_logprobs, mask, task, d.reward_weight
            )
            metrics["train/distill/reverse_kl"] = float(dm["reverse_kl"])
        zero = torch.zeros((), dtype=torch.float32)
        if returns is not None:
            returns = torch.where(mask, returns.float(), zero)
        valid = adv[mask]
        metrics["train/advantage/mean"] = float(valid.mean()) if valid.numel() else 0.0
        metrics["train/advantage/abs_mean"] = float(valid.abs().mean()) if valid.numel() else 0.0
        loss_mask = pre.keep  # algorithm.mismatch's kept tokens (None: all)
        if alg.entropy.top_rho is not None:
            high = high_entropy_mask(pre.entropy, mask, alg.entropy.top_rho) & mask
            metrics["train/high_entropy_frac"] = float(high.sum() / mask.sum().clamp_min(1))
            loss_mask = high if loss_mask is None else high & loss_mask
        return Advantages(torch.where(mask, adv.float(), zero), returns, loss_mask), metrics

    # ------------------------------------------------------------------ loss

    def loss(self, mb: LossInputs, counts: Counts) -> tuple[torch.Tensor, dict[str, Any]]:
        """The whole loss of one micro-batch: edit this to change the algorithm.

        Policy loss (the configured objective), + entropy bonus, + KL to the reference, + the
        critic's value loss. Returns the sum to backpropagate and metrics (``actor_loss``: the
        policy-side total, logged as ``train/loss``)."""
        alg = self.opts.algorithm
        loss, pm = policy_loss(
            mb.logprobs,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            **vars(alg.policy_loss),  # every key is an argument of policy_loss
            **counts.loss,
            rollout_logprobs=mb.rollout_logprobs,  # None (no TIS) unless algorithm.tis.mode
            tis_mode=alg.tis.mode,
            tis_cap=alg.tis_cap,
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
        self, train: TrainBatch, idx: list[int], mb: MicroBatch, counts: Counts
    ) -> LossInputs:
        """The micro-batch's forward passes and ``[b, R]`` slices of the step's tensors."""
        batch, pre, adv = train
        alg, dev = self.opts.algorithm, self.dist.device
        mask = mb.mask.to(dev)  # [b, R] sampled response tokens
        width = mask.shape[1]
        zeros = torch.zeros(mask.shape, device=dev)

        def rows(t: torch.Tensor | None, *, fallback: torch.Tensor | None = None):
            if not idx:  # a rank without data: a dummy row the mask zeroes out
                return fallback
            return None if t is None else t[idx, :width].to(dev)

        kl_loss = alg.kl is not None and alg.kl.placement == "loss"
        old = batch.rollout_logprobs if alg.old_logprobs == "engine" else pre.old_logprobs
        data = LossInputs(
            logprobs=zeros,  # the policy's, below
            mask=mask,
            loss_mask=mask if adv.loss_mask is None else rows(adv.loss_mask, fallback=mask),
            advantages=rows(adv.advantages, fallback=zeros),
            old_logprobs=rows(old),
            rollout_logprobs=rows(batch.rollout_logprobs) if alg.tis.mode else None,
            ref_logprobs=rows(pre.ref_logprobs, fallback=zeros) if kl_loss else None,
        )
        # Entropy with a gradient only for the bonus; otherwise a cheap no-grad value to log.
        lp, ent = mb.logprobs(
            self.model,
            dev,
            entropy=True,
            entropy_grad=bool(alg.entropy.coef),
            grad_hint=self._grad_hint(data, counts, mb),
            **self.lp_kw,
        )  # [b, R]
        values = mb.values(self.critic, dev) if self.critic is not None else None
        return dataclasses.replace(
            data,
            logprobs=lp,
            entropy=ent,
            values=values,
            old_values=None if values is None else rows(pre.values, fallback=values.detach()),
            returns=None if values is None else rows(adv.returns, fallback=values.detach()),
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

    def update(self, train: TrainBatch, step: int, timer: PhaseTimer) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches; one optimizer step per mini-batch."""
        o, batch = self.opts, train.batch
        n = len(batch)
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
            order = shuffled(n, o.run.seed * 7_919 + step * 131 + epoch, o.train.shuffle)
            for start in range(0, n, mbs):
                mini = order[start : start + mbs]
                counts = Counts.of(batch, mini, self.dist.world_size, train.advantages.loss_mask)
                loss_sum = 0.0
                # Similar lengths share a micro-batch: less padding, same gradient (the loss is
                # normalised by the counts of the whole mini-batch).
                for idx in self._micro_batches(batch, mini):
                    with timer("training"):
                        mb = build_micro_batch(batch, idx, self.pad_id, packing=o.train.packing)
                        inputs = self._loss_inputs(train, idx, mb, counts)
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
        sp = o.strategy.sequence_parallel  # the ranks of one SP group
        return update_metrics(
            acc.reduce(), terms, grad_norms, critic_norms, self.dist.world_size, sp
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

    # ------------------------------------------------------ publish, eval, log, checkpoint

    def _record_eval(self, step: int, m: dict[str, float]) -> None:
        self.logger.log(step, m)
        self.evals.add(step, m)

    def _save(self) -> None:
        extra: dict[str, Any] = {"epoch": self.source.epoch, "eval_history": self.evals.history}
        if self.kl_ctl is not None:
            extra["kl_ctl"] = self.kl_ctl.state_dict()
        if self.normalizer is not None:
            extra["reward_norm"] = self.normalizer.state_dict()
        # What `lightrft export` needs to turn this checkpoint into the run's final/.
        name = "model" if self.critic is None else "policy"
        spec = ExportSpec.of("causal_lm", self.opts.model, self.opts.strategy, name=name)
        self.run.save(self.step, **self._state(), extra=extra, export=spec.to_json())

    def _finish(self) -> None:
        if self.opts.eval_dataset is not None and self.last_eval != self.step:
            # A generating process evaluates the last policy during the export.
            self.source.publish(self.step, updated=False, evaluate=True)
            self.source.drain()
        final = self.run.output_dir / "final"
        self.strategy.export(self.processor, final)
        self.source.close()
        for line in self.evals.summary("grpo", final) if self.dist.is_main else []:
            print(line)

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        bar = ProgressBar(self.opts.max_steps, initial=self.step, desc="grpo")
        timer = PhaseTimer(cuda_sync=self.dist.device.type == "cuda")
        self.source.drain()  # the initial policy's evaluation, when due here
        for step in self.run.steps(self.step, self.opts.max_steps, save=self._save):
            metrics = self.step_once(step, timer)
            bar.update(1, reward=metrics["reward/total/mean"])
            self.source.drain()
        bar.close()
        self._finish()

    def step_once(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        """One RL step: rollout, precompute, advantages, update, schedules, publish, logging."""
        t0 = time.perf_counter()
        rollout = self.source.next(step, timer)
        batch, metrics = rollout.batch, dict(rollout.metrics)
        self.token_stats, adv = {}, None
        if len(batch):
            pre, mismatch = self.precompute(batch, timer)
            adv, adv_metrics = self.advantages(batch, pre)
            metrics.update({**mismatch, **adv_metrics})
            metrics.update(self.update(TrainBatch(batch, pre, adv), step, timer))
        else:  # dynamic sampling found no informative group: no update, no NaN
            metrics["train/skipped"] = 1.0
        self._step_schedules(metrics, len(batch))
        evaluate = evaluates_after(self.opts, step)
        with timer("weight_sync"):
            self.source.publish(step, updated=bool(len(batch)), evaluate=evaluate)
        self.last_eval = step if evaluate else self.last_eval
        self.step = step
        if self.opts.trajectories and self.dist.is_main:
            with timer("trajectories"):
                write_trajectories(
                    self.run.output_dir / "trajectories",
                    step,
                    rollout.drawn,
                    batch,
                    advantages=None if adv is None else adv.advantages,
                    decode=self._decode if self.opts.trajectory_tokens else None,
                    token_stats=self.token_stats,
                )
        elapsed = time.perf_counter() - t0
        phases = timer.summary()
        metrics.update(step_metrics(rollout.drawn, phases, elapsed, metrics, self.dist.device))
        if self.opts.trajectory_tokens:  # its extra forward pass and the token files
            metrics["time/trajectories"] = phases.get("time/trajectories", 0.0)
        if self.run.should_log(step, self.opts.max_steps):
            self.logger.log(step, metrics)
        return metrics


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: GRPOConfig) -> None:
    if generates_here(opts.rollout):  # this process draws the samples the others train on
        return serve_rollouts(opts)
    with training_run(cfg, opts.run) as run:
        recipe = GRPORecipe(cfg, opts, run)
        recipe.setup(cfg)
        recipe.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
