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

Log-probs never materialise [tokens x vocab] logits: they come from the fused linear log-prob
kernel over the final hidden states (lightrft.kernels). See docs/grpo.md for every config key.

One self-contained file: copy it (`lightrft cp grpo my_grpo.py`), edit it, run the copy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightrft import config
from lightrft.algorithms import (
    AGG_MODES,
    ESTIMATORS,
    KL_KINDS,
    OBJECTIVES,
    DynamicSamplingAccumulator,
    RunningRewardNormalizer,
    build_kl_controller,
    check_estimator,
    check_objective,
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
from lightrft.config import Component
from lightrft.data import build_dataloader, collate_prompts
from lightrft.engine import NativeEngine, Request, SamplingParams, sync_weights
from lightrft.kernels import causal_lm_token_logprobs, forward_on_hidden
from lightrft.models import load_causal_lm, load_tokenizer, parallelize
from lightrft.rewards import build_reward
from lightrft.training import (
    Checkpointer,
    MetricLogger,
    PhaseTimer,
    ProgressBar,
    check_output_dir,
    clip_grad_norm,
    export_hf,
    peak_memory,
    reduce_metrics,
    warmup_cosine_scheduler,
)
from lightrft.training.distributed import barrier, destroy, init_distributed

DTYPE = Literal["float32", "bfloat16", "float16"]
SCHEDULE = {"warmup_steps": int | None, "min_lr_ratio": float | None}

CONFIG_SCHEMA = {
    "output_dir": str,
    "seed": int | None,
    "device": Literal["cpu", "cuda"] | None,
    "prepare": list[Component] | None,  # run once on rank 0 before anything loads
    "model": {
        "path": str,
        "dtype": DTYPE | None,
        "trust_remote_code": bool | None,
        "activation_checkpointing": bool | None,
        "compile": bool | None,
    },
    "dataset": Component,  # prompts: lightrft.data.PromptDataset
    "eval_dataset": Component | None,  # held-out prompts for greedy eval
    "reward": Component,  # a CombinedReward or a single reward function
    "engine": {
        "backend": Literal["native", "vllm"] | None,
        "dtype": DTYPE | None,
        "max_model_len": int | None,
        "max_num_seqs": int | None,
        "max_prefill_tokens": int | None,
        "max_kv_tokens": int | None,
        "sleep_level": Literal[0, 1, 2] | None,
        "compile": bool | None,
        "gpu_memory_utilization": float | None,  # vllm only
        "tensor_parallel_size": int | None,  # vllm only
    },
    "rollout": {
        "prompts_per_step": int,  # all ranks together
        "n": int,  # samples per prompt (the group)
        "max_tokens": int,
        "temperature": float | None,
        "top_p": float | None,
        "top_k": int | None,
        "first_token_temperature": float | None,
        "stop_token_ids": list[int] | None,
    },
    "algorithm": {
        "advantage": {
            "estimator": Literal[tuple(ESTIMATORS)],
            "eps": float | None,
            "scale": Literal["group", "batch", "none"] | None,
            "weight": Literal["filter", "std", "none"] | None,
            "gamma": float | None,
            "lam": float | None,
        },
        "policy_loss": {
            "objective": Literal[tuple(OBJECTIVES)] | None,
            "clip_low": float | None,
            "clip_high": float | None,
            "dual_clip": float | None,
            "agg": Literal[AGG_MODES] | None,
            "norm_len": int | None,
        },
        "old_logprobs": Literal["trainer", "engine"] | None,
        "tis": {"mode": Literal["token", "sequence_mask"] | None, "cap": float | None},
        "kl": {
            "coef": float | None,
            "estimator": Literal[(*KL_KINDS, "kl", "mse", "low_var_kl")] | None,
            "placement": Literal["loss", "reward"] | None,
            "controller": Literal["fixed", "adaptive"] | None,
            "target": float | None,
            "horizon": float | None,
        },
        "entropy": {"coef": float | None, "top_rho": float | None},
        "value": {"clip": float | None},  # gae only
        "shaping": {
            "reward_norm": bool | None,
            "reward_clip": float | None,
            "overlong": {"max_len": int | None, "buffer": int | None, "factor": float | None},
            "dynamic_sampling": {"enabled": bool | None, "max_draws": int | None},
        },
    },
    "critic": {  # gae only: HF backbone + value head, its own optimizer
        "path": str | None,
        "optimizer": Component | None,  # required when the section is there
        "lr_scheduler": SCHEDULE,
        "clip_grad_norm": float | None,
    },
    "train": {
        "ppo_epochs": int | None,
        "mini_batch_size": int | None,  # samples per optimizer step, all ranks together
        "micro_batch_size": int,  # samples per forward/backward per rank
        "packing": bool | None,
        "shuffle": bool | None,
    },
    "max_steps": int,
    "optimizer": Component,
    "lr_scheduler": SCHEDULE,
    "clip_grad_norm": float | None,
    "eval": {
        "every": int | None,
        "at_start": bool | None,
        "temperature": float | None,
        "max_tokens": int | None,
        "accuracy_reward": str | None,
    },
    "trajectories": bool | None,
    "log_every": int | None,
    "save_every": int | None,
    "keep_last": int | None,
    "resume": bool | None,
    "metrics": {"tensorboard": bool | None, "wandb": bool | dict | None},
}

IGNORE = -100


# ---------------------------------------------------------------------------------- options


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` when present and not null, else ``default`` (node may be None): the one
    rule for a missing value in this recipe, so null always means "use the default"."""
    if node is None:
        return default
    value = node.get(key)
    return default if value is None else value


def _set_keys(node: Any) -> set[str]:
    return {k for k, v in (node or {}).items() if v is not None}


def _at_least(name: str, value: Any, low: float, *, strict: bool = False) -> None:
    if value is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low:g}, got {value}")


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    prompts_per_step: int  # all ranks together
    n: int  # samples per prompt (the group)
    max_tokens: int
    temperature: float = 1.0  # the trainer scores tokens at this temperature too
    top_p: float = 1.0
    top_k: int = 0
    first_token_temperature: float | None = None  # FIRE
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The policy objective (a ``lightrft.algorithms.OBJECTIVES`` entry) and its aggregation."""

    objective: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token_mean"
    norm_len: int | None = None  # seq_mean_token_sum_norm: defaults to rollout.max_tokens
    entropy_coef: float = 0.0  # entropy bonus
    top_rho: float | None = None  # train on the top-rho highest-entropy tokens only
    value_clip: float = 0.5  # gae only

    def policy_kwargs(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "dual_clip": self.dual_clip,
            "agg": self.agg,
            "norm_len": self.norm_len,
        }


@dataclasses.dataclass(frozen=True)
class KLOptions:
    coef: float
    estimator: str = "k3"
    placement: Literal["loss", "reward"] = "loss"
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float | None = None
    horizon: float | None = None


@dataclasses.dataclass(frozen=True)
class ShapingOptions:
    reward_norm: bool = False
    reward_clip: float | None = None
    overlong: tuple[int, int, float] | None = None  # (max_len, buffer, factor)
    dynamic: bool = False
    max_draws: int = 10


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    micro_batch_size: int
    ppo_epochs: int = 1
    mini_batch_size: int | None = None  # samples per optimizer step; None: the whole batch
    packing: bool = False
    shuffle: bool = True


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclasses.dataclass(frozen=True)
class CriticOptions:
    path: str  # defaults to model.path
    schedule: ScheduleOptions
    clip_grad_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    every: int | None = None
    at_start: bool = True
    temperature: float = 0.0
    max_tokens: int | None = None  # defaults to rollout.max_tokens
    accuracy_reward: str | None = None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    backend: Literal["native", "vllm"] = "native"
    sleep_level: int = 1
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # to the engine class


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    path: str
    dtype: str = "float32"
    trust_remote_code: bool = False
    activation_checkpointing: bool = False
    compile: bool = False


@dataclasses.dataclass(frozen=True)
class GRPOOptions:
    """Everything the recipe reads from the config, every default applied, every cross-field
    rule checked. Built by :func:`build_options`; the recipe reads ``opts``, never ``cfg``,
    except for the ``_component_`` nodes it instantiates."""

    output_dir: str
    max_steps: int
    model: ModelOptions
    rollout: RolloutOptions
    estimator: str
    adv_options: dict[str, Any]  # only the keys the config sets: the estimator's own checks
    loss: LossOptions
    old_logprobs: Literal["trainer", "engine"]
    tis_mode: str | None
    tis_cap: float
    kl: KLOptions | None  # None: no KL and no reference model
    shaping: ShapingOptions
    critic: CriticOptions | None  # gae only
    train: TrainOptions
    schedule: ScheduleOptions
    eval: EvalOptions
    engine: EngineOptions
    seed: int = 0
    device: str | None = None
    clip_grad_norm: float | None = None
    trajectories: bool = False
    log_every: int = 1
    save_every: int | None = None
    keep_last: int = 2
    resume: bool = False
    tensorboard: bool = True
    wandb: bool | dict = False


def _rollout_options(cfg: DictConfig) -> RolloutOptions:
    ro = cfg.rollout
    opts = RolloutOptions(
        prompts_per_step=ro.prompts_per_step,
        n=ro.n,
        max_tokens=ro.max_tokens,
        temperature=float(_get(ro, "temperature", 1.0)),
        top_p=float(_get(ro, "top_p", 1.0)),
        top_k=int(_get(ro, "top_k", 0)),
        first_token_temperature=_get(ro, "first_token_temperature"),
        stop_token_ids=tuple(_get(ro, "stop_token_ids", ())),
    )
    for key in ("n", "prompts_per_step", "max_tokens"):
        _at_least(f"rollout.{key}", getattr(opts, key), 1)
    if not opts.temperature > 0:
        raise ValueError(
            f"rollout.temperature must be > 0 (the trainer scores tokens at the sampling "
            f"temperature), got {opts.temperature}"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if opts.prompts_per_step % world:
        raise ValueError(
            f"rollout.prompts_per_step={opts.prompts_per_step} must be a multiple of the "
            f"number of processes ({world})"
        )
    # The SamplingParams' own checks (top_p, top_k, first-token temperature...).
    _sampling(opts).validate()
    return opts


def _sampling(ro: RolloutOptions) -> SamplingParams:
    return SamplingParams(
        n=ro.n,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        max_tokens=ro.max_tokens,
        stop_token_ids=list(ro.stop_token_ids),
        first_token_temperature=ro.first_token_temperature,
    )


def _advantage_options(cfg: DictConfig, group: int) -> tuple[str, dict[str, Any]]:
    adv = cfg.algorithm.advantage
    estimator = adv.estimator
    # Only the options the config sets go to the estimator, which rejects inapplicable ones.
    options = {k: adv[k] for k in _set_keys(adv) - {"estimator"}}
    check_estimator(estimator, options, group_size=group)
    return estimator, options


def _loss_options(cfg: DictConfig, rollout: RolloutOptions) -> LossOptions:
    alg = cfg.algorithm
    pl = alg.get("policy_loss")
    objective = _get(pl, "objective", "ppo")
    defaults = OBJECTIVES[objective].defaults
    agg = _get(pl, "agg", defaults["agg"])
    norm_len = _get(pl, "norm_len")
    if norm_len is not None and agg != "seq_mean_token_sum_norm":
        raise ValueError(
            f"algorithm.policy_loss.norm_len is used only by agg=seq_mean_token_sum_norm "
            f"(agg is {agg!r}); remove it"
        )
    if agg == "seq_mean_token_sum_norm" and norm_len is None:
        # Dr.GRPO divides by a constant: the generation budget, not a per-batch length, so the
        # loss does not depend on how a step is split into micro-batches.
        norm_len = rollout.max_tokens
    ent = alg.get("entropy")
    opts = LossOptions(
        objective=objective,
        clip_low=float(_get(pl, "clip_low", defaults["clip_low"])),
        clip_high=float(_get(pl, "clip_high", defaults["clip_high"])),
        dual_clip=_get(pl, "dual_clip"),
        agg=agg,
        norm_len=norm_len,
        entropy_coef=float(_get(ent, "coef", 0.0)),
        top_rho=_get(ent, "top_rho"),
        value_clip=float(_get(alg.get("value"), "clip", 0.5)),
    )
    _at_least("algorithm.policy_loss.norm_len", norm_len, 1)
    check_objective(**opts.policy_kwargs())
    if opts.top_rho is not None and not 0 < opts.top_rho <= 1:
        raise ValueError(f"algorithm.entropy.top_rho must be in (0, 1], got {opts.top_rho}")
    return opts


def _kl_options(cfg: DictConfig) -> KLOptions | None:
    kl = cfg.algorithm.get("kl")
    if not _set_keys(kl):
        return None
    if kl.get("coef") is None or not kl.coef > 0:
        raise ValueError(
            f"algorithm.kl.coef must be > 0 (got {kl.get('coef')}); remove the algorithm.kl "
            "section to train without a KL and without a reference model"
        )
    opts = KLOptions(
        coef=float(kl.coef),
        estimator=_get(kl, "estimator", "k3"),
        placement=_get(kl, "placement", "loss"),
        controller=_get(kl, "controller", "fixed"),
        target=_get(kl, "target"),
        horizon=_get(kl, "horizon"),
    )
    if opts.controller == "fixed" and _set_keys(kl) & {"target", "horizon"}:
        raise ValueError("algorithm.kl.target / horizon apply to controller=adaptive only")
    # The controller's own checks (target, horizon > 0).
    build_kl_controller(opts.controller, opts.coef, target=opts.target, horizon=opts.horizon)
    return opts


def _sampling_correction(cfg: DictConfig, rollout: RolloutOptions) -> tuple[str, str | None, float]:
    """(old_logprobs source, tis mode, tis cap)."""
    alg = cfg.algorithm
    source = _get(alg, "old_logprobs", "trainer")
    tis = alg.get("tis")
    mode = _get(tis, "mode")
    if mode is None and _set_keys(tis):
        raise ValueError(
            "algorithm.tis.cap is set but algorithm.tis.mode is not: set mode "
            "(token | sequence_mask) or remove the tis section"
        )
    cap = float(_get(tis, "cap", 2.0))
    if mode is not None and source != "trainer":
        raise ValueError(
            "algorithm.tis corrects the engine's log-probs towards the trainer's old "
            "log-probs, so it needs algorithm.old_logprobs=trainer (got engine)"
        )
    _at_least("algorithm.tis.cap", cap, 0, strict=True)
    if rollout.first_token_temperature is not None and (source == "engine" or mode is not None):
        # The engine reports the first token's log-prob at first_token_temperature, the trainer
        # scores every token at rollout.temperature: the first token's ratio would be wrong.
        raise ValueError(
            "rollout.first_token_temperature (FIRE) makes the engine's first-token log-prob "
            "differ from the trainer's (scored at rollout.temperature), so it cannot be used "
            "with algorithm.old_logprobs=engine or algorithm.tis; remove one of them"
        )
    return source, mode, cap


def _shaping_options(cfg: DictConfig, rollout: RolloutOptions) -> ShapingOptions:
    shaping = cfg.algorithm.get("shaping")
    reward_clip = _get(shaping, "reward_clip")
    _at_least("algorithm.shaping.reward_clip", reward_clip, 0, strict=True)
    over = _get(shaping, "overlong")
    overlong = None
    if _set_keys(over):
        if over.get("buffer") is None:
            raise ValueError(
                "algorithm.shaping.overlong needs buffer (tokens before max_len "
                "where the penalty ramps up)"
            )
        overlong = (
            int(_get(over, "max_len", rollout.max_tokens)),
            int(over.buffer),
            float(_get(over, "factor", 1.0)),
        )
        overlong_penalty([0], *overlong)  # its own checks
    ds = _get(shaping, "dynamic_sampling")
    dynamic = bool(_set_keys(ds)) and _get(ds, "enabled", True)
    if _set_keys(ds) and not dynamic and _set_keys(ds) - {"enabled"}:
        raise ValueError(
            "algorithm.shaping.dynamic_sampling.max_draws is set but dynamic sampling is disabled"
        )
    if dynamic and rollout.n < 2:
        raise ValueError("dynamic sampling needs rollout.n >= 2")
    max_draws = _get(ds, "max_draws", 10)
    _at_least("algorithm.shaping.dynamic_sampling.max_draws", max_draws, 1)
    return ShapingOptions(
        reward_norm=_get(shaping, "reward_norm", False),
        reward_clip=reward_clip,
        overlong=overlong,
        dynamic=dynamic,
        max_draws=max_draws,
    )


def _schedule(node: Any, key: str) -> ScheduleOptions:
    opts = ScheduleOptions(
        warmup_steps=_get(node, "warmup_steps", 0), min_lr_ratio=_get(node, "min_lr_ratio", 0.0)
    )
    _at_least(f"{key}.warmup_steps", opts.warmup_steps, 0)
    if not 0 <= opts.min_lr_ratio <= 1:
        raise ValueError(f"{key}.min_lr_ratio must be in [0, 1], got {opts.min_lr_ratio}")
    return opts


def _critic_options(cfg: DictConfig, estimator: str) -> CriticOptions | None:
    critic = cfg.get("critic")
    if estimator != "gae":
        if _set_keys(cfg.algorithm.get("value")) or _set_keys(critic):
            raise ValueError(
                f"algorithm.value and critic train a critic, used only by estimator=gae "
                f"(estimator is {estimator!r}); remove them"
            )
        return None
    if _get(critic, "optimizer") is None:
        raise ValueError("estimator=gae needs a critic: add a `critic:` section with its optimizer")
    return CriticOptions(
        path=_get(critic, "path", cfg.model.path),
        schedule=_schedule(critic.get("lr_scheduler"), "critic.lr_scheduler"),
        clip_grad_norm=_get(critic, "clip_grad_norm"),
    )


def _train_options(cfg: DictConfig) -> TrainOptions:
    tr = cfg.train
    opts = TrainOptions(
        micro_batch_size=tr.micro_batch_size,
        ppo_epochs=_get(tr, "ppo_epochs", 1),
        mini_batch_size=_get(tr, "mini_batch_size"),
        packing=_get(tr, "packing", False),
        shuffle=_get(tr, "shuffle", True),
    )
    for key in ("micro_batch_size", "ppo_epochs", "mini_batch_size"):
        _at_least(f"train.{key}", getattr(opts, key), 1)
    return opts


def _eval_options(cfg: DictConfig, rollout: RolloutOptions) -> EvalOptions:
    ev = cfg.get("eval")
    if _set_keys(ev) and cfg.get("eval_dataset") is None:
        raise ValueError("the eval section needs an eval_dataset")
    opts = EvalOptions(
        every=_get(ev, "every"),
        at_start=_get(ev, "at_start", True),
        temperature=float(_get(ev, "temperature", 0.0)),
        max_tokens=_get(ev, "max_tokens", rollout.max_tokens),
        accuracy_reward=_get(ev, "accuracy_reward"),
    )
    names = list((cfg.reward.get("functions") or {}).keys())  # a CombinedReward's parts
    if opts.accuracy_reward is not None and opts.accuracy_reward not in names:
        raise ValueError(
            f"eval.accuracy_reward={opts.accuracy_reward!r} is not a reward function; they are "
            f"{names}"
        )
    _at_least("eval.every", opts.every, 1)
    _at_least("eval.max_tokens", opts.max_tokens, 1)
    _at_least("eval.temperature", opts.temperature, 0)
    return opts


def _engine_options(cfg: DictConfig) -> EngineOptions:
    ecfg = cfg.get("engine") or {}
    backend = _get(ecfg, "backend", "native")
    own = {
        "native": ("max_prefill_tokens", "max_kv_tokens", "compile"),
        "vllm": ("gpu_memory_utilization", "tensor_parallel_size"),
    }
    other = own["vllm" if backend == "native" else "native"]
    wrong = sorted(k for k in other if ecfg.get(k) is not None)
    if wrong:
        raise ValueError(f"engine.{wrong[0]} does not apply to engine.backend={backend}")
    keys = ("dtype", "max_model_len", "max_num_seqs", *own[backend])
    return EngineOptions(
        backend=backend,
        sleep_level=_get(ecfg, "sleep_level", 1),
        kwargs={k: ecfg[k] for k in keys if ecfg.get(k) is not None},
    )


def _model_options(cfg: DictConfig) -> ModelOptions:
    m = cfg.model
    return ModelOptions(
        path=m.path,
        dtype=_get(m, "dtype", "float32"),
        trust_remote_code=_get(m, "trust_remote_code", False),
        activation_checkpointing=_get(m, "activation_checkpointing", False),
        compile=_get(m, "compile", False),
    )


def build_options(cfg: DictConfig) -> GRPOOptions:
    """The config as a frozen, typed :class:`GRPOOptions`: every default, every cross-field
    check, no side effect (no directory, no process group, no model). ``lightrft validate`` and
    ``lightrft run`` both call it, so a config that validates does not fail later on a rule."""
    rollout = _rollout_options(cfg)
    estimator, adv_options = _advantage_options(cfg, rollout.n)
    old_source, tis_mode, tis_cap = _sampling_correction(cfg, rollout)
    metrics = cfg.get("metrics")
    opts = GRPOOptions(
        output_dir=cfg.output_dir,
        max_steps=cfg.max_steps,
        model=_model_options(cfg),
        rollout=rollout,
        estimator=estimator,
        adv_options=adv_options,
        loss=_loss_options(cfg, rollout),
        old_logprobs=old_source,
        tis_mode=tis_mode,
        tis_cap=tis_cap,
        kl=_kl_options(cfg),
        shaping=_shaping_options(cfg, rollout),
        critic=_critic_options(cfg, estimator),
        train=_train_options(cfg),
        schedule=_schedule(cfg.get("lr_scheduler"), "lr_scheduler"),
        eval=_eval_options(cfg, rollout),
        engine=_engine_options(cfg),
        seed=_get(cfg, "seed", 0),
        device=_get(cfg, "device"),
        clip_grad_norm=_get(cfg, "clip_grad_norm"),
        trajectories=_get(cfg, "trajectories", False),
        log_every=_get(cfg, "log_every", 1),
        save_every=_get(cfg, "save_every"),
        keep_last=_get(cfg, "keep_last", 2),
        resume=_get(cfg, "resume", False),
        tensorboard=_get(metrics, "tensorboard", True),
        wandb=_get(metrics, "wandb", False),
    )
    for key in ("max_steps", "log_every", "save_every", "keep_last"):
        _at_least(key, getattr(opts, key), 1)
    if not str(opts.output_dir).strip():
        raise ValueError("output_dir is not set: give the run a directory (output_dir=...)")
    checkpoints = Checkpointer(
        opts.output_dir, keep_last=opts.keep_last, every_n_steps=opts.save_every
    )  # reads only
    if opts.resume and checkpoints.latest() is None:
        raise ValueError(f"resume=true but no checkpoint found in {checkpoints.root}")
    return opts


# ---------------------------------------------------------------------------------- batches


def _pad_rows(rows: list[list[float]], fill: float = 0.0) -> torch.Tensor:
    """List of per-sample vectors -> [B, max_len] float tensor padded with ``fill``."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), fill, dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def build_micro_batch(samples: list[dict], pad_id: int, *, packing: bool) -> dict[str, Any]:
    """Model inputs for ``samples`` plus a gather index from the model's ``[rows, L-1]`` next-token
    outputs to a response-only ``[B, R]`` layout (R = longest response), which every loss uses.

    Packed: one row, samples back to back, ``position_ids`` restarting per sample, no attention
    mask (transformers builds the block-diagonal causal mask from the position resets). Padded:
    one right-padded row per sample with an attention mask. An empty ``samples`` list gives a
    dummy batch (one scored position, mask 0), so a rank without data still runs the same
    forward/backward collectives as the others.
    """
    if not samples:
        ids = torch.full((1, 2), pad_id, dtype=torch.long)
        return {
            "input_ids": ids,
            "position_ids": torch.arange(2).unsqueeze(0),
            "attention_mask": None,
            "targets": ids[:, 1:].clone(),  # one real position keeps the graph connected
            "index": torch.zeros(1, 1, dtype=torch.long),
            "mask": torch.zeros(1, 1, dtype=torch.bool),
            "tokens": 0,
        }
    seqs = [s["prompt_ids"] + s["response_ids"] for s in samples]
    resp = [len(s["response_ids"]) for s in samples]
    width = max(resp)
    index = torch.zeros(len(samples), width, dtype=torch.long)  # [B, R]
    mask = torch.zeros(len(samples), width, dtype=torch.bool)  # [B, R]
    if packing:
        total = sum(len(q) for q in seqs)
        ids = torch.full((1, total), pad_id, dtype=torch.long)
        pos = torch.zeros(1, total, dtype=torch.long)
        targets = torch.full((1, total - 1), IGNORE, dtype=torch.long)
        start = 0
        for i, (q, s) in enumerate(zip(seqs, samples, strict=True)):
            ids[0, start : start + len(q)] = torch.as_tensor(q)
            pos[0, start : start + len(q)] = torch.arange(len(q))
            first = start + len(s["prompt_ids"]) - 1  # position predicting response token 0
            cols = torch.arange(first, first + resp[i])
            targets[0, cols] = torch.as_tensor(s["response_ids"])
            index[i, : resp[i]] = cols
            mask[i, : resp[i]] = True
            start += len(q)
        attention_mask = None
    else:
        length = max(len(q) for q in seqs)
        ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros(len(seqs), length, dtype=torch.long)
        targets = torch.full((len(seqs), length - 1), IGNORE, dtype=torch.long)
        for i, (q, s) in enumerate(zip(seqs, samples, strict=True)):
            ids[i, : len(q)] = torch.as_tensor(q)
            attention_mask[i, : len(q)] = 1
            first = len(s["prompt_ids"]) - 1
            cols = torch.arange(first, first + resp[i])
            targets[i, cols] = torch.as_tensor(s["response_ids"])
            index[i, : resp[i]] = i * (length - 1) + cols
            mask[i, : resp[i]] = True
        # Right padding: the default positions 0..T-1 are right for every row.
        pos = None
    return {
        "input_ids": ids,
        "position_ids": pos,
        "attention_mask": attention_mask,
        "targets": targets,
        "index": index,
        "mask": mask,
        "tokens": int(sum(len(q) for q in seqs)),
    }


def _gather_response(full: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """[rows, L-1] per-position values -> [B, R] response values, 0 on padding."""
    out = full.reshape(-1)[mb["index"].to(full.device)]
    return torch.where(
        mb["mask"].to(full.device), out, torch.zeros((), dtype=out.dtype, device=out.device)
    )


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (a one-element list in a single process)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------- recipe


class GRPORecipe:
    """Build everything from the validated options in ``setup``, train, clean up."""

    def __init__(self, cfg: DictConfig, opts: GRPOOptions):
        self.cfg, self.opts = cfg, opts
        # Side effects start here, after build_options has accepted the config.
        self.output_dir = check_output_dir(opts.output_dir)
        self.dist = init_distributed(opts.device)
        self.checkpointer = Checkpointer(
            self.output_dir, keep_last=opts.keep_last, every_n_steps=opts.save_every
        )
        self.kl_ctl = None
        if opts.kl is not None:
            k = opts.kl
            self.kl_ctl = build_kl_controller(
                k.controller, k.coef, target=k.target, horizon=k.horizon
            )

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        torch.manual_seed(self.opts.seed)
        if self.dist.is_main:
            for node in cfg.get("prepare") or []:
                config.instantiate(node)
        barrier()
        self._setup_models(cfg)
        self._setup_engine()
        self._setup_rewards_and_data(cfg)
        self._weights_released = False
        self.step, self.epoch = 0, 0
        self.eval_history: list[tuple[int, float, float]] = []
        self.resumed = self.opts.resume
        if self.resumed:
            self._load_checkpoint()
        self.logger = MetricLogger(
            self.output_dir,
            tensorboard=self.opts.tensorboard,
            wandb=self.opts.wandb,
            config=OmegaConf.to_container(cfg, resolve=True),
            resume_step=self.step if self.resumed else None,
        )
        data_stats = {
            f"data/{k}": v for k, v in (getattr(self.dataset, "stats", None) or {}).items()
        }
        if data_stats and not self.resumed:
            self.logger.log(0, data_stats)

    def _load_model(self, path: str) -> nn.Module:
        m = self.opts.model
        return load_causal_lm(
            path, dtype=m.dtype, device=self.dist.device, trust_remote_code=m.trust_remote_code
        )

    def _setup_models(self, cfg: DictConfig) -> None:
        """Actor (+ optimizer, scheduler), the frozen reference (KL only), the critic (gae)."""
        m, o = self.opts.model, self.opts
        self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id
        self.model = parallelize(
            self._load_model(m.path),
            activation_checkpointing=m.activation_checkpointing,
            compile=m.compile,
        )
        self.optimizer = config.instantiate(cfg.optimizer, self.model.parameters())
        # One scheduler step per RL step (as verl), whatever the number of optimizer steps.
        self.scheduler = warmup_cosine_scheduler(
            self.optimizer,
            warmup_steps=o.schedule.warmup_steps,
            total_steps=o.max_steps,
            min_lr_ratio=o.schedule.min_lr_ratio,
        )
        self.ref = None
        if o.kl is not None:  # a frozen copy of the initial policy, sharded like the actor
            self.ref = parallelize(self._load_model(m.path))
            self.ref.requires_grad_(False).eval()
        self.critic = self.critic_opt = self.critic_sched = None
        if o.critic is not None:
            self.critic = parallelize(
                self._build_critic(self._load_model(o.critic.path)),
                activation_checkpointing=m.activation_checkpointing,
            )
            self.critic_opt = config.instantiate(cfg.critic.optimizer, self.critic.parameters())
            self.critic_sched = warmup_cosine_scheduler(
                self.critic_opt,
                warmup_steps=o.critic.schedule.warmup_steps,
                total_steps=o.max_steps,
                min_lr_ratio=o.critic.schedule.min_lr_ratio,
            )

    def _setup_engine(self) -> None:
        # The engine holds its own inference copy of the weights, loaded from the same directory.
        e, path = self.opts.engine, self.opts.model.path
        if e.backend == "vllm":  # CUDA only; the adapter imports vLLM lazily
            from lightrft.engine import VLLMEngine

            self.engine = VLLMEngine(path, seed=self.opts.seed, **e.kwargs)
        else:
            self.engine = NativeEngine(
                path, self.tokenizer, device=self.dist.device, seed=self.opts.seed, **e.kwargs
            )
        self.sampling = _sampling(self.opts.rollout)

    def _setup_rewards_and_data(self, cfg: DictConfig) -> None:
        o = self.opts
        self.reward_fn = build_reward(cfg.reward)
        self.reward_names = list(getattr(self.reward_fn, "functions", {}) or [])
        self.normalizer = None
        if o.shaping.reward_norm:
            self.normalizer = RunningRewardNormalizer(clip=o.shaping.reward_clip)
        self.dataset = config.instantiate(cfg.dataset, self.tokenizer)
        self.loader = build_dataloader(
            self.dataset,
            batch_size=o.rollout.prompts_per_step // self.dist.world_size,
            shuffle=True,
            seed=o.seed,
            collate_fn=collate_prompts,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            drop_last=True,
        )
        self._it = None
        self.eval_dataset = None
        if cfg.get("eval_dataset") is not None:
            self.eval_dataset = config.instantiate(cfg.eval_dataset, self.tokenizer)

    def _load_checkpoint(self) -> None:
        models, opts, scheds = self._stateful()
        state = self.checkpointer.load_latest(
            models=models,
            optimizers=opts,
            schedulers=scheds,
            dataloaders=self.loader,
            required=True,
        )
        self.step, extra = state.step, state.extra
        self.epoch = extra["epoch"]
        self.eval_history = [tuple(e) for e in extra.get("eval_history", [])]
        if self.kl_ctl is not None:
            self.kl_ctl.load_state_dict(extra["kl_ctl"])
        if self.normalizer is not None:
            self.normalizer.load_state_dict(extra["reward_norm"])
        sync_weights(self.model, self.engine)

    @staticmethod
    def _build_critic(critic: nn.Module) -> nn.Module:
        """The critic: an HF causal-LM backbone whose LM head is replaced by a scalar value head
        ``hidden -> 1`` (zero-initialised, so values start at 0). Keeping the HF class means
        ``parallelize`` and ``forward_on_hidden`` handle it exactly like the actor."""
        hidden = critic.config.hidden_size
        param = next(critic.parameters())
        head = nn.Linear(hidden, 1, bias=True, device=param.device, dtype=param.dtype)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        critic.config.tie_word_embeddings = False
        critic.set_output_embeddings(head)
        return critic

    def _stateful(self):
        if self.critic is None:
            return self.model, self.optimizer, self.scheduler
        return (
            {"policy": self.model, "critic": self.critic},
            {"policy": self.optimizer, "critic": self.critic_opt},
            {"policy": self.scheduler, "critic": self.critic_sched},
        )

    # ------------------------------------------------------------------ rollout

    def _next_prompts(self) -> dict[str, list]:
        """The next batch of this rank's prompts, moving on to the next epoch when one ends."""
        while True:
            if self._it is None:
                self.loader.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self.epoch += 1
                self._it = None

    def _request_params(self, count: int, step: int, draw: int) -> list[SamplingParams]:
        """One seed per request, a pure function of (seed, step, draw, rank): a resumed run
        samples exactly what the uninterrupted run sampled."""
        gen = torch.Generator().manual_seed(
            ((self.opts.seed * 1_000_003 + step) * 1_009 + draw) * 1_013 + self.dist.rank
        )
        seeds = torch.randint(0, 2**62, (count,), generator=gen).tolist()
        return [dataclasses.replace(self.sampling, seed=s) for s in seeds]

    def _generate(self, prompt_ids: list[list[int]], params) -> list:
        """Wake the engine (reloading released weights: a collective, so every rank calls this,
        with or without prompts) and generate."""
        if self._weights_released:
            self.engine.wake_up(["weights"])
            sync_weights(self.model, self.engine)
            self._weights_released = False
        self.engine.wake_up()
        if not prompt_ids:
            return []
        return self.engine.generate([Request(ids) for ids in prompt_ids], params)

    def _sleep(self) -> None:
        if self.opts.engine.sleep_level:
            self.engine.sleep(self.opts.engine.sleep_level)
            self._weights_released = self.opts.engine.sleep_level == 2

    def _score(self, samples: list[dict]) -> None:
        """Rewards of this rank's samples, in place: ``reward_raw``, ``parts``, ``applied``."""
        if not samples:
            return
        out = self.reward_fn(
            [s["prompt"] for s in samples],
            [s["text"] for s in samples],
            [s["reference"] for s in samples],
            [s["label"] for s in samples],
        )
        total = out.total
        bad = (~torch.isfinite(total)).nonzero().flatten().tolist()
        if bad:  # reward functions are checked one by one; this catches weights and sums
            s = samples[bad[0]]
            raise ValueError(
                f"non-finite total reward {total[bad[0]].item()} for sample "
                f"{bad[0]} (prompt {s['prompt'][:60]!r}, from {s['where']})"
            )
        for i, s in enumerate(samples):
            s["reward_raw"] = float(total[i])
            s["parts"] = {n: float(p[i]) for n, p in out.parts.items()}
            s["applied"] = {n: bool(a[i]) for n, a in out.applied.items()}

    def _draw(self, step: int, draw: int, timer: PhaseTimer) -> list[dict]:
        """One rollout draw: this rank's prompts, n samples each, scored; then gathered so every
        rank holds every sample (groups stay consecutive and whole)."""
        batch = self._next_prompts()
        with timer("rollout"):
            params = self._request_params(len(batch["prompt_ids"]), step, draw)
            completions = self._generate(batch["prompt_ids"], params)
        samples = []
        for c in completions:
            i = c.request_index
            samples.append(
                {
                    "group": (step, draw, self.dist.rank, i),
                    "prompt_ids": list(c.prompt_token_ids),
                    "response_ids": list(c.token_ids),
                    "rollout_logprobs": list(c.logprobs),
                    "finish_reason": c.finish_reason,
                    "text": c.text or "",
                    "prompt": batch["prompt"][i],
                    "reference": batch["reference"][i],
                    "label": batch["label"][i],
                    "where": batch["where"][i],
                }
            )
        with timer("scoring"):
            self._score(samples)
            for s in samples:
                r = s["reward_raw"]
                if self.opts.shaping.overlong is not None:
                    s["overlong"] = float(
                        overlong_penalty([len(s["response_ids"])], *self.opts.shaping.overlong)[0]
                    )
                    r += s["overlong"]
                s["reward"] = r
        return [s for part in _all_gather(samples) for s in part]

    def rollout(self, step: int, timer: PhaseTimer) -> tuple[list[dict], list[dict], dict]:
        """The step's train batch (after dynamic sampling) and every sample drawn (to log)."""
        drawn: list[dict] = []
        stats: dict[str, float] = {}
        if not self.opts.shaping.dynamic:
            batch = self._draw(step, 0, timer)
            drawn = batch
        else:
            acc = DynamicSamplingAccumulator(
                self.opts.rollout.prompts_per_step,
                self.opts.rollout.n,
                max_draws=self.opts.shaping.max_draws,
            )
            draw = 0
            while not acc.done:
                samples = self._draw(step, draw, timer)
                drawn.extend(samples)
                acc.add(samples, torch.tensor([s["reward"] for s in samples]))
                draw += 1
            batch, stats = acc.take()
        self._sleep()
        for s in drawn:
            s["kept"] = False
        for s in batch:
            s["kept"] = True
        return batch, drawn, stats

    # ------------------------------------------------------------------ forward passes

    def _policy_logprobs(self, model, mb, *, entropy: bool):
        dev = self.dist.device
        out = causal_lm_token_logprobs(
            model,
            mb["input_ids"].to(dev),
            targets=mb["targets"].to(dev),
            attention_mask=None if mb["attention_mask"] is None else mb["attention_mask"].to(dev),
            position_ids=None if mb["position_ids"] is None else mb["position_ids"].to(dev),
            temperature=self.opts.rollout.temperature,
            return_entropy=entropy,
        )
        if entropy:
            return _gather_response(out[0], mb), _gather_response(out[1], mb)
        return _gather_response(out, mb), None

    def _values(self, mb) -> torch.Tensor:
        dev = self.dist.device

        def head(hidden, weight, bias):
            return F.linear(hidden, weight, bias).squeeze(-1).float()  # [rows, L-1]

        out = forward_on_hidden(
            self.critic,
            mb["input_ids"].to(dev),
            head,
            attention_mask=None if mb["attention_mask"] is None else mb["attention_mask"].to(dev),
            position_ids=None if mb["position_ids"] is None else mb["position_ids"].to(dev),
        )
        return _gather_response(out, mb)

    def _shards(self, n: int) -> tuple[list[int], int]:
        """This rank's sample indices of ``n`` and the micro-batch count every rank runs."""
        world = self.dist.world_size
        mine = list(range(self.dist.rank, n, world))
        per_rank = -(-n // world)
        return mine, max(1, -(-per_rank // self.opts.train.micro_batch_size))

    @torch.no_grad()
    def precompute(self, batch: list[dict], timer: PhaseTimer) -> None:
        """Old log-probs, entropy, reference log-probs and values of every sample, in place.

        Each rank computes its shard in micro-batches, then the results are gathered so every
        rank holds them for the whole batch (advantages and the high-entropy quantile are
        computed over the whole batch)."""
        exact_on_policy = self.opts.train.ppo_epochs == 1 and (
            self.opts.train.mini_batch_size is None or self.opts.train.mini_batch_size >= len(batch)
        )
        kl_reward = self.opts.kl and self.opts.kl.placement == "reward"
        need_old = self.opts.old_logprobs == "trainer" and (
            not exact_on_policy or self.opts.tis_mode is not None or kl_reward
        )
        need_entropy = self.opts.loss.top_rho is not None
        jobs = [
            ("old", need_old or need_entropy),
            ("ref", self.ref is not None),
            ("values", self.critic is not None),
        ]
        if not any(flag for _, flag in jobs):
            return
        mine, n_micro = self._shards(len(batch))
        results: dict[int, dict[str, list[float]]] = {i: {} for i in mine}
        for name, flag in jobs:
            if not flag:
                continue
            model = {"old": self.model, "ref": self.ref, "values": self.critic}[name]
            model.eval()
            with timer({"old": "old_logprobs", "ref": "reference", "values": "values"}[name]):
                for m in range(n_micro):
                    idx = mine[
                        m * self.opts.train.micro_batch_size : (m + 1)
                        * self.opts.train.micro_batch_size
                    ]
                    mb = build_micro_batch(
                        [batch[i] for i in idx], self.pad_id, packing=self.opts.train.packing
                    )
                    if name == "values":
                        outs = {"values": self._values(mb)}
                    else:
                        lp, ent = self._policy_logprobs(
                            model, mb, entropy=name == "old" and need_entropy
                        )
                        outs = {name: lp} if name == "ref" or need_old else {}
                        if ent is not None:
                            outs["entropy"] = ent
                    for j, i in enumerate(idx):
                        r = len(batch[i]["response_ids"])
                        for key, t in outs.items():
                            results[i][key] = t[j, :r].float().cpu().tolist()
            if name != "ref":
                model.train()
        for part in _all_gather(results):
            for i, vals in part.items():
                batch[i].update(vals)

    # ------------------------------------------------------------------ advantages

    def advantages(self, batch: list[dict]) -> dict[str, float]:
        """Reward clip / normalisation, KL in the reward, then the configured estimator."""
        metrics: dict[str, float] = {}
        rewards = torch.tensor([s["reward"] for s in batch], dtype=torch.float32)  # [B]
        if self.normalizer is not None:
            rewards = self.normalizer(rewards)
        elif self.opts.shaping.reward_clip is not None:
            rewards = clip_rewards(rewards, self.opts.shaping.reward_clip)
        mask = _pad_rows([[1.0] * len(s["response_ids"]) for s in batch]) > 0  # [B, R]
        token_rewards = None
        if self.opts.kl and self.opts.kl.placement == "reward":
            kl = estimate_kl(
                _pad_rows([s["old" if "old" in s else "rollout_logprobs"] for s in batch]),
                _pad_rows([s["ref"] for s in batch]),
                self.opts.kl.estimator,
            )  # [B, R]
            token_rewards, kl_metrics = kl_in_reward(rewards, kl, mask, self.kl_ctl.coef)
            metrics["train/kl"] = float(kl_metrics["kl"])
            self.kl_ctl.update(metrics["train/kl"], len(batch))
        values = _pad_rows([s["values"] for s in batch]) if self.opts.critic else None
        adv, returns = compute_advantages(
            self.opts.estimator,
            mask=mask,
            rewards=rewards,
            token_rewards=token_rewards,
            values=values,
            group_size=self.opts.rollout.n,
            **self.opts.adv_options,
        )  # [B, R]
        for i, s in enumerate(batch):
            r = len(s["response_ids"])
            s["shaped_reward"] = float(rewards[i])
            s["advantages"] = adv[i, :r].tolist()
            if returns is not None:
                s["returns"] = returns[i, :r].tolist()
        valid = adv[mask]
        metrics["train/advantage/mean"] = float(valid.mean()) if valid.numel() else 0.0
        metrics["train/advantage/abs_mean"] = float(valid.abs().mean()) if valid.numel() else 0.0
        if self.opts.loss.top_rho is not None:
            ent = _pad_rows([s["entropy"] for s in batch])
            keep = high_entropy_mask(ent, mask, self.opts.loss.top_rho)
            for i, s in enumerate(batch):
                s["loss_mask"] = keep[i, : len(s["response_ids"])].tolist()
            metrics["train/high_entropy_frac"] = float(keep.sum() / mask.sum().clamp_min(1))
        return metrics

    # ------------------------------------------------------------------ updates

    def _tensor(self, samples: list[dict], key: str, width: int) -> torch.Tensor:
        t = _pad_rows([s[key] for s in samples]) if samples else torch.zeros(1, 1)
        if t.shape[1] < width:
            t = F.pad(t, (0, width - t.shape[1]))
        return t.to(self.dist.device)

    def update(self, batch: list[dict], step: int, timer: PhaseTimer) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches; one optimizer step per mini-batch."""
        world = self.dist.world_size
        n = len(batch)
        mbs = min(self.opts.train.mini_batch_size or n, n)
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        grad_norms, critic_norms, losses = [], [], []
        train_tokens = 0

        extremes: dict[str, float] = {}

        def add(key: str, value, weight: float) -> None:
            if key in ("ratio_min", "ratio_max"):  # extremes over the step, not means
                if weight > 0:
                    pick = min if key == "ratio_min" else max
                    extremes[key] = pick(extremes.get(key, float(value)), float(value))
                return
            sums[key] = sums.get(key, 0.0) + float(value) * weight
            weights[key] = weights.get(key, 0.0) + weight

        for epoch in range(self.opts.train.ppo_epochs):
            order = list(range(n))
            if self.opts.train.shuffle:
                gen = torch.Generator().manual_seed(self.opts.seed * 7_919 + step * 131 + epoch)
                order = torch.randperm(n, generator=gen).tolist()
            for start in range(0, n, mbs):
                mini = [batch[i] for i in order[start : start + mbs]]
                # Global normalisers of this optimizer step: every rank holds the whole batch.
                # Gradient reduction averages over ranks, hence the division by world.
                lmask = [s.get("loss_mask") or [True] * len(s["response_ids"]) for s in mini]
                counts = {
                    "num_tokens": sum(sum(m) for m in lmask) / world,
                    "num_seqs": sum(any(m) for m in lmask) / world,
                }
                resp_counts = {
                    "num_tokens": sum(len(s["response_ids"]) for s in mini) / world,
                    "num_seqs": len(mini) / world,
                }
                mine, n_micro = self._shards(len(mini))
                # Similar lengths share a micro-batch: less padding, same gradient (the loss is
                # normalised by the counts of the whole mini-batch).
                mine.sort(key=lambda i: len(mini[i]["prompt_ids"]) + len(mini[i]["response_ids"]))
                loss_sum = 0.0
                for m in range(n_micro):
                    samples = [
                        mini[i]
                        for i in mine[
                            m * self.opts.train.micro_batch_size : (m + 1)
                            * self.opts.train.micro_batch_size
                        ]
                    ]
                    with timer("training"):
                        out = self._micro_step(samples, counts, resp_counts)
                    loss_sum += out.pop("loss")
                    tokens = out.pop("tokens")
                    train_tokens += tokens
                    w = out.pop("weight")
                    for k, v in out.items():
                        add(k, v, w)
                with timer("training"):
                    gn = clip_grad_norm(self.model, self.opts.clip_grad_norm or None)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.critic is not None:
                        critic_norms.append(
                            clip_grad_norm(self.critic, self.opts.critic.clip_grad_norm or None)
                        )
                        self.critic_opt.step()
                        self.critic_opt.zero_grad(set_to_none=True)
                grad_norms.append(gn)
                losses.append(loss_sum)

        red_sum = reduce_metrics(
            {
                **{f"s/{k}": v for k, v in sums.items()},
                **{f"w/{k}": v for k, v in weights.items()},
                "tokens": train_tokens,
                "loss": sum(losses),
            },
            "sum",
        )
        metrics = {f"train/{k}": red_sum[f"s/{k}"] / max(red_sum[f"w/{k}"], 1e-12) for k in sums}
        for key, op in (("ratio_min", "min"), ("ratio_max", "max")):
            fill = math.inf if op == "min" else -math.inf
            value = reduce_metrics({key: extremes.get(key, fill)}, op)[key]
            metrics[f"train/{key}"] = value if math.isfinite(value) else 1.0
        # Each rank's loss is its part of sum / (global count / world): the sum over ranks is
        # world x the loss of the whole mini-batch.
        metrics["train/loss"] = red_sum["loss"] / world / max(len(losses), 1)
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["train/grad_norm_max"] = max(grad_norms)
        metrics["train/optimizer_steps"] = float(len(grad_norms))
        if critic_norms:
            metrics["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
        metrics["train/tokens"] = red_sum["tokens"]
        return metrics

    def _micro_step(self, samples: list[dict], counts: dict, resp_counts: dict) -> dict:
        """Forward and backward of one micro-batch; returns its metrics (token-weighted)."""
        mb = build_micro_batch(samples, self.pad_id, packing=self.opts.train.packing)
        width = mb["mask"].shape[1]
        mask = mb["mask"].to(self.dist.device)  # [B, R] response tokens
        if samples and self.opts.loss.top_rho is not None:
            loss_mask = self._tensor(samples, "loss_mask", width) > 0
        else:
            loss_mask = mask
        want_entropy = True  # logged; and the bonus needs it with a gradient
        lp, ent = self._policy_logprobs(self.model, mb, entropy=want_entropy)  # [B, R]
        adv = self._tensor(samples, "advantages", width) if samples else torch.zeros_like(lp)
        if not samples:
            old = None
        elif self.opts.old_logprobs == "engine":
            old = self._tensor(samples, "rollout_logprobs", width)
        elif "old" in samples[0]:
            old = self._tensor(samples, "old", width)
        else:
            old = None  # exactly on-policy: old == current, ratio 1
        extra = {}
        if self.opts.tis_mode is not None and samples:
            extra = {
                "rollout_logprobs": self._tensor(samples, "rollout_logprobs", width),
                "tis_mode": self.opts.tis_mode,
                "tis_cap": self.opts.tis_cap,
            }
        loss, pm = policy_loss(
            lp, old, adv, loss_mask, **self.opts.loss.policy_kwargs(), **counts, **extra
        )
        metrics = {"policy_loss": loss.detach()}
        metrics.update(pm)
        total = loss
        norm = {"agg": self.opts.loss.agg, "norm_len": self.opts.loss.norm_len, **resp_counts}
        if self.opts.loss.entropy_coef:
            term, _ = entropy_bonus(ent, mask, self.opts.loss.entropy_coef, **norm)
            total = total + term
        metrics["entropy"] = (ent.detach() * mask).sum() / mask.sum().clamp_min(1)
        if self.opts.kl and self.opts.kl.placement == "loss":
            ref = self._tensor(samples, "ref", width) if samples else lp.detach()
            kl = estimate_kl(lp, ref, self.opts.kl.estimator)
            term, km = kl_in_loss(kl, mask, self.kl_ctl.coef, **norm)
            total = total + term
            metrics["kl"] = km["kl"]
            metrics["kl_loss"] = term.detach()
        if self.critic is not None:
            values = self._values(mb)
            old_v = self._tensor(samples, "values", width) if samples else values.detach()
            rets = self._tensor(samples, "returns", width) if samples else values.detach()
            vloss, vm = value_loss(
                values,
                old_v,
                rets,
                mask,
                clip=self.opts.loss.value_clip,
                num_tokens=resp_counts["num_tokens"],
            )
            vloss.backward()
            metrics["value_loss"] = vloss.detach()
            metrics.update(vm)
        total.backward()
        n_tok = float(mask.sum())
        out = {k: float(v) for k, v in metrics.items()}
        out["loss"] = float(total.detach())
        out["tokens"] = mb["tokens"]
        out["weight"] = n_tok
        return out

    def sync(self, timer: PhaseTimer) -> None:
        with timer("weight_sync"):
            if self._weights_released:
                self.engine.wake_up(["weights"])
                self._weights_released = False
            sync_weights(self.model, self.engine)

    # ------------------------------------------------------------------ eval

    def evaluate(self) -> dict[str, float]:
        """Greedy (``eval.temperature`` 0) generation on the held-out prompts; each rank takes
        every world_size-th prompt, counts are summed over ranks."""
        items = [
            self.eval_dataset[i]
            for i in range(self.dist.rank, len(self.eval_dataset), self.dist.world_size)
        ]
        params = dataclasses.replace(
            self.sampling,
            n=1,
            temperature=self.opts.eval.temperature,
            first_token_temperature=None,
            max_tokens=self.opts.eval.max_tokens,
            seed=self.opts.seed,
        )
        completions = self._generate([it["prompt_ids"] for it in items], params)
        self._sleep()
        samples = [
            {
                "prompt": it["prompt"],
                "reference": it["reference"],
                "label": it["label"],
                "where": it["where"],
                "text": c.text or "",
            }
            for it, c in zip(items, completions, strict=True)
        ]
        self._score(samples)
        name = self.opts.eval.accuracy_reward or (
            self.reward_names[0] if self.reward_names else None
        )
        correct = sum(
            1.0 for s in samples if (s["parts"].get(name, 0.0) if name else s["reward_raw"]) > 0
        )
        sums = reduce_metrics(
            {
                "n": len(samples),
                "correct": correct,
                "reward": sum(s["reward_raw"] for s in samples),
                "length": sum(len(c.token_ids) for c in completions),
                **{f"part/{k}": sum(s["parts"][k] for s in samples) for k in self.reward_names},
            },
            "sum",
        )
        n = max(sums["n"], 1.0)
        out = {
            "eval/accuracy": sums["correct"] / n,
            "eval/reward": sums["reward"] / n,
            "eval/response_length": sums["length"] / n,
            "eval/samples": sums["n"],
        }
        for k in self.reward_names:
            out[f"eval/reward/{k}"] = sums[f"part/{k}"] / n
        return out

    def _log_eval(self, step: int) -> None:
        m = self.evaluate()
        self.logger.log(step, m)
        self.eval_history.append((step, m["eval/accuracy"], m["eval/reward"]))

    # ------------------------------------------------------------------ metrics

    def _rollout_metrics(self, drawn: list[dict], batch: list[dict]) -> dict[str, float]:
        m: dict[str, float] = {}
        totals = torch.tensor([s["reward_raw"] for s in drawn])
        m["reward/total/mean"] = float(totals.mean())
        m["reward/total/std"] = float(totals.std(unbiased=False))
        for name in self.reward_names:
            vals = torch.tensor([s["parts"][name] for s in drawn if s["applied"][name]])
            if vals.numel():
                m[f"reward/{name}/mean"] = float(vals.mean())
                m[f"reward/{name}/std"] = float(vals.std(unbiased=False))
            m[f"reward/{name}/count"] = float(vals.numel())
        if self.opts.shaping.overlong is not None:
            m["reward/overlong/mean"] = sum(s["overlong"] for s in drawn) / len(drawn)
        lengths = torch.tensor([len(s["response_ids"]) for s in drawn], dtype=torch.float32)
        m["rollout/response_length/mean"] = float(lengths.mean())
        m["rollout/response_length/max"] = float(lengths.max())
        m["rollout/response_length/min"] = float(lengths.min())
        m["rollout/truncated_frac"] = sum(s["finish_reason"] == "length" for s in drawn) / len(
            drawn
        )
        m["rollout/prompt_length/mean"] = sum(len(s["prompt_ids"]) for s in drawn) / len(drawn)
        m["rollout/samples"] = float(len(drawn))
        m["rollout/train_samples"] = float(len(batch))
        # Groups whose rewards are all equal carry no group-relative signal.
        groups: dict[tuple, set] = {}
        for s in drawn:
            groups.setdefault(tuple(s["group"]), set()).add(s["reward"])
        m["rollout/solved_or_failed_groups_frac"] = sum(len(v) == 1 for v in groups.values()) / len(
            groups
        )
        return m

    def _write_trajectories(self, step: int, drawn: list[dict]) -> None:
        if not self.dist.is_main:
            return
        folder = self.output_dir / "trajectories"
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{step:06d}.jsonl"
        with open(path, "w") as f:
            for s in drawn:
                adv = s.get("advantages")
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "prompt": s["prompt"],
                            "response": s["text"],
                            "reference": s["reference"],
                            "label": s["label"],
                            "reward": s["reward"],
                            "reward_parts": s["parts"],
                            "overlong_penalty": s.get("overlong"),
                            "advantage": (sum(adv) / len(adv)) if adv else None,
                            "response_length": len(s["response_ids"]),
                            "finish_reason": s["finish_reason"],
                            "kept": s["kept"],
                        }
                    )
                    + "\n"
                )

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        bar = ProgressBar(self.opts.max_steps, initial=self.step, desc="grpo")
        timer = PhaseTimer(cuda_sync=self.dist.device.type == "cuda")
        if self.eval_dataset is not None and self.opts.eval.at_start and not self.resumed:
            with timer("eval"):
                self._log_eval(0)
            timer.reset()
        while self.step < self.opts.max_steps:
            step = self.step + 1
            t0 = time.perf_counter()
            batch, drawn, ds_stats = self.rollout(step, timer)
            metrics = self._rollout_metrics(drawn, batch)
            metrics.update(ds_stats)
            if batch:
                self.precompute(batch, timer)
                metrics.update(self.advantages(batch))
                metrics.update(self.update(batch, step, timer))
                if self.opts.kl and self.opts.kl.placement == "loss" and "train/kl" in metrics:
                    self.kl_ctl.update(metrics["train/kl"], len(batch))
            else:  # dynamic sampling found no informative group: no update, no NaN
                metrics["train/skipped"] = 1.0
            if self.opts.kl:
                metrics["train/kl_coef"] = self.kl_ctl.coef
            metrics["train/lr"] = self.scheduler.get_last_lr()[0]
            with warnings.catch_warnings():
                # A skipped update still advances the schedule: the LR is a function of the step.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.scheduler.step()
                if self.critic_sched is not None:
                    self.critic_sched.step()
            if batch:  # weights changed (released weights are reloaded by the next rollout)
                self.sync(timer)
            self.step = step
            if self.opts.trajectories:
                self._write_trajectories(step, drawn)
            elapsed = time.perf_counter() - t0
            phases = timer.summary()
            gen_tokens = sum(len(s["response_ids"]) for s in drawn)
            all_tokens = gen_tokens + sum(len(s["prompt_ids"]) for s in drawn)
            metrics["time/step"] = elapsed
            for phase in (
                "rollout",
                "scoring",
                "old_logprobs",
                "reference",
                "values",
                "training",
                "weight_sync",
            ):
                metrics[f"time/{phase}"] = phases.get(f"time/{phase}", 0.0)
            metrics["perf/rollout_tokens_per_s"] = gen_tokens / max(metrics["time/rollout"], 1e-9)
            if "train/tokens" in metrics:
                metrics["perf/train_tokens_per_s"] = metrics.pop("train/tokens") / max(
                    metrics["time/training"], 1e-9
                )
            metrics["perf/tokens_per_s"] = all_tokens / max(elapsed, 1e-9)
            metrics.update(reduce_metrics(peak_memory(self.dist.device), "max"))
            if step % self.opts.log_every == 0 or step == self.opts.max_steps:
                self.logger.log(step, metrics)
            bar.update(1, reward=metrics["reward/total/mean"])
            if (
                self.eval_dataset is not None
                and self.opts.eval.every
                and (step % self.opts.eval.every == 0)
                and step != self.opts.max_steps
            ):
                self._log_eval(step)
            if self.checkpointer.should_save(step):
                self._save()
        bar.close()
        if self.eval_dataset is not None and (
            not self.eval_history or self.eval_history[-1][0] != self.step
        ):
            self._log_eval(self.step)
        export_hf(self.model, self.tokenizer, self.output_dir / "final")
        if self.dist.is_main and self.eval_history:
            first, last = self.eval_history[0], self.eval_history[-1]
            print(
                f"grpo: eval/accuracy {first[1]:.3f} (step {first[0]}) -> {last[1]:.3f} "
                f"(step {last[0]}); eval/reward {first[2]:.3f} -> {last[2]:.3f}; "
                f"final model in {self.output_dir / 'final'}"
            )

    def _save(self) -> None:
        models, opts, scheds = self._stateful()
        extra: dict[str, Any] = {"epoch": self.epoch, "eval_history": self.eval_history}
        if self.opts.kl:
            extra["kl_ctl"] = self.kl_ctl.state_dict()
        if self.normalizer is not None:
            extra["reward_norm"] = self.normalizer.state_dict()
        self.checkpointer.save(
            self.step,
            models=models,
            optimizers=opts,
            schedulers=scheds,
            dataloaders=self.loader,
            extra=extra,
        )

    def cleanup(self) -> None:
        self.logger.close()
        destroy()


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: GRPOOptions) -> None:
    recipe = GRPORecipe(cfg, opts)
    recipe.setup(cfg)
    try:
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
