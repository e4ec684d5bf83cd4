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

The file reads top to bottom: options (CONFIG_SCHEMA, build_options -> GRPOOptions: every
default and cross-field rule, no side effect), micro-batch layout, then GRPORecipe: setup,
rollout (one typed RolloutBatch per step), score, precompute, advantages, loss (the one
function to edit to change the algorithm), update, sync, eval / metrics / checkpoint.

Log-probs never materialise [tokens x vocab] logits: they come from the fused linear log-prob
kernel over the final hidden states (lightrft.kernels). See docs/grpo.md for every config key.

One self-contained file: copy it (`lightrft cp grpo my_grpo.py`), edit it, run the copy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
from contextlib import nullcontext
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
from lightrft.data import (
    AudioInputs,
    ImageInputs,
    build_dataloader,
    collate_prompts,
    conversation,
    plan_micro_batches,
)
from lightrft.data.modality import is_audio_language, is_multimodal, is_vision_language
from lightrft.distributed import all_reduce_max, barrier, destroy, init_distributed
from lightrft.engine import NativeEngine, Request, SamplingParams, sync_weights
from lightrft.evaluation import evaluate_items, summarize
from lightrft.kernels import (
    GradHint,
    causal_lm_token_logprobs,
    forward_on_hidden,
    response_grad_hint,
)
from lightrft.models import (
    checkpoint_is_audio_language,
    checkpoint_is_multimodal,
    checkpoint_is_vision_language,
    load_processor,
    load_tokenizer,
    set_towers_trainable,
)
from lightrft.models.deepspeed import DEEPSPEED_SCHEMA, DeepSpeedOptions, deepspeed_options
from lightrft.models.loading import DTYPES
from lightrft.models.lora import (
    LORA_SCHEMA,
    LoraOptions,
    adapters_disabled,
    apply_lora,
    lora_options,
)
from lightrft.models.parallel import MeshOptions, build_mesh, mesh_config, strategy_option
from lightrft.models.sharded import load_parallel
from lightrft.rewards import build_reward
from lightrft.rollout import IGNORE, RolloutBatch, pad_rows
from lightrft.training import (
    Checkpointer,
    MetricAccumulator,
    MetricLogger,
    PhaseTimer,
    Preemption,
    ProgressBar,
    backward,
    check_output_dir,
    check_resume,
    export_trained,
    optimizer_step,
    peak_memory,
    reduce_metrics,
    warmup_cosine_scheduler,
)

DTYPE = Literal[tuple(DTYPES)]
SCHEDULE = {"warmup_steps": int | None, "min_lr_ratio": float | None}

CONFIG_SCHEMA = {
    "output_dir": str,
    "seed": int | None,
    "device": Literal["cpu", "cuda"] | None,
    "strategy": str | None,  # fsdp2 (default) | deepspeed (docs/strategies.md)
    "deepspeed": DEEPSPEED_SCHEMA,  # strategy=deepspeed only: ZeRO stage, offload
    "shard_size": int | None,  # HSDP: shard within groups of this many ranks (docs/strategies.md)
    "replicate_size": int | None,  # HSDP: number of replica groups
    "prepare": list[Component] | None,  # run once on rank 0 before anything loads
    "model": {
        "path": str,
        "dtype": DTYPE | None,
        "trust_remote_code": bool | None,
        "activation_checkpointing": bool | None,
        "compile": bool | None,
        "train_vision_tower": bool | None,  # vision-language actors: default frozen (as verl)
        "train_audio_tower": bool | None,  # audio-language actors: default frozen
    },
    "lora": LORA_SCHEMA,  # absent / null: full fine-tune (docs/strategies.md)
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
        "micro_batch_size": int,  # samples per forward/backward per rank (at most)
        "micro_batch_tokens": int | None,  # and at most this many tokens (padding counted)
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
    "overwrite": bool | None,
    "resume_override_lr": bool | None,
    "metrics": {"tensorboard": bool | None, "wandb": bool | dict | None},
}


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
    micro_batch_tokens: int | None = None  # token budget per micro-batch; None: rows only
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
    lora: LoraOptions | None = None  # adapters on the actor; the reference = adapters off
    strategy: str = "fsdp2"
    deepspeed: DeepSpeedOptions | None = None  # top-level deepspeed:, with strategy=deepspeed
    train_vision_tower: bool = False
    train_audio_tower: bool = False
    mesh: MeshOptions = MeshOptions()  # top-level shard_size / replicate_size


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
    overwrite: bool = False
    resume_override_lr: bool = False
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
        micro_batch_tokens=_get(tr, "micro_batch_tokens"),
        ppo_epochs=_get(tr, "ppo_epochs", 1),
        mini_batch_size=_get(tr, "mini_batch_size"),
        packing=_get(tr, "packing", False),
        shuffle=_get(tr, "shuffle", True),
    )
    for key in ("micro_batch_size", "micro_batch_tokens", "ppo_epochs", "mini_batch_size"):
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
    strategy = strategy_option(cfg.get("strategy"))
    return ModelOptions(
        path=m.path,
        dtype=_get(m, "dtype", "float32"),
        trust_remote_code=_get(m, "trust_remote_code", False),
        activation_checkpointing=_get(m, "activation_checkpointing", False),
        compile=_get(m, "compile", False),
        lora=lora_options(cfg.get("lora")),
        strategy=strategy,
        deepspeed=deepspeed_options(cfg.get("deepspeed"), strategy),
        train_vision_tower=_get(m, "train_vision_tower", False),
        train_audio_tower=_get(m, "train_audio_tower", False),
        mesh=mesh_config(cfg.get("shard_size"), cfg.get("replicate_size")),
    )


