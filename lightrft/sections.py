"""The config sections that more than one recipe reads, declared once.

Each is a frozen :class:`~lightrft.config.Section`: the dataclass *is* the schema (types, allowed
values, defaults, ``null`` means the default), and its ``resolve`` holds the rules across its
keys. A recipe composes them into its own config class next to its own sections; the tables in
docs/config.md are generated from these classes (``python tests/test_sections.py --write``; the
test keeps them equal).

Most shared keys sit at the top level of a config (``output_dir``, ``optimizer``, ``strategy``,
``batch_size``...): those sections are composed with ``option(flat=True)``. The run's own
sections (checkpointing, resume) are :class:`lightrft.training.run.TrainingRunConfig`, which
reads checkpoints and so sits in the training layer.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf

from lightrft.config import Component, ConfigError, Section, option, resolve, section

DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
DType = Literal[DTYPE_NAMES]
STRATEGIES = ("fsdp2", "deepspeed")


# ------------------------------------------------------------------------------------ run


@section
class MetricsConfig(Section):
    """``metrics:``: where the run's metrics go besides ``metrics.jsonl``."""

    tensorboard: bool = option(True, doc="TensorBoard events under `<output_dir>/tensorboard`")
    wandb: bool | dict = option(False, doc="Weights & Biases: `true`, or `wandb.init` arguments")


def require_output_dir(path: str | os.PathLike | None) -> None:
    """Refuse an unset ``output_dir`` (``None`` or blank): the one rule :class:`RunConfig` and
    :func:`lightrft.training.outputs.check_output_dir` apply."""
    if path is None or not str(path).strip():
        raise ConfigError(
            "output_dir is not set: give the run a directory for its checkpoints, "
            "metrics and export (output_dir=...)"
        )


@section
class RunConfig(Section):
    """Where a run writes, its seed and device, and what runs before anything loads."""

    output_dir: str = option(doc="the run's directory: checkpoints, metrics, export")
    seed: int = option(0, doc="seeds every RNG of the run")
    device: Literal["cpu", "cuda"] | None = option(
        None, doc="default: cuda when available (cuda where there is none is refused)"
    )
    prepare: list[Component] | None = option(
        None, doc="components run once on rank 0 before anything loads (make data, a model)"
    )
    collective_timeout_s: float | None = option(
        None,
        gt=0,
        doc="seconds one collective waits for its peers before the rank fails (a peer died or "
        "hangs); default: torch's, 30 min on gloo (CPU), 10 min on nccl",
    )

    def resolve(self, at: str) -> RunConfig:
        require_output_dir(self.output_dir)
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "device=cuda but CUDA is not available on this machine; use device=cpu "
                    "(or leave device unset: cuda when available)"
                )
        return self


# -------------------------------------------------------------------------- model paths


def looks_local(path: str) -> bool:
    """A string that is a local path rather than a hub id (``namespace/name``): absolute, ``./``,
    ``../``, ``~`` or more parts than a hub id has (also lightrft.models.check_local's rule)."""
    p = Path(path)
    return p.is_absolute() or path.startswith((".", "~")) or len(p.parts) > 2


