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
    GROUP_ESTIMATORS,
    KL_KINDS,
    OBJECTIVE_DEFAULTS,
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
            "objective": Literal[OBJECTIVES] | None,
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


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` when present and not null, else ``default`` (node may be None)."""
    if node is None:
        return default
    value = node.get(key)
    return default if value is None else value


def _set_keys(node: Any) -> set[str]:
    return {k for k, v in (node or {}).items() if v is not None}


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


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
    """Read and check the config, build everything in ``setup``, train, clean up."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.seed = cfg.get("seed", 0)
        self.max_steps = cfg.max_steps
        self.log_every = cfg.get("log_every", 1)
        ro = cfg.rollout
        self.group = ro.n
        self.prompts_per_step = ro.prompts_per_step
        self.max_tokens = ro.max_tokens
        self.temperature = float(_get(ro, "temperature", 1.0))
        tr = cfg.train
        self.ppo_epochs = _get(tr, "ppo_epochs", 1)
        self.mini_batch_size = _get(tr, "mini_batch_size")
        self.micro_batch_size = tr.micro_batch_size
        self.packing = _get(tr, "packing", False)
        self.shuffle = _get(tr, "shuffle", True)
        for key, value in (
            ("max_steps", self.max_steps),
            ("rollout.n", self.group),
            ("rollout.prompts_per_step", self.prompts_per_step),
            ("rollout.max_tokens", self.max_tokens),
            ("log_every", self.log_every),
            ("train.ppo_epochs", self.ppo_epochs),
            ("train.micro_batch_size", self.micro_batch_size),
        ):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(
                f"train.mini_batch_size must be >= 1 or null, got {self.mini_batch_size}"
            )
        if not self.temperature > 0:
            raise ValueError(
                f"rollout.temperature must be > 0 (the trainer scores tokens at the sampling "
                f"temperature), got {self.temperature}"
            )

        alg = cfg.algorithm
        adv = alg.advantage
        self.estimator = adv.estimator
        # Only the options the config sets go to the estimator, which rejects inapplicable ones.
        self.adv_options = {k: adv[k] for k in _set_keys(adv) - {"estimator"}}
        # Unknown or inapplicable options fail now, not after the first rollout.
        compute_advantages(
            self.estimator,
            mask=torch.ones(2, 1),
            rewards=torch.zeros(2),
            values=torch.zeros(2, 1),
            group_size=2,
            **self.adv_options,
        )
        if self.estimator in GROUP_ESTIMATORS and self.group < 2:
            raise ValueError(
                f"advantage estimator {self.estimator!r} needs a group: set rollout.n >= 2 "
                f"(got {self.group})"
            )

        pl = alg.get("policy_loss")
        self.objective = _get(pl, "objective", "ppo")
        defaults = OBJECTIVE_DEFAULTS[self.objective]
        self.agg = _get(pl, "agg", defaults["agg"])
        self.loss_kwargs = {
            "objective": self.objective,
            "clip_low": float(_get(pl, "clip_low", defaults["clip_low"])),
            "clip_high": float(_get(pl, "clip_high", defaults["clip_high"])),
            "dual_clip": _get(pl, "dual_clip"),
            "agg": self.agg,
            "norm_len": _get(pl, "norm_len"),
        }
        if self.loss_kwargs["norm_len"] is not None and self.agg != "seq_mean_token_sum_norm":
            raise ValueError(
                f"algorithm.policy_loss.norm_len is used only by agg=seq_mean_token_sum_norm "
                f"(agg is {self.agg!r}); remove it"
            )
        if self.objective == "gmpo" and self.agg != "seq_mean_token_mean":
            raise ValueError(
                "objective 'gmpo' aggregates seq_mean_token_mean; remove "
                "algorithm.policy_loss.agg or set it to seq_mean_token_mean"
            )
        # Fail on bad clip settings now rather than after the first rollout.
        policy_loss(torch.zeros(1, 1), None, torch.zeros(1), torch.ones(1, 1), **self.loss_kwargs)

        self.old_source = alg.get("old_logprobs") or "trainer"
        tis = alg.get("tis")
        self.tis_mode = _get(tis, "mode")
        if self.tis_mode is None and _set_keys(tis):
            raise ValueError(
                "algorithm.tis.cap is set but algorithm.tis.mode is not: set mode "
                "(token | sequence_mask) or remove the tis section"
            )
        self.tis_cap = float(_get(tis, "cap", 2.0))
        if self.tis_mode is not None and self.old_source != "trainer":
            raise ValueError(
                "algorithm.tis corrects the engine's log-probs towards the trainer's old "
                "log-probs, so it needs algorithm.old_logprobs=trainer (got engine)"
            )
        _positive("algorithm.tis.cap", self.tis_cap)

        kl = alg.get("kl")
        self.kl_on = bool(_set_keys(kl))
        if self.kl_on:
            if kl.get("coef") is None or not kl.coef > 0:
                raise ValueError(
                    f"algorithm.kl.coef must be > 0 (got {kl.coef}); remove the algorithm.kl "
                    "section to train without a KL and without a reference model"
                )
            self.kl_kind = _get(kl, "estimator", "k3")
            self.kl_placement = _get(kl, "placement", "loss")
            controller = _get(kl, "controller", "fixed")
            if controller == "fixed" and _set_keys(kl) & {"target", "horizon"}:
                raise ValueError("algorithm.kl.target / horizon apply to controller=adaptive only")
            self.kl_ctl = build_kl_controller(
                controller, float(kl.coef), target=_get(kl, "target"), horizon=_get(kl, "horizon")
            )
        ent = alg.get("entropy")
        self.entropy_coef = float(_get(ent, "coef", 0.0))
        self.top_rho = _get(ent, "top_rho")
        if self.top_rho is not None and not 0 < self.top_rho <= 1:
            raise ValueError(f"algorithm.entropy.top_rho must be in (0, 1], got {self.top_rho}")

        self.gae = self.estimator == "gae"
        value = alg.get("value")
        critic = cfg.get("critic")
        if not self.gae and (_set_keys(value) or _set_keys(critic)):
            raise ValueError(
                f"algorithm.value and critic train a critic, used only by estimator=gae "
                f"(estimator is {self.estimator!r}); remove them"
            )
        if self.gae and _get(critic, "optimizer") is None:
            raise ValueError(
                "estimator=gae needs a critic: add a `critic:` section with its optimizer"
            )
        self.value_clip = _get(value, "clip", 0.5)

        shaping = alg.get("shaping")
        self.reward_norm = _get(shaping, "reward_norm", False)
        self.reward_clip = _get(shaping, "reward_clip")
        _positive("algorithm.shaping.reward_clip", self.reward_clip)
        over = _get(shaping, "overlong")
        self.overlong = None
        if _set_keys(over):
            if over.get("buffer") is None:
                raise ValueError(
                    "algorithm.shaping.overlong needs buffer (tokens before max_len "
                    "where the penalty ramps up)"
                )
            self.overlong = (
                int(_get(over, "max_len", self.max_tokens)),
                int(over.buffer),
                float(_get(over, "factor", 1.0)),
            )
            overlong_penalty([0], *self.overlong)  # validates
        ds = _get(shaping, "dynamic_sampling")
        self.dynamic = bool(_set_keys(ds)) and _get(ds, "enabled", True)
        if _set_keys(ds) and not self.dynamic and _set_keys(ds) - {"enabled"}:
            raise ValueError(
                "algorithm.shaping.dynamic_sampling.max_draws is set but "
                "dynamic sampling is disabled"
            )
        self.max_draws = _get(ds, "max_draws", 10)
        if self.dynamic and self.group < 2:
            raise ValueError("dynamic sampling needs rollout.n >= 2")

        ev = cfg.get("eval")
        if _set_keys(ev) and cfg.get("eval_dataset") is None:
            raise ValueError("the eval section needs an eval_dataset")
        self.eval_every = _get(ev, "every")
        self.eval_at_start = _get(ev, "at_start", True)
        self.eval_temperature = float(_get(ev, "temperature", 0.0))
        self.eval_max_tokens = _get(ev, "max_tokens", self.max_tokens)
        self.accuracy_reward = _get(ev, "accuracy_reward")
        self.trajectories = bool(cfg.get("trajectories", False))
        self.max_grad_norm = cfg.get("clip_grad_norm")

        ecfg = cfg.get("engine") or {}
        self.sleep_level = _get(ecfg, "sleep_level", 1)
        self.engine_backend = backend = _get(ecfg, "backend", "native")
        own = {
            "native": ("max_prefill_tokens", "max_kv_tokens", "compile"),
            "vllm": ("gpu_memory_utilization", "tensor_parallel_size"),
        }
        other = own["vllm" if backend == "native" else "native"]
        wrong = sorted(k for k in other if ecfg.get(k) is not None)
        if wrong:
            raise ValueError(f"engine.{wrong[0]} does not apply to engine.backend={backend}")
        keys = ("dtype", "max_model_len", "max_num_seqs", *own[backend])
        self.engine_kwargs = {k: ecfg[k] for k in keys if ecfg.get(k) is not None}
        self.output_dir = check_output_dir(cfg.output_dir)
        self.dist = init_distributed(cfg.get("device"))
        if self.prompts_per_step % self.dist.world_size:
            raise ValueError(
                f"rollout.prompts_per_step={self.prompts_per_step} must be a multiple of the "
                f"number of processes ({self.dist.world_size})"
            )
        self.checkpointer = Checkpointer(
            self.output_dir, keep_last=cfg.get("keep_last", 2), every_n_steps=cfg.get("save_every")
        )
        if cfg.get("resume", False) and self.checkpointer.latest() is None:
            raise ValueError(f"resume=true but no checkpoint found in {self.checkpointer.root}")

    # ------------------------------------------------------------------ setup

    def setup(self, cfg: DictConfig) -> None:
        torch.manual_seed(self.seed)
        if self.dist.is_main:
            for node in cfg.get("prepare") or []:
                config.instantiate(node)
        barrier()
        mcfg = cfg.model
        trust = mcfg.get("trust_remote_code", False)
        dtype = mcfg.get("dtype", "float32")
        dev = self.dist.device
        self.tokenizer = load_tokenizer(mcfg.path, trust_remote_code=trust)
        self.pad_id = self.tokenizer.pad_token_id
        self.model = parallelize(
            load_causal_lm(mcfg.path, dtype=dtype, device=dev, trust_remote_code=trust),
            activation_checkpointing=mcfg.get("activation_checkpointing", False),
            compile=mcfg.get("compile", False),
        )
        self.optimizer = config.instantiate(cfg.optimizer, self.model.parameters())
        sched = cfg.get("lr_scheduler") or {}
        # One scheduler step per RL step (as verl), whatever the number of optimizer steps.
        self.scheduler = warmup_cosine_scheduler(
            self.optimizer,
            warmup_steps=sched.get("warmup_steps", 0),
            total_steps=self.max_steps,
            min_lr_ratio=sched.get("min_lr_ratio", 0.0),
        )

        self.ref = None
        if self.kl_on:  # a frozen copy of the initial policy, sharded like the actor
            self.ref = parallelize(
                load_causal_lm(mcfg.path, dtype=dtype, device=dev, trust_remote_code=trust)
            )
            self.ref.requires_grad_(False).eval()

        self.critic = self.critic_opt = self.critic_sched = None
        if self.gae:
            ccfg = cfg.critic
            self.critic = parallelize(
                self._build_critic(
                    ccfg.get("path") or mcfg.path, dtype=dtype, device=dev, trust=trust
                ),
                activation_checkpointing=mcfg.get("activation_checkpointing", False),
            )
            self.critic_opt = config.instantiate(ccfg.optimizer, self.critic.parameters())
            csched = ccfg.get("lr_scheduler") or {}
            self.critic_sched = warmup_cosine_scheduler(
                self.critic_opt,
                warmup_steps=csched.get("warmup_steps", 0),
                total_steps=self.max_steps,
                min_lr_ratio=csched.get("min_lr_ratio", 0.0),
            )
            self.critic_max_norm = ccfg.get("clip_grad_norm")

        # The engine holds its own inference copy of the weights, loaded from the same directory.
        if self.engine_backend == "vllm":  # CUDA only; the adapter imports vLLM lazily
            from lightrft.engine import VLLMEngine

            self.engine = VLLMEngine(mcfg.path, seed=self.seed, **self.engine_kwargs)
        else:
            self.engine = NativeEngine(
                mcfg.path, self.tokenizer, device=dev, seed=self.seed, **self.engine_kwargs
            )
        ro = cfg.rollout
        self.sampling = SamplingParams(
            n=self.group,
            temperature=self.temperature,
            top_p=_get(ro, "top_p", 1.0),
            top_k=_get(ro, "top_k", 0),
            max_tokens=self.max_tokens,
            stop_token_ids=list(_get(ro, "stop_token_ids", [])),
            first_token_temperature=_get(ro, "first_token_temperature"),
        )
        self.sampling.validate()

        self.reward_fn = build_reward(cfg.reward)
        self.reward_names = list(getattr(self.reward_fn, "functions", {}) or [])
        if self.accuracy_reward is not None and self.accuracy_reward not in self.reward_names:
            raise ValueError(
                f"eval.accuracy_reward={self.accuracy_reward!r} is not a reward "
                f"function; they are {self.reward_names}"
            )
        self.normalizer = (
            RunningRewardNormalizer(clip=self.reward_clip) if self.reward_norm else None
        )

        self.dataset = config.instantiate(cfg.dataset, self.tokenizer)
        self.loader = build_dataloader(
            self.dataset,
            batch_size=self.prompts_per_step // self.dist.world_size,
            shuffle=True,
            seed=self.seed,
            collate_fn=collate_prompts,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            drop_last=True,
        )
        self.eval_dataset = None
        if cfg.get("eval_dataset") is not None:
            self.eval_dataset = config.instantiate(cfg.eval_dataset, self.tokenizer)
        self._it = None
        self._weights_released = False

        self.step, self.epoch = 0, 0
        self.eval_history: list[tuple[int, float, float]] = []
        resumed = bool(cfg.get("resume", False))
        if resumed:
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
            if self.kl_on:
                self.kl_ctl.load_state_dict(extra["kl_ctl"])
            if self.normalizer is not None:
                self.normalizer.load_state_dict(extra["reward_norm"])
            sync_weights(self.model, self.engine)
        metrics_cfg = cfg.get("metrics") or {}
        self.logger = MetricLogger(
            self.output_dir,
            tensorboard=metrics_cfg.get("tensorboard", True),
            wandb=metrics_cfg.get("wandb", False) or False,
            config=OmegaConf.to_container(cfg, resolve=True),
            resume_step=self.step if resumed else None,
        )
        self.resumed = resumed
        data_stats = {
            f"data/{k}": v for k, v in (getattr(self.dataset, "stats", None) or {}).items()
        }
        if data_stats and not resumed:
            self.logger.log(0, data_stats)

    @staticmethod
    def _build_critic(path: str, *, dtype: str, device, trust: bool) -> nn.Module:
        """The critic: an HF causal-LM backbone whose LM head is replaced by a scalar value head
        ``hidden -> 1`` (zero-initialised, so values start at 0). Keeping the HF class means
        ``parallelize`` and ``forward_on_hidden`` handle it exactly like the actor."""
        critic = load_causal_lm(path, dtype=dtype, device=device, trust_remote_code=trust)
        hidden = critic.config.hidden_size
        head = nn.Linear(hidden, 1, bias=True, device=device, dtype=next(critic.parameters()).dtype)
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
            ((self.seed * 1_000_003 + step) * 1_009 + draw) * 1_013 + self.dist.rank
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
        if self.sleep_level:
            self.engine.sleep(self.sleep_level)
            self._weights_released = self.sleep_level == 2

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
                if self.overlong is not None:
                    s["overlong"] = float(
                        overlong_penalty([len(s["response_ids"])], *self.overlong)[0]
                    )
                    r += s["overlong"]
                s["reward"] = r
        return [s for part in _all_gather(samples) for s in part]

    def rollout(self, step: int, timer: PhaseTimer) -> tuple[list[dict], list[dict], dict]:
        """The step's train batch (after dynamic sampling) and every sample drawn (to log)."""
        drawn: list[dict] = []
        stats: dict[str, float] = {}
        if not self.dynamic:
            batch = self._draw(step, 0, timer)
            drawn = batch
        else:
            acc = DynamicSamplingAccumulator(
                self.prompts_per_step, self.group, max_draws=self.max_draws
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
            temperature=self.temperature,
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
        return mine, max(1, -(-per_rank // self.micro_batch_size))

    @torch.no_grad()
    def precompute(self, batch: list[dict], timer: PhaseTimer) -> None:
        """Old log-probs, entropy, reference log-probs and values of every sample, in place.

        Each rank computes its shard in micro-batches, then the results are gathered so every
        rank holds them for the whole batch (advantages and the high-entropy quantile are
        computed over the whole batch)."""
        exact_on_policy = self.ppo_epochs == 1 and (
            self.mini_batch_size is None or self.mini_batch_size >= len(batch)
        )
        kl_reward = self.kl_on and self.kl_placement == "reward"
        need_old = self.old_source == "trainer" and (
            not exact_on_policy or self.tis_mode is not None or kl_reward
        )
        need_entropy = self.top_rho is not None
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
                    idx = mine[m * self.micro_batch_size : (m + 1) * self.micro_batch_size]
                    mb = build_micro_batch(
                        [batch[i] for i in idx], self.pad_id, packing=self.packing
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
        elif self.reward_clip is not None:
            rewards = clip_rewards(rewards, self.reward_clip)
        mask = _pad_rows([[1.0] * len(s["response_ids"]) for s in batch]) > 0  # [B, R]
        token_rewards = None
        if self.kl_on and self.kl_placement == "reward":
            kl = estimate_kl(
                _pad_rows([s["old" if "old" in s else "rollout_logprobs"] for s in batch]),
                _pad_rows([s["ref"] for s in batch]),
                self.kl_kind,
            )  # [B, R]
            token_rewards, kl_metrics = kl_in_reward(rewards, kl, mask, self.kl_ctl.coef)
            metrics["train/kl"] = float(kl_metrics["kl"])
            self.kl_ctl.update(metrics["train/kl"], len(batch))
        values = _pad_rows([s["values"] for s in batch]) if self.gae else None
        adv, returns = compute_advantages(
            self.estimator,
            mask=mask,
            rewards=rewards,
            token_rewards=token_rewards,
            values=values,
            group_size=self.group,
            **self.adv_options,
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
        if self.top_rho is not None:
            ent = _pad_rows([s["entropy"] for s in batch])
            keep = high_entropy_mask(ent, mask, self.top_rho)
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
        mbs = min(self.mini_batch_size or n, n)
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

        for epoch in range(self.ppo_epochs):
            order = list(range(n))
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 7_919 + step * 131 + epoch)
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
                        for i in mine[m * self.micro_batch_size : (m + 1) * self.micro_batch_size]
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
                    gn = clip_grad_norm(self.model, self.max_grad_norm or None)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.critic is not None:
                        critic_norms.append(
                            clip_grad_norm(self.critic, self.critic_max_norm or None)
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
        mb = build_micro_batch(samples, self.pad_id, packing=self.packing)
        width = mb["mask"].shape[1]
        mask = mb["mask"].to(self.dist.device)  # [B, R] response tokens
        if samples and self.top_rho is not None:
            loss_mask = self._tensor(samples, "loss_mask", width) > 0
        else:
            loss_mask = mask
        want_entropy = True  # logged; and the bonus needs it with a gradient
        lp, ent = self._policy_logprobs(self.model, mb, entropy=want_entropy)  # [B, R]
        adv = self._tensor(samples, "advantages", width) if samples else torch.zeros_like(lp)
        if not samples:
            old = None
        elif self.old_source == "engine":
            old = self._tensor(samples, "rollout_logprobs", width)
        elif "old" in samples[0]:
            old = self._tensor(samples, "old", width)
        else:
            old = None  # exactly on-policy: old == current, ratio 1
        extra = {}
        if self.tis_mode is not None and samples:
            extra = {
                "rollout_logprobs": self._tensor(samples, "rollout_logprobs", width),
                "tis_mode": self.tis_mode,
                "tis_cap": self.tis_cap,
            }
        loss, pm = policy_loss(lp, old, adv, loss_mask, **self.loss_kwargs, **counts, **extra)
        metrics = {"policy_loss": loss.detach()}
        metrics.update(pm)
        total = loss
        norm = {"agg": self.agg, "norm_len": self.loss_kwargs["norm_len"], **resp_counts}
        if self.entropy_coef:
            term, _ = entropy_bonus(ent, mask, self.entropy_coef, **norm)
            total = total + term
        metrics["entropy"] = (ent.detach() * mask).sum() / mask.sum().clamp_min(1)
        if self.kl_on and self.kl_placement == "loss":
            ref = self._tensor(samples, "ref", width) if samples else lp.detach()
            kl = estimate_kl(lp, ref, self.kl_kind)
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
                clip=self.value_clip,
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
            temperature=self.eval_temperature,
            first_token_temperature=None,
            max_tokens=self.eval_max_tokens,
            seed=self.seed,
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
        name = self.accuracy_reward or (self.reward_names[0] if self.reward_names else None)
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
        if self.overlong is not None:
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
        bar = ProgressBar(self.max_steps, initial=self.step, desc="grpo")
        timer = PhaseTimer(cuda_sync=self.dist.device.type == "cuda")
        if self.eval_dataset is not None and self.eval_at_start and not self.resumed:
            with timer("eval"):
                self._log_eval(0)
            timer.reset()
        while self.step < self.max_steps:
            step = self.step + 1
            t0 = time.perf_counter()
            batch, drawn, ds_stats = self.rollout(step, timer)
            metrics = self._rollout_metrics(drawn, batch)
            metrics.update(ds_stats)
            if batch:
                self.precompute(batch, timer)
                metrics.update(self.advantages(batch))
                metrics.update(self.update(batch, step, timer))
                if self.kl_on and self.kl_placement == "loss" and "train/kl" in metrics:
                    self.kl_ctl.update(metrics["train/kl"], len(batch))
            else:  # dynamic sampling found no informative group: no update, no NaN
                metrics["train/skipped"] = 1.0
            if self.kl_on:
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
            if self.trajectories:
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
            if step % self.log_every == 0 or step == self.max_steps:
                self.logger.log(step, metrics)
            bar.update(1, reward=metrics["reward/total/mean"])
            if (
                self.eval_dataset is not None
                and self.eval_every
                and (step % self.eval_every == 0)
                and step != self.max_steps
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
        if self.kl_on:
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


@config.parse(schema=CONFIG_SCHEMA)
def recipe_main(cfg: DictConfig) -> None:
    recipe = GRPORecipe(cfg)
    recipe.setup(cfg)
    try:
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