def _check_vision(opts: GRPOOptions) -> None:
    """Rules for vision- and audio-language actors, from the checkpoint's config.json (cheap; a
    checkpoint a ``prepare`` step writes is checked again in setup, before any model loads)."""
    vlm = checkpoint_is_vision_language(opts.model.path)
    if opts.model.train_vision_tower and vlm is False:
        raise ValueError(
            f"model.train_vision_tower=true but {opts.model.path} is not a vision-language model "
            "(its config.json has no vision_config)"
        )
    if opts.model.train_audio_tower and checkpoint_is_audio_language(opts.model.path) is False:
        raise ValueError(
            f"model.train_audio_tower=true but {opts.model.path} is not an audio-language model "
            "(its config.json has no audio_config)"
        )
    if checkpoint_is_multimodal(opts.model.path) and opts.critic is not None:
        kind = "a vision-language" if vlm else "an audio-language"
        raise ValueError(
            f"estimator=gae trains a critic, which is not supported with {kind} actor "
            f"({opts.model.path}): use a critic-free estimator (grpo, rloo, reinforce_pp, ...)"
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
        overwrite=_get(cfg, "overwrite", False),
        resume_override_lr=_get(cfg, "resume_override_lr", False),
        tensorboard=_get(metrics, "tensorboard", True),
        wandb=_get(metrics, "wandb", False),
    )
    for key in ("max_steps", "log_every", "save_every", "keep_last"):
        _at_least(key, getattr(opts, key), 1)
    for key, schedule in (
        ("lr_scheduler", opts.schedule),
        ("critic.lr_scheduler", opts.critic.schedule if opts.critic else None),
    ):
        if schedule is not None and schedule.warmup_steps > opts.max_steps:
            raise ValueError(
                f"{key}.warmup_steps={schedule.warmup_steps} is more than max_steps="
                f"{opts.max_steps}: the schedule would never reach its peak"
            )
    if not str(opts.output_dir).strip():
        raise ValueError("output_dir is not set: give the run a directory (output_dir=...)")
    checkpoints = Checkpointer(
        opts.output_dir, keep_last=opts.keep_last, every_n_steps=opts.save_every
    )  # reads only
    if opts.resume and checkpoints.latest() is None:
        raise ValueError(
            f"resume=true but no checkpoint found in {checkpoints.root}; a run stopped before "
            "its first checkpoint starts over with overwrite=true"
        )
    if opts.resume and opts.overwrite:
        raise ValueError("resume=true and overwrite=true contradict each other; choose one")
    if opts.model.deepspeed is not None:
        for key, value in (
            ("lora", opts.model.lora),
            ("shard_size", opts.model.mesh.shard_size),
            ("replicate_size", opts.model.mesh.replicate_size),
        ):
            if value is not None:
                raise ValueError(
                    f"{key} is not supported with strategy=deepspeed yet; remove it or use "
                    "strategy=fsdp2"
                )
    if opts.resume:
        check_resume(opts.output_dir, opts.model.lora is not None, ("model", "policy"))
    _check_vision(opts)
    return opts


# ---------------------------------------------------------------------------------- batches


def build_micro_batch(
    batch: RolloutBatch, idx: list[int], pad_id: int, *, packing: bool
) -> dict[str, Any]:
    """Model inputs for rows ``idx`` of ``batch`` plus a gather index from the model's
    ``[rows, L-1]`` next-token outputs to a response-only ``[b, R]`` layout (R = longest
    response of the rows), which every loss uses.

    Packed: one row, samples back to back, ``position_ids`` restarting per sample, no attention
    mask (transformers builds the block-diagonal causal mask from the position resets). Padded:
    one right-padded row per sample with an attention mask. An empty ``idx`` gives a dummy
    batch (one scored position, mask 0), so a rank without data still runs the same
    forward/backward collectives as the others.
    """
    if not idx:
        ids = torch.full((1, 2), pad_id, dtype=torch.long)
        return {
            "input_ids": ids,
            "position_ids": torch.arange(2).unsqueeze(0),
            "attention_mask": None,
            "targets": ids[:, 1:].clone(),  # one real position keeps the graph connected
            "index": torch.zeros(1, 1, dtype=torch.long),
            "mask": torch.zeros(1, 1, dtype=torch.bool),
            "tokens": 0,
            "images": None,
            "audios": None,
        }
    prompts = [batch.prompt(i) for i in idx]
    responses = [batch.response(i) for i in idx]
    layout = _packed if packing else _padded
    out = layout(prompts, responses, pad_id)
    # A vision-language batch: the rows' images in row (= token) order, one forward's inputs.
    out["images"] = ImageInputs.cat([batch.images[i] for i in idx]) if batch.images else None
    out["audios"] = AudioInputs.cat([batch.audios[i] for i in idx]) if batch.audios else None
    out["tokens"] = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    return out


def _packed(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, Any]:
    """One row, samples back to back, positions restarting per sample, no attention mask."""
    resp = [len(r) for r in responses]
    index = torch.zeros(len(resp), max(resp), dtype=torch.long)  # [b, R]
    mask = torch.zeros(len(resp), max(resp), dtype=torch.bool)  # [b, R]
    total = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((1, total), pad_id, dtype=torch.long)
    pos = torch.zeros(1, total, dtype=torch.long)
    targets = torch.full((1, total - 1), IGNORE, dtype=torch.long)
    start = 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        q = p + r
        ids[0, start : start + len(q)] = torch.as_tensor(q)
        pos[0, start : start + len(q)] = torch.arange(len(q))
        first = start + len(p) - 1  # position predicting response token 0
        cols = torch.arange(first, first + resp[i])
        targets[0, cols] = torch.as_tensor(r)
        index[i, : resp[i]] = cols
        mask[i, : resp[i]] = True
        start += len(q)
    return {
        "input_ids": ids,
        "position_ids": pos,
        "attention_mask": None,
        "targets": targets,
        "index": index,
        "mask": mask,
    }