def _strings(node: Any) -> Iterable[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            if k != "_component_":
                yield from _strings(v)
    elif isinstance(node, Sequence):
        for v in node:
            yield from _strings(v)


def prepared(path: str, prepare: Iterable[Any] | None) -> bool:
    """Whether a ``prepare`` step names ``path`` or a directory above it (as any argument, e.g.
    ``out_dir``): the step may write it, so it need not exist (or be complete) before the run."""

    def absolute(p: str) -> Path:
        return Path(os.path.abspath(Path(p).expanduser()))

    named = {absolute(v) for step in prepare or () for v in _strings(step) if v.strip()}
    return not named.isdisjoint({absolute(path), *absolute(path).parents})


def check_model_path(
    path: str,
    key: str = "model.path",
    *,
    prepare: Iterable[Any] | None = None,
    loading: bool = False,
    checkpoint: bool = False,
) -> None:
    """Refuse a model path that cannot load, naming ``key`` (a ``ValueError``).

    A training checkpoint (``<output_dir>/checkpoints/step_N``) is refused with the
    ``lightrft export`` command that makes a model of it, unless ``checkpoint=True``: the
    caller exports it itself (:func:`lightrft.export.resolve_model_dir`) and checks
    its export record (:func:`~lightrft.export.read_export_spec`).

    Validation (``loading=False``, ``lightrft validate`` and the start of ``run``) decides only
    on what is on disk now, like :func:`lightrft.models.check_towers`: a file, or a directory
    with neither ``config.json`` nor ``adapter_config.json``, is refused; a local path that does
    not exist is refused when its parent directory exists (a typo: nothing will appear there),
    and left to the second check when its parent is missing too (a directory an earlier run of
    a pipeline writes, ``outputs/tiny/add_sft/final``). A path a ``prepare`` step names is left
    to the second check. Hub ids (``Qwen/Qwen2.5-0.5B-Instruct``) pass. The second check
    (``loading=True``: after the prepare steps, before any model loads) refuses every local
    path that is not a model directory."""
    path = str(path)
    error = ConfigError if loading else ValueError  # during the run: a user error (exit 2)
    if is_checkpoint_dir(path):
        if checkpoint:
            return
        raise error(
            f"{key}={path!r} is a training checkpoint, not a model directory: export it "
            f"first (lightrft export {path} --out DIR) and give DIR"
        )
    p = Path(path).expanduser()
    later = not loading and prepared(path, prepare)
    if p.is_dir():
        if later or (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
            return
        hint = (
            f"; it is a training run's directory: use its export, {str(p / 'final')!r}"
            if (p / "checkpoints").is_dir()
            else " (give an HF model directory, a hub id or a LightRFT export <output_dir>/final)"
        )
        raise error(f"{key}={path!r} is not a model directory: it has no config.json{hint}")
    if p.exists():
        raise error(f"{key}={path!r} is a file, not a model directory")
    if not looks_local(path) or later or (not loading and not p.parent.is_dir()):
        return
    siblings = [c.name for c in p.parent.iterdir()] if p.parent.is_dir() else []
    near = difflib.get_close_matches(p.name, siblings, n=1)
    hint = f" (did you mean {str(p.parent / near[0])!r}?)" if near else ""
    raise error(f"{key}={path!r} does not exist{hint}")


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` is a training checkpoint directory (``step_N/`` with ``meta.json``,
    DCP or per-rank files) rather than a model directory: both hold a ``config.json``."""
    p = Path(path)
    if not (p / "meta.json").is_file():
        return False
    return re.match(r"^step_\d+$", p.name) is not None or any(
        (p / f).is_file() for f in (".metadata", "rank_00000.json")
    )


# ---------------------------------------------------------------------------------- model


@section
class ModelConfig(Section):
    """``model:``: the checkpoint to load."""

    path: str = option(
        doc="an HF model directory or hub id (or a LightRFT export, `<output_dir>/final`)"
    )
    dtype: DType = option("float32", doc="parameter dtype")
    trust_remote_code: bool = option(False, doc="let transformers run the checkpoint's code")
    chat_template_args: dict = option(
        default_factory=dict,
        doc="variables every chat-template render passes, e.g. `{enable_thinking: false}` "
        "(Qwen3's no-think mode); a name the template never reads is refused",
    )


@section
class TrainedModelConfig(ModelConfig):
    """``model:`` of a model that trains."""

    activation_checkpointing: bool = option(False, doc="recompute each block in backward")
    compile: bool = option(False, doc="torch.compile each decoder block")


@section
class PolicyModelConfig(TrainedModelConfig):
    """``model:`` of a causal LM that trains (text, vision- or audio-language)."""

    train_vision_tower: bool = option(False, doc="vision-language models: train the vision tower")
    train_audio_tower: bool = option(False, doc="audio-language models: train the audio tower")


# ------------------------------------------------------------------------------- strategy


@section
class LoraConfig(Section):
    """``lora:``: low-rank adapters instead of a full fine-tune (Hu et al. 2021,
    arXiv:2106.09685). The section switches LoRA on; absent or null: full fine-tune."""

    rank: int | None = option(None, ge=1, doc="adapter rank (required in the section)")
    alpha: float | None = option(None, gt=0, doc="scaling numerator; default `2 * rank`")
    dropout: float = option(0.0, doc="dropout on the adapters' input, in [0, 1)")
    target_modules: str | list[str] = option(
        "auto", doc="`auto` (every linear layer of the decoder blocks) or module names"
    )
    trained_modules: list[str] = option(
        (), doc="modules trained in full beside the adapters (embeddings, LM head)"
    )
    export_merged: bool = option(False, doc="also export the merged full model at the end")

    def resolve(self, at: str) -> LoraConfig:
        key = at.rstrip(".") or "lora"
        if self.rank is None:
            raise ValueError(
                f"{key}.rank: set the adapter rank (e.g. 8) or remove the {key} section"
            )
        alpha = float(2 * self.rank if self.alpha is None else self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{key}.dropout must be in [0, 1), got {self.dropout}")
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != "auto":
                raise ValueError(
                    f"{key}.target_modules must be 'auto' or a list of module names, "
                    f"got {targets!r}"
                )
        elif not targets:
            raise ValueError(f"{key}.target_modules is empty: list module names or use 'auto'")
        if importlib.util.find_spec("peft") is None:
            raise ValueError(f"{key}: LoRA needs the `peft` package: pip install 'lightrft[lora]'")
        return replace(
            self,
            alpha=alpha,
            dropout=float(self.dropout),
            target_modules=targets if isinstance(targets, str) else tuple(map(str, targets)),
            trained_modules=tuple(map(str, self.trained_modules)),
        )

    @property
    def targets(self) -> tuple[str, ...] | None:
        """The configured module names; None for ``auto``."""
        return None if self.target_modules == "auto" else tuple(self.target_modules)


# DeepSpeed config keys the recipe (or lightrft.models.deepspeed) sets; deepspeed.config may not.
DEEPSPEED_OWNED_KEYS = {
    "train_batch_size": "batch_size x gradient_accumulation_steps x world size",
    "train_micro_batch_size_per_gpu": "batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "clip_grad_norm",
    "optimizer": "optimizer",
    "scheduler": "lr_scheduler",
    "zero_optimization": "deepspeed.stage / offload_optimizer / offload_param",
    "managed_gradient_accumulation": "the recipe's step (it calls engine.step once per step)",
}


@section
class DeepSpeedConfig(Section):
    """``deepspeed:`` (with ``strategy: deepspeed`` only): the ZeRO stage and offloads."""

    stage: int = option(2, doc="ZeRO stage: 1, 2 or 3")
    offload_optimizer: bool = option(False, doc="optimizer states in CPU memory")
    offload_param: bool = option(False, doc="parameters in CPU memory (stage 3 only)")
    config: dict = option(
        default_factory=dict, doc="more DeepSpeed config keys, passed through as they are"
    )

    def resolve(self, at: str) -> DeepSpeedConfig:
        if isinstance(self.stage, bool) or self.stage not in (1, 2, 3):
            raise ValueError(f"deepspeed.stage must be 1, 2 or 3 (ZeRO stage), got {self.stage!r}")
        if self.offload_param and self.stage != 3:
            raise ValueError(
                f"deepspeed.offload_param=true needs deepspeed.stage=3, got {self.stage}"
            )
        for key in self.config:
            if key in DEEPSPEED_OWNED_KEYS:
                raise ValueError(
                    f"deepspeed.config.{key} conflicts with the recipe's own setting "
                    f"({DEEPSPEED_OWNED_KEYS[key]}); set that instead, or use deepspeed.stage / "
                    "offload_optimizer / offload_param"
                )
        return self


def mesh_shape(shard_size: int | None, replicate_size: int | None, world: int) -> tuple[int, int]:
    """(replicate, shard) of the FSDP2 device mesh for ``world`` ranks; a ``ValueError`` naming
    the keys when the sizes do not fit."""
    s, r = shard_size, replicate_size
    if s is not None and r is not None and s * r != world:
        raise ValueError(
            f"replicate_size={r} x shard_size={s} = {r * s} ranks, but the run has "
            f"{world}; set one of them (the other follows) or make the product {world}"
        )
    for given, key in ((s, "shard_size"), (r, "replicate_size")):
        if given is not None and world % given:
            raise ValueError(
                f"{key}={given} does not divide the world size {world} (processes in the run); "
                f"use a divisor of {world}"
            )
    if s is None:  # the shard size that follows from the replicas (all ranks: plain FSDP2)
        s = world if r is None else world // r
    return world // s, s


OFFLOADS = ("none", "params")


@section
class StrategyConfig(Section):
    """How the trained model is wrapped: FSDP2 (optionally HSDP, optionally with LoRA) or
    DeepSpeed ZeRO. Top-level keys; see docs/strategies.md."""

    strategy: str = option("fsdp2", doc="`fsdp2` or `deepspeed`")
    deepspeed: DeepSpeedConfig | None = option(None, doc="with strategy=deepspeed only")
    lora: LoraConfig | None = option(None, doc="absent / null: full fine-tune")
    shard_size: int | None = option(None, ge=1, doc="HSDP: shard within groups of this many ranks")
    replicate_size: int | None = option(None, ge=1, doc="HSDP: the number of replica groups")
    offload: str = option(
        "none",
        doc="FSDP2: `params` keeps the sharded parameters, their gradients and the optimizer "
        "state in CPU memory (the step runs on the CPU); `none`",
    )
    sequence_parallel: int = option(
        1,
        ge=1,
        doc="Ulysses sequence parallelism: each row's tokens split over this many consecutive "
        "ranks (1: off; FSDP2; Qwen2, Qwen2-VL; see docs/strategies.md)",
    )

    def resolve(self, at: str) -> StrategyConfig:
        if self.strategy == "deepspeed" and self.deepspeed is None:  # the section's defaults
            return replace(self, deepspeed=DeepSpeedConfig().checked("deepspeed.")).resolve(at)
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy: unknown strategy {self.strategy!r}; choose one of {list(STRATEGIES)}"
            )
        if self.strategy == "deepspeed":
            if importlib.util.find_spec("deepspeed") is None:
                raise ValueError(
                    "strategy=deepspeed needs the DeepSpeed extra: pip install "
                    "'lightrft[deepspeed]' (or use strategy=fsdp2, the default)"
                )
            for key in ("lora", "shard_size", "replicate_size"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{key} is not supported with strategy=deepspeed yet; remove it or use "
                        "strategy=fsdp2"
                    )
            if self.offload != "none":
                raise ValueError(
                    f"offload={self.offload} applies to strategy=fsdp2 only; with "
                    "strategy=deepspeed use "
                    "deepspeed.offload_optimizer=true / deepspeed.offload_param=true instead"
                )
        elif self.deepspeed is not None:
            raise ValueError(
                f"a deepspeed: section is set but strategy={self.strategy}; set "
                "strategy=deepspeed or remove the section"
            )
        if self.offload == "optimizer":
            # FSDP2's only offload policy moves the sharded parameters, their gradients and
            # the optimizer state together; keeping the parameters on the device with only the
            # optimizer state on the CPU would need an optimizer of our own around FSDP2's
            # sharded DTensors (and its own checkpoint format): not built. torchao's
            # CPUOffloadOptimizer copies gradients before clipping and has no FQN-keyed state
            # (docs/strategies.md#cpu-offload).
            raise ValueError(
                "offload=optimizer is not built: FSDP2 offers no optimizer-only offload (its "
                "CPUOffloadPolicy keeps parameters, gradients and optimizer state on the CPU "
                "together); use offload=params, or strategy=deepspeed with "
                "deepspeed.offload_optimizer=true"
            )
        if self.offload not in OFFLOADS:  # a value that is not built: the key and the way out
            raise ValueError(
                f"offload: unknown value {self.offload!r}; choose one of {list(OFFLOADS)}"
            )
        if os.environ.get("WORLD_SIZE"):  # under torchrun: the sizes must fit the launch
            mesh_shape(self.shard_size, self.replicate_size, int(os.environ["WORLD_SIZE"]))
        check_sequence_parallel(
            self.sequence_parallel,
            int(os.environ.get("WORLD_SIZE") or 1),
            deepspeed=self.strategy == "deepspeed",
            lora=self.lora is not None,
            hsdp=self.shard_size is not None or self.replicate_size is not None,
            offload=self.offload,
        )
        return self


# The model types Ulysses SP is tested on (tests/models/test_models_ulysses.py,
# tests/vision/test_vision_ulysses.py): their decoder attention goes through transformers'
# AttentionInterface after the rotary positions; a multimodal one is cut at its decoder's
# entry, after the images are merged (lightrft.models.ulysses).
SEQUENCE_PARALLEL_MODEL_TYPES = ("qwen2", "qwen2_vl")


def check_sequence_parallel(
    n: int,
    world: int,
    *,
    deepspeed: bool = False,
    lora: bool = False,
    hsdp: bool = False,
    offload: str = "none",
) -> None:
    """Refuse ``sequence_parallel: n`` with what the strategy cannot combine it with, or a
    world of ``world`` processes it does not divide (the strategy's rule; the planner's too)."""
    if n == 1:
        return
    unsupported = {
        "strategy=deepspeed": deepspeed,
        "lora": lora,
        "shard_size / replicate_size (HSDP)": hsdp,
        f"offload={offload}": offload != "none",
    }
    for what, used in unsupported.items():
        if used:
            raise ValueError(
                f"sequence_parallel={n} is not supported with {what} yet; set "
                "sequence_parallel=1 or remove it"
            )
    if world % n:
        raise ValueError(
            f"sequence_parallel={n} does not divide the world size {world} "
            f"(processes in the run); use a divisor of {world}"
        )


def check_sequence_parallel_critic(n: int, critic: bool) -> None:
    """Refuse Ulysses sequence parallelism of degree ``n`` beside a GAE ``critic`` (GRPO's
    config check and the planner both apply it)."""
    if n > 1 and critic:
        raise ValueError(
            f"sequence_parallel={n} does not support a GAE critic (estimator=gae) yet; set "
            "sequence_parallel=1 or another estimator"
        )


def check_sequence_parallel_checkpoint(n: int, path: str | os.PathLike) -> None:
    """:func:`check_sequence_parallel_model` for the local checkpoint at ``path``, from its
    ``config.json`` alone (validation: no transformers, no weights); nothing to check without a
    local ``config.json`` yet (a hub id, or a model a ``prepare`` step writes: the run checks the
    loaded model's config again)."""
    cfg = Path(path).expanduser() / "config.json"
    if n == 1 or not cfg.is_file():
        return
    data = json.loads(cfg.read_text())
    text = data.get("text_config") or data
    heads = text.get("num_attention_heads") or data.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or data.get("num_key_value_heads") or heads
    check_sequence_parallel_model(
        n,
        data.get("model_type"),
        int(heads or 0),
        int(kv_heads or 0),
        sliding_window=bool(text.get("use_sliding_window", False)),
    )


def check_sequence_parallel_model(
    n: int, model_type: str | None, heads: int, kv_heads: int, *, sliding_window: bool = False
) -> None:
    """Refuse a model SP cannot split ``n`` ways: its type, its head counts, a sliding window
    (``lightrft.models.ulysses.check_model`` reads these from an HF config; the planner from
    its shapes)."""
    if n == 1:
        return
    if model_type not in SEQUENCE_PARALLEL_MODEL_TYPES:
        raise ValueError(
            f"sequence_parallel={n} does not support model type {model_type!r} yet "
            f"(supported: {list(SEQUENCE_PARALLEL_MODEL_TYPES)}); set sequence_parallel=1"
        )
    if heads % n or kv_heads % n:
        raise ValueError(
            f"sequence_parallel={n} must divide the model's attention heads: it has "
            f"num_attention_heads={heads} and num_key_value_heads={kv_heads}; choose a divisor "
            "of both"
        )
    if sliding_window:
        raise ValueError(
            f"sequence_parallel={n} does not support sliding-window attention "
            "(use_sliding_window=true in the model config) yet"
        )


# ------------------------------------------------------------------------------ optimizer


@section
class ScheduleConfig(Section):
    """``lr_scheduler:``: linear warmup, then cosine decay to ``min_lr_ratio`` x the peak."""

    warmup_steps: int = option(0, ge=0, doc="steps of linear warmup from 0")
    min_lr_ratio: float = option(0.0, doc="the final LR as a fraction of the peak, in [0, 1]")

    def resolve(self, at: str) -> ScheduleConfig:
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"{at}min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        return self

    def check_steps(self, max_steps: int | None, at: str = "lr_scheduler.") -> None:
        """The schedule must reach its peak within the run."""
        if max_steps is not None and self.warmup_steps > max_steps:
            raise ValueError(
                f"{at}warmup_steps={self.warmup_steps} is more than max_steps={max_steps}: "
                "the schedule would never reach its peak"
            )


@section
class OptimConfig(Section):
    """The optimizer, its LR schedule and gradient clipping (top-level keys)."""

    optimizer: Component = option(doc="e.g. `torch.optim.AdamW` and its arguments")
    lr_scheduler: ScheduleConfig = option(default_factory=ScheduleConfig, doc="")
    clip_grad_norm: float | None = option(None, gt=0, doc="clip the global grad norm to this")

    def resolve(self, at: str) -> OptimConfig:
        check_optimizer(self.optimizer, "optimizer")
        return self


# Keys that only select an implementation (a CUDA kernel...): left out of the trial build.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def check_optimizer(node: Any, key: str = "optimizer") -> None:
    """Refuse optimizer arguments no optimizer takes (a negative ``lr``, ``weight_decay`` or
    ``eps``), naming ``key``; a ``torch.optim`` optimizer is also built once on a one-element
    parameter, so every argument check of its own (betas in [0, 1), momentum...) runs now,
    before any model loads, instead of after it."""
    if node is None:
        return
    for arg in ("lr", "weight_decay", "eps"):
        value = node.get(arg)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{key}.{arg} must be >= 0, got {value}")
    target = str(node.get("_component_", ""))
    if not target.startswith("torch.optim."):
        return
    import torch

    args = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else dict(node)
    for arg in ("_component_", *_IMPLEMENTATION_KEYS):
        args.pop(arg, None)
    try:
        resolve(target)([torch.nn.Parameter(torch.zeros(1))], **args)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"{key}: {target} refuses its arguments: {e}") from None


# ----------------------------------------------------------------------------------- data


@section
class BatchConfig(Section):
    """Datasets, batches and epochs of a supervised recipe (SFT, reward model): top-level keys."""

    dataset: Component = option(doc="the training data set; the recipe passes the tokenizer")
    eval_dataset: Component | None = option(None, doc="held-out data, evaluated every eval_every")
    packing: bool = option(False, doc="several sequences per row, positions reset per sequence")
    max_tokens_per_row: int | None = option(
        None, ge=1, doc="packing only; default: one row per micro-batch"
    )
    batch_size: int = option(ge=1, doc="samples per rank per micro-batch")
    gradient_accumulation_steps: int = option(1, ge=1, doc="micro-batches per optimizer step")
    micro_batch_tokens: int | None = option(
        None, ge=1, doc="token budget: a step's samples by length, cut by tokens"
    )
    epochs: int = option(ge=1, doc="passes over the data set")
    max_steps: int | None = option(None, ge=1, doc="stop after this many optimizer steps")
    eval_every: int | None = option(None, ge=1, doc="evaluate every this many steps")

    def resolve(self, at: str) -> BatchConfig:
        if self.max_tokens_per_row is not None and not self.packing:
            raise ValueError("max_tokens_per_row applies only with packing=true")
        return self

    def global_batch(self, world: int) -> int:
        """Samples one optimizer step reads over ``world`` ranks."""
        return self.batch_size * self.gradient_accumulation_steps * world

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's optimizer steps: ``epochs`` passes of ``steps_per_epoch``, cut at
        ``max_steps``."""
        total = steps_per_epoch * self.epochs
        return total if self.max_steps is None else min(total, self.max_steps)