def _padded(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, Any]:
    """One right-padded row per sample with an attention mask (default positions 0..T-1)."""
    resp = [len(r) for r in responses]
    index = torch.zeros(len(resp), max(resp), dtype=torch.long)  # [b, R]
    mask = torch.zeros(len(resp), max(resp), dtype=torch.bool)  # [b, R]
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((len(resp), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(resp), length, dtype=torch.long)
    targets = torch.full((len(resp), length - 1), IGNORE, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        q = p + r
        ids[i, : len(q)] = torch.as_tensor(q)
        attention_mask[i, : len(q)] = 1
        first = len(p) - 1
        cols = torch.arange(first, first + resp[i])
        targets[i, cols] = torch.as_tensor(r)
        index[i, : resp[i]] = i * (length - 1) + cols
        mask[i, : resp[i]] = True
    return {
        "input_ids": ids,
        "position_ids": None,
        "attention_mask": attention_mask,
        "targets": targets,
        "index": index,
        "mask": mask,
    }


def _gather_response(full: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """[rows, L-1] per-position values -> [b, R] response values, 0 on padding."""
    out = full.reshape(-1)[mb["index"].to(full.device)]
    return torch.where(
        mb["mask"].to(full.device), out, torch.zeros((), dtype=out.dtype, device=out.device)
    )


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Every rank filled its own rows of ``t`` (zeros elsewhere): the whole tensor, everywhere."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


@dataclasses.dataclass
class LossInputs:
    """One micro-batch as the loss sees it: ``[b, R]`` response-aligned tensors on the device
    (``mask``: response tokens; ``loss_mask``: the tokens the policy loss trains on)."""

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
    every response token / sequence (KL, entropy and value terms)."""

    loss: dict[str, float]
    response: dict[str, float]


# ---------------------------------------------------------------------------------- recipe


def _gather_objects(obj: Any) -> list[Any]:
    """Every rank's (small, picklable) ``obj`` in rank order; ``[obj]`` in one process."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class GRPORecipe:
    """Build everything from the validated options in ``setup``, train, clean up."""

    def __init__(self, cfg: DictConfig, opts: GRPOOptions):
        self.cfg, self.opts = cfg, opts
        # Side effects start here, after build_options has accepted the config.
        self.output_dir = check_output_dir(
            opts.output_dir, resume=opts.resume, overwrite=opts.overwrite
        )
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
        self._reward_side: dict[str, tuple] = {}  # see _note_reward_side
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

    def _load_model(
        self,
        path: str,
        prepare=None,
        *,
        checkpointing: bool = False,
        compile: bool = False,
        shard: bool = True,
    ) -> nn.Module:
        """Load and shard one model (actor, reference, critic): under torchrun each rank builds
        it on the meta device and reads only its shards (lightrft.models.sharded).
        ``shard=False``: whole on every rank (an actor that DeepSpeed partitions)."""
        m = self.opts.model
        return load_parallel(
            path,
            dtype=m.dtype,
            device=self.dist.device,
            trust_remote_code=m.trust_remote_code,
            prepare=prepare,
            mesh=self.mesh if shard else None,
            activation_checkpointing=checkpointing,
            compile=compile,
            shard=None if shard else False,
        )

    def _prepare_actor(self, model: nn.Module) -> nn.Module:
        """Before sharding: freeze (or not) the vision / audio towers, add LoRA adapters."""
        m = self.opts.model
        if is_multimodal(model.config):  # before the optimizer and parallelize
            set_towers_trainable(model, vision=m.train_vision_tower, audio=m.train_audio_tower)
        return apply_lora(model, m.lora) if m.lora else model

    def _setup_models(self, cfg: DictConfig) -> None:
        """Actor (+ optimizer, scheduler), the frozen reference (KL only), the critic (gae)."""
        m, o = self.opts.model, self.opts
        _check_vision(o)  # the checkpoint exists now, whatever prepare wrote
        self.mesh = build_mesh(m.mesh, self.dist.device)
        self.model = self._load_model(
            m.path,
            self._prepare_actor,
            checkpointing=m.activation_checkpointing,
            compile=m.compile,
            shard=m.deepspeed is None,
        )
        # A vision- or audio-language actor: datasets take its processor (images / audio +
        # text), the towers are frozen unless model.train_vision_tower / train_audio_tower
        # (in _prepare_actor); everything else is the text path.
        self.vlm = is_vision_language(self.model.config)
        self.alm = is_audio_language(self.model.config)
        if is_multimodal(self.model.config):
            self.processor = load_processor(m.path, trust_remote_code=m.trust_remote_code)
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
            self.processor = self.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, params)
        # strategy=deepspeed: the engine steps the actor's optimizer (the reference and the
        # critic stay FSDP2-sharded, whichever the actor's strategy: one backward of the
        # combined loss reaches both, each reduces its own gradients).
        self.ds_engine = None
        if m.deepspeed is not None:
            from lightrft.models import deepspeed as lds

            self.ds_engine = lds.initialize(
                self.model,
                self.optimizer,
                m.deepspeed,
                micro_batch_size=o.train.micro_batch_size,
                accum=1,
                clip_grad_norm=o.clip_grad_norm,
            )
        # One scheduler step per RL step (as verl), whatever the number of optimizer steps.
        self.scheduler = warmup_cosine_scheduler(
            self.optimizer,
            warmup_steps=o.schedule.warmup_steps,
            total_steps=o.max_steps,
            min_lr_ratio=o.schedule.min_lr_ratio,
        )
        self.ref = None  # with LoRA the reference is the actor with its adapters off
        if o.kl is not None and m.lora is None:  # a frozen copy of the initial policy
            # Frozen before sharding: parallelize then gives its LM head a group of its own.
            self.ref = self._load_model(m.path, lambda model: model.requires_grad_(False))
            self.ref.eval()
        self.critic = self.critic_opt = self.critic_sched = None
        if o.critic is not None:
            self.critic = self._load_model(
                o.critic.path, self._build_critic, checkpointing=m.activation_checkpointing
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
        self.dataset = config.instantiate(cfg.dataset, self.processor)
        limit = getattr(self.engine, "max_model_len", None) or self.opts.engine.kwargs.get(
            "max_model_len"
        )
        if limit and hasattr(self.dataset, "fit_to_engine"):
            self.dataset.fit_to_engine(limit)
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
            self.eval_dataset = config.instantiate(cfg.eval_dataset, self.processor)

    def _load_checkpoint(self) -> None:
        models, opts, scheds = self._stateful()
        state = self.checkpointer.load_latest(
            models=models,
            optimizers=opts,
            schedulers=scheds,
            dataloaders=self.loader,
            required=True,
            config=OmegaConf.to_container(self.cfg, resolve=True),
            override_lr=self.opts.resume_override_lr,
        )
        self.step, extra = state.step, state.extra
        self.epoch = extra["epoch"]
        self.eval_history = [tuple(e) for e in extra.get("eval_history", [])]
        if self.kl_ctl is not None:
            self.kl_ctl.load_state_dict(extra["kl_ctl"])
        if self.normalizer is not None:
            self.normalizer.load_state_dict(extra["reward_norm"])
        self._sync_weights()

    @staticmethod
    def _build_critic(critic: nn.Module) -> nn.Module:
        """The critic: an HF causal-LM backbone whose LM head is replaced by a scalar value head
        ``hidden -> 1`` (zero-initialised, so values start at 0). Keeping the HF class means
        ``parallelize`` and ``forward_on_hidden`` handle it exactly like the actor."""
        hidden = critic.config.hidden_size
        param = next(critic.parameters())
        # A meta-device body (sharded loading) gets a real head: it is in no checkpoint, and
        # fully_shard moves it to the mesh's device.
        device = "cpu" if param.is_meta else param.device
        head = nn.Linear(hidden, 1, bias=True, device=device, dtype=param.dtype)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        critic.config.tie_word_embeddings = False
        critic.set_output_embeddings(head)
        return critic

    def _sync_weights(self, skip_frozen: bool = False) -> None:
        """The actor's weights into the rollout engine (collective): FSDP2's DTensor gathers,
        or under strategy=deepspeed module by module from the ZeRO partitions."""
        if self.ds_engine is not None:
            from lightrft.models.deepspeed import sync_weights as sync_from_deepspeed

            sync_from_deepspeed(self.ds_engine, self.engine)
        else:
            sync_weights(self.model, self.engine, skip_frozen=skip_frozen)

    def _stateful(self):
        if self.ds_engine is not None:  # it checkpoints the actor's optimizer itself
            if self.critic is None:
                return self.ds_engine, None, self.scheduler
            return (
                {"policy": self.ds_engine, "critic": self.critic},
                {"critic": self.critic_opt},
                {"policy": self.scheduler, "critic": self.critic_sched},
            )
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

    def _generate(self, prompt_ids: list[list[int]], params, images=None, audios=None) -> list:
        """Wake the engine (reloading released weights: a collective, so every rank calls this,
        with or without prompts) and generate. ``images`` / ``audios``: per prompt, its
        ``ImageInputs`` / ``AudioInputs`` or None (vision- / audio-language prompts)."""
        if self._weights_released:
            self.engine.wake_up(["weights"])
            self._sync_weights()
            self._weights_released = False
        self.engine.wake_up()
        if not prompt_ids:
            return []
        images = images or [None] * len(prompt_ids)
        audios = audios or [None] * len(prompt_ids)
        requests = [
            Request.with_media(ids, im, au)
            for ids, im, au in zip(prompt_ids, images, audios, strict=True)
        ]
        return self.engine.generate(requests, params)

    def _sleep(self) -> None:
        if self.opts.engine.sleep_level:
            self.engine.sleep(self.opts.engine.sleep_level)
            self._weights_released = self.opts.engine.sleep_level == 2

    def _score(self, prompts, texts, references, labels, wheres, conversations) -> tuple:
        """Rewards of this rank's samples: ``(total [B], parts, applied)``, float64 (exactly the
        python floats the reward functions returned). ``conversations``: each sample's prompt as
        its chat with its images (:func:`~lightrft.data.conversation`), for reward models."""
        if not texts:
            empty = torch.zeros(0, dtype=torch.float64)
            names = self.reward_names
            return empty, {n: empty for n in names}, {n: empty.bool() for n in names}
        out = self.reward_fn(prompts, texts, references, labels, conversations)
        total = out.total
        bad = (~torch.isfinite(total)).nonzero().flatten().tolist()
        if bad:  # reward functions are checked one by one; this catches weights and sums
            raise ValueError(
                f"non-finite total reward {total[bad[0]].item()} for sample "
                f"{bad[0]} (prompt {prompts[bad[0]][:60]!r}, from {wheres[bad[0]]})"
            )

        def f64(t: torch.Tensor) -> torch.Tensor:
            return torch.tensor(t.tolist(), dtype=torch.float64)

        parts = {n: f64(p) for n, p in out.parts.items()}
        applied = {n: torch.tensor([bool(x) for x in a.tolist()]) for n, a in out.applied.items()}
        self._note_reward_side(out)
        return f64(total), parts, applied

    def _note_reward_side(self, out) -> None:
        """Keep what a reward call reports beside the rewards, for the step's metrics: every head
        of a multi-head reward model (``out.heads``, over the samples its function scored) and
        the functions' own metrics (``out.extra``, e.g. a judge's parse failures)."""
        side = self._reward_side
        for key, scores in out.heads.items():
            vals = scores[out.applied[key.split("/")[0]]].double()
            s, q, c = side.get(key, (0.0, 0.0, 0))
            side[key] = (s + float(vals.sum()), q + float((vals**2).sum()), c + vals.numel())
        for key, value in out.extra.items():
            total, calls = side.get(f"extra:{key}", (0.0, 0))
            side[f"extra:{key}"] = (total + float(value), calls + 1)

    def _draw(self, step: int, draw: int, timer: PhaseTimer) -> RolloutBatch:
        """One rollout draw: this rank's prompts, n samples each, scored; then gathered so every
        rank holds every sample (groups stay consecutive and whole)."""
        prompts = self._next_prompts()
        with timer("rollout"):
            params = self._request_params(len(prompts["prompt_ids"]), step, draw)
            completions = self._generate(
                prompts["prompt_ids"], params, prompts.get("images"), prompts.get("audios")
            )
        rows = [c.request_index for c in completions]
        meta = {k: [prompts[k][i] for i in rows] for k in ("prompt", "reference", "label", "where")}
        messages = prompts.get("messages") or [None] * len(prompts["prompt_ids"])
        images = prompts.get("images") or [None] * len(prompts["prompt_ids"])
        chats = [conversation(messages[i], images[i]) for i in rows]
        texts = [c.text or "" for c in completions]
        with timer("scoring"):
            raw, parts, applied = self._score(
                meta["prompt"], texts, meta["reference"], meta["label"], meta["where"], chats
            )
            overlong, rewards = None, raw
            if self.opts.shaping.overlong is not None:
                lengths = [len(c.token_ids) for c in completions]
                penalty = overlong_penalty(lengths, *self.opts.shaping.overlong)
                overlong = torch.tensor([float(p) for p in penalty], dtype=torch.float64)
                rewards = raw + overlong  # [B]
        responses = [list(c.token_ids) for c in completions]
        lens = torch.tensor([len(r) for r in responses], dtype=torch.long)
        response_ids = pad_rows(responses, dtype=torch.long)  # [B, R]
        batch = RolloutBatch(
            prompt_ids=pad_rows([list(c.prompt_token_ids) for c in completions], dtype=torch.long),
            prompt_lens=torch.tensor([len(c.prompt_token_ids) for c in completions]),
            response_ids=response_ids,
            response_mask=torch.arange(response_ids.shape[1]) < lens.unsqueeze(1),
            rollout_logprobs=pad_rows([list(c.logprobs) for c in completions]),
            reward_raw=raw,
            rewards=rewards,
            overlong=overlong,
            reward_parts=parts,
            reward_applied=applied,
            prompts=meta["prompt"],
            references=meta["reference"],
            labels=meta["label"],
            wheres=meta["where"],
            texts=texts,
            finish_reasons=[c.finish_reason for c in completions],
            groups=[(step, draw, self.dist.rank, i) for i in rows],
            images=[prompts["images"][i] for i in rows] if self.vlm else None,
            audios=[prompts["audios"][i] for i in rows] if self.alm else None,
        )
        return batch.all_gather()

    def rollout(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, RolloutBatch, dict]:
        """The step's train batch (after dynamic sampling), every sample drawn (to log, with
        ``kept`` set) and the dynamic-sampling metrics."""
        o = self.opts
        stats: dict[str, float] = {}
        if not o.shaping.dynamic:
            drawn = self._draw(step, 0, timer)
            keep = list(range(len(drawn)))
        else:
            acc = DynamicSamplingAccumulator(
                o.rollout.prompts_per_step, o.rollout.n, max_draws=o.shaping.max_draws
            )
            draws: list[RolloutBatch] = []
            while not acc.done:
                d = self._draw(step, len(draws), timer)
                start = sum(len(b) for b in draws)
                acc.add(list(range(start, start + len(d))), d.rewards.float())
                draws.append(d)
            drawn = RolloutBatch.cat(draws)
            keep, stats = acc.take()
        self._sleep()
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
        dev = self.dist.device
        out = causal_lm_token_logprobs(
            model,
            mb["input_ids"].to(dev),
            targets=mb["targets"].to(dev),
            attention_mask=None if mb["attention_mask"] is None else mb["attention_mask"].to(dev),
            position_ids=None if mb["position_ids"] is None else mb["position_ids"].to(dev),
            temperature=self.opts.rollout.temperature,
            return_entropy=entropy,
            entropy_grad=entropy_grad,
            grad_hint=grad_hint,
            images=mb["images"],
            audios=mb["audios"],
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

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """This rank's share of ``rows`` (every world_size-th), shortest first, in micro-batches
        of ``train.micro_batch_size`` rows and ``train.micro_batch_tokens`` tokens at most. Every
        rank runs as many as the rank with the most (a collective when the token budget makes
        the counts differ): the others add empty ones, which build_micro_batch turns into
        dummy passes, so the FSDP collectives of forward and backward pair up."""
        tr = self.opts.train
        lengths = (batch.prompt_lens + batch.response_lens).tolist()
        mine = sorted(rows[self.dist.rank :: self.dist.world_size], key=lambda i: lengths[i])
        plan = plan_micro_batches(
            mine, lengths, tr.micro_batch_size, tr.micro_batch_tokens, packing=tr.packing
        )
        count = max(1, len(plan))
        if tr.micro_batch_tokens is None:  # known on every rank without a token budget
            per_rank = -(-len(rows) // self.dist.world_size)
            count = max(1, -(-per_rank // tr.micro_batch_size))
        elif self.dist.world_size > 1:
            count = int(all_reduce_max(count, self.dist.device).item())
        return plan + [[] for _ in range(count - len(plan))]

    @torch.no_grad()
    def precompute(self, batch: RolloutBatch, timer: PhaseTimer) -> None:
        """Old log-probs, entropy, reference log-probs and values of every sample, in place.

        Each rank computes its shard in micro-batches; a sum over ranks of the zero-filled
        ``[B, R]`` tensors gives every rank the whole batch (advantages and the high-entropy
        quantile are computed over the whole batch)."""
        o = self.opts
        exact_on_policy = o.train.ppo_epochs == 1 and (
            o.train.mini_batch_size is None or o.train.mini_batch_size >= len(batch)
        )
        kl_reward = o.kl is not None and o.kl.placement == "reward"
        need_old = o.old_logprobs == "trainer" and (
            not exact_on_policy or o.tis_mode is not None or kl_reward
        )
        need_entropy = o.loss.top_rho is not None
        jobs = [
            ("old_logprobs", self.model, need_old or need_entropy),
            ("reference", self.ref if self.ref is not None else self.model, o.kl is not None),
            ("values", self.critic, self.critic is not None),
        ]
        micro = self._micro_batches(batch, list(range(len(batch))))
        for name, model, flag in jobs:
            if not flag:
                continue
            model.eval()
            outs: dict[str, torch.Tensor] = {}
            # adapters_disabled: a no-op for a full model, the frozen base under LoRA.
            with timer(name), adapters_disabled(model) if name == "reference" else nullcontext():
                for idx in micro:
                    mb = build_micro_batch(batch, idx, self.pad_id, packing=o.train.packing)
                    if name == "values":
                        found = {"values": self._values(mb)}
                    else:
                        lp, ent = self._policy_logprobs(
                            model, mb, entropy=name == "old_logprobs" and need_entropy
                        )
                        found = {"entropy": ent} if ent is not None else {}
                        if name == "reference":
                            found["ref_logprobs"] = lp
                        elif need_old:
                            found["old_logprobs"] = lp
                    for field, t in found.items():
                        buf = outs.setdefault(field, torch.zeros(batch.response_ids.shape))
                        if idx:
                            buf[idx, : t.shape[1]] = t.float().cpu()
            if model is not self.ref:
                model.train()
            for field, buf in outs.items():
                setattr(batch, field, _sum_over_ranks(buf))

    # ------------------------------------------------------------------ advantages

    def advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Reward clip / normalisation, KL in the reward, then the configured estimator;
        fills ``batch.advantages`` (and ``returns``, ``loss_mask``)."""
        o, metrics = self.opts, {}
        rewards = batch.rewards.float()  # [B]
        if self.normalizer is not None:
            rewards = self.normalizer(rewards)
        elif o.shaping.reward_clip is not None:
            rewards = clip_rewards(rewards, o.shaping.reward_clip)
        mask = batch.response_mask  # [B, R]
        token_rewards = None
        if o.kl is not None and o.kl.placement == "reward":
            old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
            kl = estimate_kl(old, batch.ref_logprobs, o.kl.estimator)  # [B, R]
            token_rewards, kl_metrics = kl_in_reward(rewards, kl, mask, self.kl_ctl.coef)
            metrics["train/kl"] = float(kl_metrics["kl"])
        adv, returns = compute_advantages(
            o.estimator,
            mask=mask,
            rewards=rewards,
            token_rewards=token_rewards,
            values=batch.values,
            group_size=o.rollout.n,
            **o.adv_options,
        )  # [B, R]
        zero = torch.zeros((), dtype=torch.float32)
        batch.advantages = torch.where(mask, adv.float(), zero)
        if returns is not None:
            batch.returns = torch.where(mask, returns.float(), zero)
        valid = adv[mask]
        metrics["train/advantage/mean"] = float(valid.mean()) if valid.numel() else 0.0
        metrics["train/advantage/abs_mean"] = float(valid.abs().mean()) if valid.numel() else 0.0
        if o.loss.top_rho is not None:
            batch.loss_mask = high_entropy_mask(batch.entropy, mask, o.loss.top_rho) & mask
            frac = batch.loss_mask.sum() / mask.sum().clamp_min(1)
            metrics["train/high_entropy_frac"] = float(frac)
        return metrics

    # ------------------------------------------------------------------ loss

    def loss(self, mb: LossInputs, counts: Counts) -> tuple[torch.Tensor, dict[str, Any]]:
        """The whole loss of one micro-batch: edit this to change the algorithm.

        Policy loss (the configured objective), + entropy bonus, + KL to the reference, + the
        critic's value loss. Returns the sum to backpropagate and metrics (``actor_loss``: the
        policy-side total, logged as ``train/loss``)."""
        o = self.opts
        tis = {}
        if o.tis_mode is not None:
            tis = {"rollout_logprobs": mb.rollout_logprobs, "tis_mode": o.tis_mode}
            tis["tis_cap"] = o.tis_cap
        loss, pm = policy_loss(
            mb.logprobs,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            **o.loss.policy_kwargs(),
            **counts.loss,
            **tis,
        )
        metrics: dict[str, Any] = {"policy_loss": loss.detach(), **pm}
        norm = {"agg": o.loss.agg, "norm_len": o.loss.norm_len, **counts.response}
        if o.loss.entropy_coef:
            term, _ = entropy_bonus(mb.entropy, mb.mask, o.loss.entropy_coef, **norm)
            loss = loss + term
        if mb.entropy is not None:
            ent = mb.entropy.detach()
            metrics["entropy"] = (ent * mb.mask).sum() / mb.mask.sum().clamp_min(1)
        if mb.ref_logprobs is not None:
            kl = estimate_kl(mb.logprobs, mb.ref_logprobs, o.kl.estimator)
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
                clip=o.loss.value_clip,
                num_tokens=counts.response["num_tokens"],
            )
            loss = loss + vloss
            metrics.update({"value_loss": vloss.detach(), **vm})
        return loss, metrics

    def _loss_inputs(
        self, batch: RolloutBatch, idx: list[int], mb: dict, counts: Counts
    ) -> LossInputs:
        """The micro-batch's forward passes and ``[b, R]`` slices of the rollout batch."""
        o, dev = self.opts, self.dist.device
        mask = mb["mask"].to(dev)  # [b, R] response tokens
        width = mask.shape[1]
        zeros = torch.zeros(mask.shape, device=dev)

        def rows(t: torch.Tensor | None, *, fallback: torch.Tensor | None = None):
            if not idx:  # a rank without data: a dummy row the mask zeroes out
                return fallback
            return None if t is None else t[idx, :width].to(dev)

        kl_loss = o.kl is not None and o.kl.placement == "loss"
        old = batch.rollout_logprobs if o.old_logprobs == "engine" else batch.old_logprobs
        data = LossInputs(
            logprobs=zeros,  # the policy's, below
            entropy=None,
            mask=mask,
            loss_mask=mask if batch.loss_mask is None else rows(batch.loss_mask, fallback=mask),
            advantages=rows(batch.advantages, fallback=zeros),
            old_logprobs=rows(old),
            rollout_logprobs=rows(batch.rollout_logprobs) if o.tis_mode else None,
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
            entropy_grad=bool(o.loss.entropy_coef),
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

    def _grad_hint(self, data: LossInputs, counts: Counts, mb: dict) -> GradHint | None:
        """For a per-token objective (ppo, cpgd; the KL and entropy terms are per token too),
        the loss's gradient w.r.t. a chunk of log-probs follows from their values, so the fused
        kernel computes the LM-head gradients during the forward (3 vocabulary-sized matmuls
        instead of 4) from :meth:`loss` itself. If an edited :meth:`loss` is not per token, the
        kernel notices in backward, warns and recomputes exactly."""
        o = self.opts
        if not OBJECTIVES[o.loss.objective].per_token:
            return None  # gspo, gmpo: a token's gradient depends on its whole sequence
        if data.old_logprobs is None and o.tis_mode == "sequence_mask":
            return None  # sequence weights from the current log-probs (not reached: TIS has old)

        def loss(logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
            inputs = dataclasses.replace(data, logprobs=logprobs, entropy=entropy)
            return self.loss(inputs, counts)[0]

        return response_grad_hint(
            loss,
            mb["index"].to(self.dist.device),
            data.mask,
            mb["targets"].numel(),
            entropy_grad=bool(o.loss.entropy_coef),
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
        gen = torch.Generator().manual_seed(self.opts.seed * 7_919 + step * 131 + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def update(self, batch: RolloutBatch, step: int, timer: PhaseTimer) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches; one optimizer step per mini-batch."""
        o, n = self.opts, len(batch)
        mbs = min(o.train.mini_batch_size or n, n)
        acc = MetricAccumulator(
            {"ratio_min": "min", "ratio_max": "max", "loss": "sum", "tokens": "sum"},
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
                        backward(total, self.ds_engine)
                    loss_sum += float(metrics.pop("actor_loss"))
                    acc.add("tokens", mb["tokens"])
                    weight = float(mb["mask"].sum())  # the micro-batch's response tokens
                    for k, v in metrics.items():
                        acc.add(k, v, weight)
                with timer("training"):
                    grad_norms.append(
                        optimizer_step(
                            self.model, self.optimizer, o.clip_grad_norm or None, self.ds_engine
                        )
                    )
                    if self.critic is not None:
                        norm = o.critic.clip_grad_norm or None
                        critic_norms.append(optimizer_step(self.critic, self.critic_opt, norm))
                acc.add("loss", loss_sum)
        reduced = acc.reduce()
        metrics = {f"train/{k}": v for k, v in reduced.items()}
        # Each rank's loss is its part of sum / (global count / world): the sum over ranks is
        # world x the loss of the whole mini-batch.
        metrics["train/loss"] = reduced["loss"] / self.dist.world_size / len(grad_norms)
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["train/grad_norm_max"] = max(grad_norms)
        metrics["train/optimizer_steps"] = float(len(grad_norms))
        if critic_norms:
            metrics["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
        return metrics

    def sync(self, timer: PhaseTimer) -> None:
        with timer("weight_sync"):
            released = self._weights_released
            if released:
                self.engine.wake_up(["weights"])
                self._weights_released = False
            # An engine that kept its weights already holds the frozen ones (a frozen vision
            # tower): send only what training changes; after a release, send everything.
            self._sync_weights(skip_frozen=not released)

    # ------------------------------------------------------------------ eval

    def evaluate(self) -> dict[str, float]:
        """Greedy (``eval.temperature`` 0) generation on the held-out prompts, scored and summarised
        by the same code as the eval recipe (lightrft.evaluation); each rank takes every
        world_size-th prompt and the records of all ranks are summarised together."""
        ev = self.opts.eval
        indices = range(self.dist.rank, len(self.eval_dataset), self.dist.world_size)
        items = [self.eval_dataset[i] for i in indices]
        params = dataclasses.replace(
            self.sampling,
            n=1,
            temperature=ev.temperature,
            first_token_temperature=None,
            max_tokens=ev.max_tokens,
            seed=self.opts.seed,
        )
        name = ev.accuracy_reward or (self.reward_names[0] if self.reward_names else None)

        def generate(prompt_ids: list[list[int]]) -> list:
            # evaluate_items generates for the items in order: their media go alongside.
            completions = self._generate(
                prompt_ids,
                params,
                [it.get("images") for it in items],
                [it.get("audios") for it in items],
            )
            self._sleep()  # the engine's memory goes back before scoring
            return completions

        records = evaluate_items(items, indices, generate, self.reward_fn, n=1, accuracy=name)
        s = summarize([r for part in _gather_objects(records) for r in part], [1])
        out = {
            "eval/accuracy": s["pass@1"],
            "eval/reward": s["reward"],
            "eval/response_length": s["response_length"],
            "eval/samples": s["prompts"],
        }
        for k in self.reward_names:
            out[f"eval/reward/{k}"] = s[f"reward/{k}"]
        return out

    def _log_eval(self, step: int) -> None:
        m = self.evaluate()
        self.logger.log(step, m)
        self.eval_history.append((step, m["eval/accuracy"], m["eval/reward"]))

    # ------------------------------------------------------------------ metrics

    def _reward_side_metrics(self) -> dict[str, float]:
        """The step's reward-head means / stds and function metrics (averaged over the calls of
        the step: one per rank and draw), merged over ranks; then forgotten."""
        merged: dict[str, tuple] = {}
        for part in _gather_objects(self._reward_side):
            for key, vals in part.items():
                old = merged.get(key, (0,) * len(vals))
                merged[key] = tuple(a + b for a, b in zip(old, vals, strict=True))
        self._reward_side = {}
        m: dict[str, float] = {}
        for key, vals in sorted(merged.items()):
            if key.startswith("extra:"):
                m[f"reward/{key[len('extra:') :]}"] = vals[0] / max(vals[1], 1)
            elif vals[2]:
                mean = vals[0] / vals[2]
                m[f"reward/{key}/mean"] = mean
                m[f"reward/{key}/std"] = max(vals[1] / vals[2] - mean * mean, 0.0) ** 0.5
        return m

    def _rollout_metrics(self, drawn: RolloutBatch, batch: RolloutBatch) -> dict[str, float]:
        m: dict[str, float] = self._reward_side_metrics()
        totals = drawn.reward_raw.float()
        m["reward/total/mean"] = float(totals.mean())
        m["reward/total/std"] = float(totals.std(unbiased=False))
        for name in self.reward_names:
            vals = drawn.reward_parts[name][drawn.reward_applied[name]].float()
            if vals.numel():
                m[f"reward/{name}/mean"] = float(vals.mean())
                m[f"reward/{name}/std"] = float(vals.std(unbiased=False))
            m[f"reward/{name}/count"] = float(vals.numel())
        if drawn.overlong is not None:
            m["reward/overlong/mean"] = sum(drawn.overlong.tolist()) / len(drawn)
        lengths = drawn.response_lens.float()
        m["rollout/response_length/mean"] = float(lengths.mean())
        m["rollout/response_length/max"] = float(lengths.max())
        m["rollout/response_length/min"] = float(lengths.min())
        m["rollout/truncated_frac"] = drawn.finish_reasons.count("length") / len(drawn)
        m["rollout/prompt_length/mean"] = sum(drawn.prompt_lens.tolist()) / len(drawn)
        m["rollout/samples"] = float(len(drawn))
        m["rollout/train_samples"] = float(len(batch))
        # Groups whose rewards are all equal carry no group-relative signal.
        groups: dict[tuple, set] = {}
        for g, r in zip(drawn.groups, drawn.rewards.tolist(), strict=True):
            groups.setdefault(tuple(g), set()).add(r)
        solved_or_failed = sum(len(v) == 1 for v in groups.values())
        m["rollout/solved_or_failed_groups_frac"] = solved_or_failed / len(groups)
        return m

    def _write_trajectories(self, step: int, drawn: RolloutBatch, batch: RolloutBatch) -> None:
        if not self.dist.is_main:
            return
        folder = self.output_dir / "trajectories"
        folder.mkdir(exist_ok=True)
        kept = iter(range(len(batch)))  # the train batch holds the kept rows, in order
        with open(folder / f"step_{step:06d}.jsonl", "w") as f:
            for i in range(len(drawn)):
                r = int(drawn.response_lens[i])
                advantage = None
                if drawn.kept[i]:
                    j = next(kept)
                    if batch.advantages is not None and r:
                        advantage = sum(batch.advantages[j, :r].tolist()) / r
                record = {
                    "step": step,
                    "prompt": drawn.prompts[i],
                    "where": drawn.wheres[i],  # the prompt's record: file and line
                    "response": drawn.texts[i],
                    "reference": drawn.references[i],
                    "label": drawn.labels[i],
                    "reward": float(drawn.rewards[i]),
                    "reward_parts": {k: float(v[i]) for k, v in drawn.reward_parts.items()},
                    "overlong_penalty": None
                    if drawn.overlong is None
                    else float(drawn.overlong[i]),
                    "advantage": advantage,
                    "response_length": r,
                    "finish_reason": drawn.finish_reasons[i],
                    "kept": bool(drawn.kept[i]),
                }
                f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        bar = ProgressBar(self.opts.max_steps, initial=self.step, desc="grpo")
        timer = PhaseTimer(cuda_sync=self.dist.device.type == "cuda")
        if self.eval_dataset is not None and self.opts.eval.at_start and not self.resumed:
            with timer("eval"):
                self._log_eval(0)
            timer.reset()
        with Preemption() as preempt:
            while self.step < self.opts.max_steps:
                metrics = self.step_once(self.step + 1, timer)
                bar.update(1, reward=metrics["reward/total/mean"])
                self._eval_and_save(self.step)
                if preempt.stop_requested():  # SIGTERM / SIGINT: this step is done; save, exit
                    if not self.checkpointer.should_save(self.step):
                        self._save()
                    preempt.exit(self.checkpointer.latest())
        bar.close()
        self._finish()

    def step_once(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        """One RL step: rollout, scoring, advantages, update, schedules, weight sync, logging."""
        t0 = time.perf_counter()
        batch, drawn, metrics = self.rollout(step, timer)
        metrics.update(self._rollout_metrics(drawn, batch))
        if len(batch):
            self.precompute(batch, timer)
            metrics.update(self.advantages(batch))
            metrics.update(self.update(batch, step, timer))
        else:  # dynamic sampling found no informative group: no update, no NaN
            metrics["train/skipped"] = 1.0
        self._step_schedules(metrics, len(batch))
        if len(batch):  # weights changed (released weights are reloaded by the next rollout)
            self.sync(timer)
        self.step = step
        if self.opts.trajectories:
            self._write_trajectories(step, drawn, batch)
        metrics.update(self._step_metrics(drawn, timer, time.perf_counter() - t0, metrics))
        if step % self.opts.log_every == 0 or step == self.opts.max_steps:
            self.logger.log(step, metrics)
        return metrics

    def _eval_and_save(self, step: int) -> None:
        every = self.opts.eval.every
        if self.eval_dataset is not None and every and step % every == 0:
            if step != self.opts.max_steps:  # the final eval runs in _finish
                self._log_eval(step)
        if self.checkpointer.should_save(step):
            self._save()

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

    def _step_metrics(
        self, drawn: RolloutBatch, timer: PhaseTimer, elapsed: float, metrics: dict[str, float]
    ) -> dict[str, float]:
        """Phase times, throughput and peak memory of the step."""
        phases = timer.summary()
        gen_tokens = int(drawn.response_lens.sum())
        all_tokens = gen_tokens + int(drawn.prompt_lens.sum())
        out = {"time/step": elapsed}
        for phase in (
            "rollout",
            "scoring",
            "old_logprobs",
            "reference",
            "values",
            "training",
            "weight_sync",
        ):
            out[f"time/{phase}"] = phases.get(f"time/{phase}", 0.0)
        out["perf/rollout_tokens_per_s"] = gen_tokens / max(out["time/rollout"], 1e-9)
        if "train/tokens" in metrics:
            train_tokens = metrics.pop("train/tokens")
            out["perf/train_tokens_per_s"] = train_tokens / max(out["time/training"], 1e-9)
        out["perf/tokens_per_s"] = all_tokens / max(elapsed, 1e-9)
        out.update(reduce_metrics(peak_memory(self.dist.device), "max"))
        return out

    def _finish(self) -> None:
        if self.eval_dataset is not None and (
            not self.eval_history or self.eval_history[-1][0] != self.step
        ):
            self._log_eval(self.step)
        if self.ds_engine is not None:
            from lightrft.models.deepspeed import export_hf_engine

            export_hf_engine(self.ds_engine, self.processor, self.output_dir / "final")
        else:
            export_trained(
                self.model, self.processor, self.output_dir / "final", self.opts.model.lora
            )
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
        if self.kl_ctl is not None:
            extra["kl_ctl"] = self.kl_ctl.state_dict()
        if self.normalizer is not None:
            extra["reward_norm"] = self.normalizer.state_dict()
        self.checkpointer.save(
            self.step,
            models=models,
            optimizers=opts,
            schedulers=scheds,
            dataloaders=self.loader,
            config=OmegaConf.to_container(self.cfg, resolve=True),
            extra=extra,
        )

    def cleanup(self, clean: bool = True) -> None:
        self.logger.close()
        destroy(clean)


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: GRPOOptions) -> None:
    recipe = GRPORecipe(cfg, opts)
    recipe.setup(cfg)
    try:
        recipe.train()
    except BaseException:
        recipe.cleanup(clean=False)  # no barrier: a peer may be stuck or gone
        raise
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
