"""The memory planner behind ``lightrft plan``: per-GPU bytes of each phase of a run, from the
model's HF ``config.json`` and the run's config alone (no weights, no process group).

Every term is arithmetic over the decoder's shapes (:class:`ModelShape`) and the strategy:

* model states: parameters in the master dtype, gradients, AdamW's two states (the dtype of
  the parameters), each divided by the ranks that shard them (FSDP2's shard group; ZeRO's
  stages), or moved to host memory by an offload;
* FSDP2 units in flight: the trained model's root group (LM head, final norm) stays gathered
  for the whole step, and up to two decoder blocks (the one running and the one prefetched) plus
  one block's unsharded gradient and its ``reduce_dtype`` (fp32) copy for the reduce-scatter;
* activations saved for backward, per token and decoder layer, counted tensor by tensor from
  the Qwen2 / Llama block as Hugging Face writes it (RMSNorm upcasts to fp32; GQA attention
  through SDPA / flash, which saves ``q, k, v``, the output and the fp32 log-sum-exp, and no
  ``[s, s]`` scores; SwiGLU MLP): the method of Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198), section 4, for this block.
  With activation checkpointing a block keeps only its input, and one block's full set lives
  again while it is recomputed;
* the log-prob transient: the fused kernel's ``[chunk, vocab]`` fp32 workspace (the chunk rule
  of ``lightrft.kernels.default_chunk_size``) against the naive ``[tokens, vocab]`` logits;
* the rollout engine: the native engine's weight copy and dense KV cache (rows x slots x
  layers x 2 x kv_heads x head_dim x bytes), or vLLM's ``gpu_memory_utilization`` share of the
  GPU while awake; what each sleep level frees;
* the reference model and a distillation teacher (FSDP2-sharded, frozen), a GAE critic (trained like the actor), reward
  models used as rewards (whole on every rank).

* Ulysses sequence parallelism (``sequence_parallel: N``, ``lightrft.models.ulysses``; Jacobs
  et al. 2023, arXiv:2309.14509): each rank holds a contiguous 1/N of every row (padded to a
  multiple of N), so the token-proportional terms (activations with and without checkpointing,
  the log-prob head's transient) are per token of the slice; SP adds, per block, the
  ``[T / N, H * D]`` output of the all-to-all back (``o_proj`` saves it beside SDPA's output;
  the whole-row q / k / v / output for ``H / N`` heads are the slice's bytes for all heads), the
  all-gathered fp32 ``[T]`` log-probs, no K / V repeat (no mask reaches SDPA), no gradient hint,
  and for a multimodal model the whole row's embedding (it enters whole and is cut at the
  decoder); the data-parallel replicas are ``world / N`` (GRPO's accumulation test). The SP
  degree is refused by the rules the strategy and the model loader apply
  (``lightrft.sections.check_sequence_parallel`` / ``check_sequence_parallel_model``). Not
  modelled: a vision tower's activations (every rank of the group runs it on the whole row).

Checked against measured CPU runs by ``tests/benchmarks/plan_check.py`` (docs/strategies.md,
"Planning memory"; its ``sp`` rows for sequence parallelism).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from lightrft.config import at_least
from lightrft.kernels import default_chunk_size as fused_chunk_rows  # the fused kernel's chunk
from lightrft.sections import (
    DTYPE_NAMES,
    check_sequence_parallel_critic,
    check_sequence_parallel_model,
    mesh_shape,
)
from lightrft.sections import check_sequence_parallel as strategy_rule

GiB = 1 << 30
NATIVE_MAX_NUM_SEQS = 512  # NativeEngine's default max_num_seqs
VLLM_GPU_MEMORY_UTILIZATION = 0.5  # VLLMEngine's default


def dtype_bytes(name: str, key: str) -> int:
    """Bytes per element of a config dtype name (fp32 4, bf16 / fp16 2); a ``ValueError``
    naming ``key`` otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"{key}: unknown dtype {name!r}; choose one of {sorted(DTYPE_NAMES)}")
    return 4 if name in ("float32", "fp32") else 2


def parse_size(text: str, key: str = "--gpu-memory") -> int:
    """``80GiB``, ``80GB``, ``81920MiB`` or a number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"{key}: cannot read {text!r} as a size (e.g. 80GiB, 96GB)")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    base = 1024 if "I" in unit or unit == "B" else 1000
    return int(value * base**power)


# ------------------------------------------------------------------------------ model


@dataclass(frozen=True)
class ModelShape:
    """The decoder's shapes, read from an HF ``config.json`` (a multimodal model's text part)."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    max_positions: int
    sliding_window: bool = False  # use_sliding_window (refused by sequence parallelism)
    # The top-level model_type of a multimodal config (its decoder is the text_config): such a
    # model embeds the whole row (images merged) before sequence parallelism cuts it.
    multimodal_type: str | None = None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config.json") -> ModelShape:
        text = config.get("text_config") or config
        needed = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        missing = [k for k in needed if text.get(k) is None]
        if missing:
            raise ValueError(
                f"{source}: no {missing[0]!r}: the planner knows Llama-style decoders "
                "(qwen2, qwen3, llama, mistral and the vision-language models built on them)"
            )
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        return cls(
            model_type=model_type,
            hidden=hidden,
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate=int(text["intermediate_size"]),
            vocab=int(text["vocab_size"]),
            tied_embeddings=bool(
                config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            # Qwen2 has q/k/v biases without a config key; Llama-style configs say so.
            qkv_bias=model_type.startswith("qwen2") or bool(text.get("attention_bias", False)),
            max_positions=int(text.get("max_position_embeddings") or 0),
            sliding_window=bool(text.get("use_sliding_window", False)),
            # A nested text_config (transformers 5) or a flat config with a tower's section.
            multimodal_type=(
                str(config.get("model_type") or "")
                if any(config.get(k) for k in ("text_config", "vision_config", "audio_config"))
                else None
            ),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelShape:
        with open(path) as f:
            return cls.from_hf_config(json.load(f), str(path))

    # parameters ----------------------------------------------------------------------
    @property
    def block_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h  # + SwiGLU MLP + two RMSNorms

    @property
    def params(self) -> int:
        """The blocks, the embedding, the LM head's own weight (0 when tied to the embedding)
        and the final norm."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * self.block_params + self.vocab * self.hidden + head + self.hidden

    # activations ---------------------------------------------------------------------
    def norm_bytes_per_token(self, b: int) -> int:
        """One RMSNorm: its fp32 input, the fp32 rsqrt, the normalised and the weighted output
        (compute dtype; the latter is what the next linear layers save)."""
        return 4 * self.hidden + 4 + 2 * b * self.hidden

    def layer_bytes_per_token(self, b: int, *, repeat_kv: bool = False) -> int:
        """Bytes one decoder layer saves for backward per token at compute dtype size ``b``.

        Attention (SDPA / flash): q and k after RoPE, v, the output (which ``o_proj`` saves as
        its input, the same storage) and the fp32 log-sum-exp per head; no [s, s] term. RoPE's
        multiplications save only the shared cos / sin. ``repeat_kv``: SDPA given a padding mask
        repeats K and V to every query head first (Hugging Face's GQA fallback). SwiGLU MLP:
        gate (SiLU's input), SiLU's output, up, and their product (``down_proj``'s input)."""
        kv = self.heads if repeat_kv else self.kv_heads
        attention = b * (2 * self.heads + 2 * kv) * self.head_dim + 4 * self.heads
        mlp = 4 * b * self.intermediate
        return 2 * self.norm_bytes_per_token(b) + attention + mlp

    def kv_bytes_per_token(self, b: int) -> int:
        """One token's keys and values over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * b


# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 1
    gpu_memory: int = 80 * GiB

    def __post_init__(self) -> None:
        at_least("--nodes", self.nodes, 1)
        at_least("--gpus-per-node", self.gpus_per_node, 1)
        at_least("--gpu-memory", self.gpu_memory, 0, strict=True)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class TrainedSetup:
    """How a trained model (actor or critic) is held. ``shard``: ranks its states are split
    over (FSDP2's shard group; the world for ZeRO); ``zero_stage`` 0 means FSDP2."""

    master_bytes: int
    compute_bytes: int
    shard: int
    zero_stage: int = 0
    offload_params: bool = False  # FSDP2 offload: params / grads / optimizer state on the host
    offload_optimizer: bool = False  # ZeRO offload_optimizer
    activation_checkpointing: bool = False
    lora_rank: int | None = None  # adapters on every linear layer of the blocks


@dataclass(frozen=True)
class EngineSetup:
    backend: Literal["native", "vllm", "sglang"]
    dtype_bytes: int
    rows: int
    slots: int  # KV slots per row: longest prompt + longest response
    sleep_level: int
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    tensor_parallel: int = 1  # vLLM's tensor_parallel_size: its weights split this many ways


@dataclass(frozen=True)
class RewardModelSetup:
    key: str  # where the config names it (reward.functions.rm)
    shape: ModelShape
    dtype_bytes: int
    offload: bool
    on_gpu: bool  # RewardModel's ``device`` (default cpu: no GPU memory at all)


@dataclass(frozen=True)
class PlanInputs:
    recipe: str
    model: ModelShape
    cluster: Cluster
    actor: TrainedSetup
    tokens_per_micro_batch: int
    # More than one micro-batch per optimizer step: the gradients of the earlier ones are held
    # while the next one's activations are. With one, gradients fill in as activations free.
    accumulation: bool = True
    repeat_kv: bool = False  # padded rows: SDPA's masked GQA repeats K / V
    entropy: bool = False  # an entropy term: a second [chunk, vocab] buffer
    grad_hint: bool = False  # GRPO: the kernel computes the gradient in forward and keeps it
    engine: EngineSetup | None = None
    reference: bool = False
    teacher: ModelShape | None = None  # on-policy distillation's (held like the reference)
    critic: TrainedSetup | None = None
    reward_models: tuple[RewardModelSetup, ...] = ()
    notes: tuple[str, ...] = ()
    # Ulysses SP (the strategy's ``sequence_parallel``): each micro-batch's rows split over this
    # many consecutive ranks; ``tokens_per_micro_batch`` is the whole micro-batch's.
    sequence_parallel: int = 1


# ------------------------------------------------------------------------------ output


@dataclass(frozen=True)
class Term:
    name: str
    device_bytes: int
    host_bytes: int = 0
    note: str = ""


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[Term, ...]

    @property
    def device_bytes(self) -> int:
        return sum(t.device_bytes for t in self.terms)

    @property
    def host_bytes(self) -> int:
        return sum(t.host_bytes for t in self.terms)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    phases: tuple[Phase, ...]
    activations: int  # one micro-batch, as configured
    activations_without_checkpointing: int
    activations_with_checkpointing: int
    fused_logprob_bytes: int
    naive_logprob_bytes: int
    advice: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Phases that cannot run whatever the total: vLLM's share smaller than its weights.
    blocked: dict[str, str] = field(default_factory=dict)

    def fits(self, phase: Phase) -> bool:
        return (
            phase.name not in self.blocked and phase.device_bytes <= self.inputs.cluster.gpu_memory
        )


# ------------------------------------------------------------------------------ terms


def model_state_terms(shape: ModelShape, t: TrainedSetup, label: str) -> list[Term]:
    """Parameters, gradients and AdamW state of a trained model, per rank."""
    trained = total = shape.params
    if t.lora_rank:
        h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        # r x (in + out) per adapted linear: q, o: h + q; k, v: h + kv; gate, up, down: h + inter.
        per_block = 2 * (h + q) + 2 * (h + kv) + 3 * (h + shape.intermediate)
        trained = shape.layers * t.lora_rank * per_block
        total += trained
    m, z = t.master_bytes, t.zero_stage
    if z:  # DeepSpeed ZeRO: params whole below stage 3, grads whole below stage 2
        ranks = (t.shard if z == 3 else 1, t.shard if z >= 2 else 1, t.shard)
        host = (t.offload_params, False, t.offload_optimizer)
        notes = (f"ZeRO-{z}", f"ZeRO-{z}", "AdamW: 2 states")
    else:  # FSDP2: each split over the shard group; offload: params moves all three to the host
        where = "host (offload: params)" if t.offload_params else f"1/{t.shard} each"
        ranks, host = (t.shard,) * 3, (t.offload_params,) * 3
        notes = (where, where, "AdamW: 2 states, " + where)
    terms = []
    names, sizes = ("parameters", "gradients", "optimizer state"), (total, trained, trained * 2)
    for name, size, r, on_host, note in zip(names, sizes, ranks, host, notes, strict=True):
        n = math.ceil(size * m / r)
        terms.append(Term(f"{label} {name}", 0 if on_host else n, n if on_host else 0, note))
    return terms


def gathered_bytes(shape: ModelShape, t: TrainedSetup, *, trained: bool) -> int:
    """FSDP2 units gathered at once (compute dtype): the root group for the whole step of a
    trained model (the LM head, or the tied embedding that is the head, and the final norm),
    two blocks (running + prefetched) and, in backward, one block's unsharded gradient and its
    fp32 copy for the reduce-scatter. With ``offload: params`` each gathered unit's fp32 shard is
    copied to the device first. ZeRO-3 gathers module by module in the master dtype (no mixed
    precision in this project's DeepSpeed path)."""
    if t.zero_stage:
        return 2 * shape.block_params * t.master_bytes if t.zero_stage == 3 else 0
    b = t.compute_bytes
    root = (shape.vocab + 1) * shape.hidden if trained else 0
    units = root + 2 * shape.block_params
    grad = shape.block_params * (b + 4) if trained else 0
    staged = math.ceil(units * t.master_bytes / t.shard) if t.offload_params else 0
    return units * b + grad + staged


def sp_local_tokens(tokens: int, sp: int) -> int:
    """Tokens of one rank's slice: the row padded to a multiple of ``sp``, then cut ``sp`` ways
    (``lightrft.models.ulysses.Ulysses.shard``; one row: a micro-batch of several rows pads
    each, which this ignores)."""
    return -(-tokens // sp)


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    b: int,
    *,
    ckpt: bool,
    repeat_kv: bool,
    recompute: bool = True,
    sequence_parallel: int = 1,
) -> int:
    """Saved-for-backward bytes of one micro-batch of ``tokens`` tokens (decoder + final norm),
    per rank. With checkpointing: every block's input held from forward to backward, plus
    (``recompute``) one block's full set while backward recomputes it.

    ``sequence_parallel`` N > 1 (``lightrft.models.ulysses``): every term is per token of this
    rank's slice (``tokens / N``, rounded up). Attention between its two all-to-alls holds the
    whole row's q, k, v, output and log-sum-exp for ``H / N`` heads: per rank the same bytes as
    the slice's for all heads, so the per-token attention term stands; the all-to-all back
    writes a new ``[T / N, H * D]`` output that ``o_proj`` saves beside SDPA's own (one more
    ``b * H * D`` per token and block held). No ``[T, T]`` mask reaches SDPA (causal blocks), so
    K / V are never repeated. A multimodal model embeds the whole row before the decoder's
    pre-hook cuts it (``SequenceShard.trunk_inputs``): the slice is a view of the whole
    ``[T, hidden]`` embedding, counted as held (in fp32 the first block's norm saves that view,
    keeping the whole row alive; in bf16 it saves an fp32 copy, so there this overcounts a
    transient of the forward's start; neither measured)."""
    n = sequence_parallel
    if n > 1:
        repeat_kv = False
    local = sp_local_tokens(tokens, n)
    layer = shape.layer_bytes_per_token(b, repeat_kv=repeat_kv)
    final = shape.norm_bytes_per_token(b)
    sp_out = b * shape.heads * shape.head_dim if n > 1 else 0  # the all-to-all's output
    whole = local * n * shape.hidden * b if n > 1 and shape.multimodal_type else 0
    if ckpt:
        full = layer + sp_out if recompute else 0
        return local * (shape.layers * b * shape.hidden + full + final) + whole
    return local * (shape.layers * (layer + sp_out) + final) + whole


def logprob_bytes(
    shape: ModelShape,
    tokens: int,
    b: int,
    *,
    entropy: bool,
    grad_hint: bool,
    sequence_parallel: int = 1,
) -> tuple[int, int]:
    """(fused, naive) transient of the log-prob head over ``tokens`` rows. Fused: the fp32
    ``[chunk, vocab]`` workspace (two with entropy), a compute-dtype scratch when the matmul
    cannot write fp32 (bf16), and with a gradient hint the gradients it keeps from forward to
    backward (hidden [tokens, H] and head weight [V, H], compute dtype). Naive: the
    ``[tokens, vocab]`` logits, their fp32 upcast and the fp32 log-softmax.

    ``sequence_parallel`` N > 1: the head runs on this rank's slice (``tokens / N`` rows; no
    gradient hint: ``models.forward.causal_lm_token_logprobs`` refuses one), and the log-probs (and
    entropy) are all-gathered into fp32 ``[tokens]`` vectors (``Ulysses.gather``)."""
    n = sequence_parallel
    local = sp_local_tokens(tokens, n)
    gathered = local * n * 4 * (2 if entropy else 1) if n > 1 else 0
    c = fused_chunk_rows(local, shape.vocab)
    fused = c * shape.vocab * (4 * (2 if entropy else 1) + (b if b < 4 else 0)) + gathered
    if grad_hint and n == 1:
        fused += (local + shape.vocab) * shape.hidden * b
    naive = local * shape.vocab * (b + 4 + 4) + gathered
    return fused, naive


def engine_terms(
    shape: ModelShape, e: EngineSetup, cluster: Cluster
) -> tuple[Term, Term, str | None]:
    """(awake, asleep) device bytes of the rollout engine, and why it cannot run at all (vLLM's
    or SGLang's share smaller than its weights), else None."""
    if e.backend in ("vllm", "sglang"):
        awake = int(e.gpu_memory_utilization * cluster.gpu_memory)
        note = f"gpu_memory_utilization {e.gpu_memory_utilization} x GPU: weights + KV cache"
        # Level 1 offloads the weights to host memory and drops the KV cache; 2 drops both.
        asleep = awake if e.sleep_level == 0 else 0
        weights = shape.params * e.dtype_bytes // e.tensor_parallel
        host = weights if e.sleep_level == 1 else 0
        blocked = None
        if weights >= awake:
            blocked = (
                f"{e.backend}'s share ({_gib(awake)}: engine.gpu_memory_utilization="
                f"{e.gpu_memory_utilization}) is smaller than its weights ({_gib(weights)} per "
                f"GPU at tensor_parallel_size={e.tensor_parallel}), with no room for a KV cache"
            )
        return (
            Term(f"engine ({e.backend}, awake)", awake, 0, note),
            Term(f"engine ({e.backend}, sleep level {e.sleep_level})", asleep, host),
            blocked,
        )
    weights = shape.params * e.dtype_bytes
    kv = e.rows * e.slots * shape.kv_bytes_per_token(e.dtype_bytes)
    awake = Term(
        "engine (native): weights + KV cache",
        weights + kv,
        0,
        f"weights {_gib(weights)} + KV {e.rows} rows x {e.slots} slots {_gib(kv)}",
    )
    asleep = {0: weights + kv, 1: weights, 2: 0}[e.sleep_level]
    return awake, Term(f"engine (native, sleep level {e.sleep_level})", asleep), None


def plan(p: PlanInputs) -> Plan:
    """The per-GPU memory of the rollout, scoring and training phases."""
    s, a, tok, n = p.model, p.actor, p.tokens_per_micro_batch, p.sequence_parallel
    b, world = a.compute_bytes, p.cluster.world
    # Refuse the SP degree the strategy and the model refuse (the rules of lightrft.sections,
    # which StrategyConfig and lightrft.models.ulysses apply).
    strategy_rule(
        n,
        world,
        deepspeed=bool(a.zero_stage),
        lora=a.lora_rank is not None,
        hsdp=a.shard != world,
        offload="params" if a.offload_params else "none",
    )
    check_sequence_parallel_model(
        n, s.multimodal_type or s.model_type, s.heads, s.kv_heads, sliding_window=s.sliding_window
    )
    check_sequence_parallel_critic(n, p.critic is not None)
    states = model_state_terms(s, a, "actor")
    critic_states = [] if p.critic is None else model_state_terms(s, p.critic, "critic")
    resting = [  # between steps the gradients are freed (zero_grad(set_to_none=True))
        Term(t.name, 0 if "gradients" in t.name else t.device_bytes, t.host_bytes, t.note)
        for t in [*states, *critic_states]
    ]
    sp = {"sequence_parallel": n}
    acts_no = activation_bytes(s, tok, b, ckpt=False, repeat_kv=p.repeat_kv, **sp)
    acts_ck = activation_bytes(s, tok, b, ckpt=True, repeat_kv=p.repeat_kv, **sp)
    acts = acts_ck if a.activation_checkpointing else acts_no
    fused, naive = logprob_bytes(s, tok, b, entropy=p.entropy, grad_hint=p.grad_hint, **sp)
    fused_nograd, _ = logprob_bytes(s, tok, b, entropy=False, grad_hint=False, **sp)
    common: list[Term] = []
    scoring_rms: list[Term] = []  # offloaded reward models, on the device while they score
    for name, frozen in (("reference", s if p.reference else None), ("teacher", p.teacher)):
        if frozen is not None:  # FSDP2 over the actor's shard ranks (the world under ZeRO)
            size = math.ceil(frozen.params * a.master_bytes / a.shard)
            common.append(Term(f"{name} parameters", size, 0, "frozen, FSDP2-sharded"))
    for rm in p.reward_models:
        size = rm.shape.params * rm.dtype_bytes
        on_gpu = rm.on_gpu and not rm.offload
        note = "whole on every rank"
        if not rm.on_gpu:
            note += ", runs on the CPU (its device: cpu)"
        elif rm.offload:
            note += ", on the host between calls (offload: true)"
            scoring_rms.append(Term(f"reward model {rm.key} (on the device to score)", size))
        common.append(
            Term(f"reward model {rm.key}", size if on_gpu else 0, 0 if on_gpu else size, note)
        )
    phases: list[Phase] = []
    asleep: list[Term] = []  # the engine between rollouts, beside scoring and training
    blocked = {}
    if p.engine is not None:
        awake, sleeping, why = engine_terms(s, p.engine, p.cluster)
        phases.append(Phase("rollout", (*resting, *common, awake)))
        asleep = [sleeping]
        if why is not None:
            blocked["rollout"] = why
    gathered_fwd = gathered_bytes(s, a, trained=False)
    scoring = [*resting, *common, *asleep]
    scoring += [
        Term("gathered FSDP2 units (forward)", gathered_fwd, 0, "two blocks, compute dtype"),
        Term("log-prob transient (fused, no grad)", fused_nograd),
        *scoring_rms,
    ]
    if p.recipe == "grpo":  # the supervised recipes score nothing before their step
        phases.append(Phase("scoring / reference", tuple(scoring)))
    train = [*states, *common, *asleep]
    if not p.accumulation:
        g = next(i for i, t in enumerate(train) if t.name == "actor gradients")
        train[g] = replace(
            train[g],
            device_bytes=max(0, train[g].device_bytes - acts),
            note="one micro-batch per step: written as its activations free",
        )
    train += [
        Term(
            "gathered ZeRO-3 modules" if a.zero_stage else "gathered FSDP2 units",
            gathered_bytes(s, a, trained=True),
            0,
            "2 blocks, master dtype" if a.zero_stage else "root + 2 blocks + grad",
        ),
        Term(
            "activations" + (" (checkpointed)" if a.activation_checkpointing else ""),
            acts,
            0,
            f"{tok} tokens per micro-batch"
            + (f", 1/{n} of them per rank (sequence_parallel)" if n > 1 else ""),
        ),
        Term("log-prob transient (fused)", fused),
    ]
    if p.critic is not None:
        cb = p.critic.compute_bytes
        c_acts = activation_bytes(
            s, tok, cb, ckpt=p.critic.activation_checkpointing, repeat_kv=p.repeat_kv
        )
        train += [*critic_states, Term("critic activations", c_acts)]
    phases.append(Phase("training step", tuple(train)))
    result = Plan(p, tuple(phases), acts, acts_no, acts_ck, fused, naive, blocked=blocked)
    return replace(
        result, advice={ph.name: _advice(result, ph) for ph in phases if not result.fits(ph)}
    )


def _advice(plan_: Plan, phase: Phase) -> tuple[str, ...]:
    """What would bring an over-budget phase under the GPU's memory, each with its saving."""
    p, out = plan_.inputs, []
    over = phase.device_bytes - p.cluster.gpu_memory
    a = p.actor
    if phase.name == "training step" and not a.activation_checkpointing:
        saved = plan_.activations_without_checkpointing - plan_.activations_with_checkpointing
        out.append(f"model.activation_checkpointing=true (-{_gib(saved)})")
    if not a.zero_stage and not a.offload_params:
        states = sum(
            t.device_bytes
            for t in phase.terms
            if t.name.startswith("actor ") and not t.name.endswith("gradients")
        )
        if states:
            out.append(f"offload=params (-{_gib(states)} of actor states to host memory)")
        if a.shard < p.cluster.world:
            out.append("a larger shard_size (HSDP: shard over more ranks)")
    if p.engine is not None and p.engine.backend == "native" and p.engine.sleep_level < 2:
        out.append("engine sleep_level: 2 (frees the engine's weights between rollouts)")
    if phase.name == "rollout" and p.engine.backend == "native":  # (a rollout has an engine)
        out.append("engine.max_kv_tokens or max_num_seqs (fewer KV-cache rows)")
    elif phase.name in plan_.blocked:  # vLLM / SGLang: a share smaller than the weights
        out.append(plan_.blocked[phase.name])
        out.append("a larger engine.gpu_memory_utilization or engine.tensor_parallel_size")
    elif phase.name == "rollout":
        out.append("a smaller engine.gpu_memory_utilization")
    if phase.name == "training step":
        out.append("a smaller train.micro_batch_size / micro_batch_tokens")
    if over > 0:
        out.append(f"more GPUs ({_gib(over)} over)")
    return tuple(out)


# ------------------------------------------------------------------------------ printing


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def format_plan(result: Plan) -> str:
    p, c = result.inputs, result.inputs.cluster
    a = p.actor
    if a.zero_stage:
        how = f"DeepSpeed ZeRO-{a.zero_stage} over {c.world}"
        if a.offload_optimizer:
            how += ", optimizer offload"
        if a.offload_params:
            how += ", parameter offload"
    else:
        how = f"FSDP2, shard group {a.shard} of {c.world}"
        if a.offload_params:
            how += ", offload: params"
    if a.lora_rank:
        how += f", LoRA rank {a.lora_rank}"
    if p.sequence_parallel > 1:
        how += (
            f", sequence_parallel {p.sequence_parallel} ({c.world // p.sequence_parallel} "
            "data-parallel replicas)"
        )
    s = p.model
    lines = [
        f"{p.recipe}: {s.model_type} {s.params / 1e9:.2f}B parameters (hidden {s.hidden}, "
        f"{s.layers} layers, {s.heads}/{s.kv_heads} heads, vocab {s.vocab})",
        f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s) of {_gib(c.gpu_memory)}; {how}; "
        f"master {a.master_bytes} B, compute {a.compute_bytes} B per element; "
        f"{p.tokens_per_micro_batch} tokens per micro-batch",
        "",
    ]
    width = max(len(t.name) for ph in result.phases for t in ph.terms) + 2
    for ph in result.phases:
        verdict = "fits" if result.fits(ph) else "DOES NOT FIT"
        lines.append(f"{ph.name}: {_gib(ph.device_bytes)} per GPU ({verdict})")
        for t in ph.terms:
            host = f"   host {_gib(t.host_bytes)}" if t.host_bytes else ""
            note = f"   {t.note}" if t.note else ""
            lines.append(f"  {t.name:<{width}}{_gib(t.device_bytes):>12}{host}{note}")
        for tip in result.advice.get(ph.name, ()):
            lines.append(f"  -> {tip}")
        lines.append("")
    lines.append(
        f"activations of one micro-batch: {_gib(result.activations_without_checkpointing)} "
        f"without checkpointing, {_gib(result.activations_with_checkpointing)} with; log-prob "
        f"transient {_gib(result.fused_logprob_bytes)} fused vs "
        f"{_gib(result.naive_logprob_bytes)} naive [tokens, vocab]"
    )
    host = max(ph.host_bytes for ph in result.phases)
    if host:
        lines.append(
            f"host memory: up to {_gib(host)} per process, {_gib(host * c.gpus_per_node)} per "
            f"node of {c.gpus_per_node} processes (offloads, sleeping engine weights)"
        )
    lines.extend(p.notes)
    return "\n".join(lines)


# ------------------------------------------------------------------------------ config


def _reward_models(node: Any, at: str) -> list[tuple[str, Any]]:
    """``(key, node)`` of every ``lightrft.rewards.RewardModel`` in a reward config tree."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, Mapping):  # a dict or omegaconf's DictConfig
        if str(node.get("_component_") or "").endswith("RewardModel"):
            found.append((at, node))
        for k, v in node.items():
            found += _reward_models(v, f"{at}.{k}")
    elif isinstance(node, Sequence) and not isinstance(node, str):  # or a ListConfig
        for i, v in enumerate(node):
            found += _reward_models(v, f"{at}[{i}]")
    return found


def read_shape(path: str, key: str, model_config: str | None = None) -> ModelShape:
    """The shapes of the model at ``path`` (a local HF directory) or of ``model_config`` (a
    ``config.json``); a hub id that is not local is refused, naming ``key``."""
    if model_config is not None:
        if not Path(model_config).is_file():
            raise ValueError(f"--model-config: {model_config!r} is not a file")
        return ModelShape.from_file(model_config)
    p = Path(str(path)).expanduser()
    if (p / "config.json").is_file():
        return ModelShape.from_file(p / "config.json")
    way_out = (
        f"pass --model-config PATH (the model's config.json) or point {key} at a model directory"
        if key == "model.path"
        else f"point {key} at a local model directory (the planner reads only its config.json)"
    )
    raise ValueError(
        f"{key}={path!r}: no config.json there to read the model's shapes from (a hub id, "
        f"which the planner does not fetch, or a directory a prepare step writes); {way_out}"
    )


def inputs_from_options(
    opts: Any,
    *,
    recipe: str,
    cluster: Cluster,
    device: Literal["cuda", "cpu"] = "cuda",
    model_config: str | None = None,
) -> PlanInputs:
    """The planner's inputs from a recipe's validated config object (``GRPOConfig``,
    ``SFTConfig``, ``RewardModelConfig``: read with ``WORLD_SIZE`` set to the cluster's)."""
    m, st = opts.model, opts.strategy
    shape = read_shape(m.path, "model.path", model_config)
    master = dtype_bytes(m.dtype, "model.dtype")
    world = cluster.world
    ds = st.deepspeed  # None under FSDP2; the config refuses LoRA, HSDP and offload with it
    # FSDP2 computes in bf16 on accelerators (lightrft.models.parallel.default_param_dtype);
    # this project's DeepSpeed path has no mixed precision: it computes in the master dtype.
    compute = master if ds or device == "cpu" else 2
    actor = TrainedSetup(
        master,
        compute,
        world if ds else mesh_shape(st.shard_size, st.replicate_size, world)[1],
        zero_stage=ds.stage if ds else 0,
        offload_params=ds.offload_param if ds else st.offload == "params",
        offload_optimizer=ds.offload_optimizer if ds else False,
        activation_checkpointing=m.activation_checkpointing,
        lora_rank=st.lora.rank if st.lora is not None else None,
    )
    sp = 1 if ds else st.sequence_parallel
    # What every recipe shares; each fills in its micro-batch (and GRPO its other models).
    common = PlanInputs(recipe, shape, cluster, actor, 0, sequence_parallel=sp)
    if recipe == "grpo":
        return _grpo_inputs(opts, common, device)
    data = opts.data
    length = data.dataset.get("max_length")
    tokens = data.micro_batch_tokens or data.max_tokens_per_row
    if tokens is None:
        if length is None:
            raise ValueError(
                "dataset.max_length is not set: the planner needs the longest sample (or set "
                "micro_batch_tokens / max_tokens_per_row)"
            )
        # A reward-model micro-batch scores a chosen and a rejected response per pair.
        tokens = data.batch_size * int(length) * (2 if recipe == "reward_model" else 1)
    return replace(
        common,
        tokens_per_micro_batch=int(tokens),
        # A token budget cuts a step into a varying number of micro-batches: assume several.
        accumulation=data.gradient_accumulation_steps > 1 or data.micro_batch_tokens is not None,
        repeat_kv=not data.packing,
    )


def _grpo_inputs(opts: Any, common: PlanInputs, device: str) -> PlanInputs:
    """GRPO's own inputs over ``common`` (the model, cluster, actor and SP degree): the
    rollout engine, the reference, teacher, critic and reward models, the micro-batch."""
    ro, tr, eng = opts.rollout, opts.train, opts.engine
    shape, actor, cluster, sp = common.model, common.actor, common.cluster, common.sequence_parallel
    notes = []
    prompt = opts.dataset.get("max_prompt_length")
    max_len = eng.max_model_len or shape.max_positions
    if prompt is None:
        slots = max_len
        notes.append(
            f"dataset.max_prompt_length is not set: KV rows and micro-batches sized at "
            f"max_model_len={max_len}"
        )
    else:
        slots = min(int(prompt) + ro.max_tokens, max_len)
    per_rank = ro.prompts_per_step // cluster.world * ro.n
    tokens = tr.micro_batch_size * slots  # padded rows: prompt + response slots
    if tr.micro_batch_tokens is not None:
        tokens = min(tokens, tr.micro_batch_tokens)
    edtype = eng.dtype or ("bfloat16" if device == "cuda" else opts.model.dtype)
    if eng.backend == "native":
        rows = min(eng.max_num_seqs or NATIVE_MAX_NUM_SEQS, per_rank)
        if eng.max_kv_tokens is not None:
            rows = min(rows, eng.max_kv_tokens // slots)
        rows = max(rows, ro.n)
    else:
        rows = eng.max_num_seqs or per_rank
    engine = EngineSetup(
        eng.backend,
        dtype_bytes(edtype, "engine.dtype"),
        rows,
        slots,
        eng.sleep_level,
        eng.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION,
        eng.tensor_parallel_size or 1,
    )
    alg = opts.algorithm
    critic = None
    if opts.critic is not None:  # the actor's setup under plain FSDP2, over its shard ranks
        critic = replace(
            actor, zero_stage=0, offload_params=False, offload_optimizer=False, lora_rank=None
        )
    rms = tuple(
        RewardModelSetup(
            key,
            read_shape(str(node.get("path")), f"{key}.path"),
            dtype_bytes(str(node.get("dtype") or "float32"), f"{key}.dtype"),
            bool(node.get("offload") or False),
            str(node.get("device") or "cpu") != "cpu",
        )
        for key, node in _reward_models(opts.reward, "reward")
    )
    return replace(
        common,
        tokens_per_micro_batch=tokens,
        # Samples per data-parallel replica (world / SP ranks; the ranks of an SP group train
        # on the same rows) per optimizer step over the micro-batch size.
        accumulation=(tr.mini_batch_size or ro.prompts_per_step * ro.n) // (cluster.world // sp)
        > tr.micro_batch_size
        or tr.micro_batch_tokens is not None,
        repeat_kv=not tr.packing,
        entropy=bool(alg.entropy.coef),
        # Per-token objectives get the kernel's gradient hint (recipes/grpo.py, _grad_hint).
        grad_hint=alg.policy_loss.objective not in ("gspo", "gmpo"),
        engine=engine,
        # With LoRA the reference is the actor with its adapters off: no copy.
        reference=alg.kl is not None and actor.lora_rank is None,
        teacher=read_shape(d.path, "distillation.path") if (d := opts.distillation) else None,
        critic=critic,
        reward_models=rms,
        notes=tuple(notes),
    )


def check_teacher_fits(opts: Any, device: Any, world: int) -> None:
    """Refuse, naming ``distillation.path``, a GRPO config's teacher that does not fit this
    machine: with it some phase of the planner's estimate exceeds the device's memory (a GPU's
    total; on CPU the host's, shared by its ranks) and without it none does. A run that is over
    without the teacher too is left to fail or pass on its own: the estimate is no proof."""
    if getattr(opts, "distillation", None) is None:
        return
    import torch

    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local
    kind = "cuda" if device.type == "cuda" else "cpu"
    p = inputs_from_options(opts, recipe="grpo", cluster=Cluster(1, world, memory), device=kind)
    full, without = plan(p), plan(replace(p, teacher=None))
    over = [ph for ph in full.phases if not full.fits(ph)]
    if over and all(without.fits(ph) for ph in without.phases):
        shard = next(t.device_bytes for t in over[0].terms if t.name == "teacher parameters")
        raise ValueError(
            f"distillation.path={opts.distillation.path!r}: the teacher does not fit: its "
            f"frozen FSDP2 shard is {_gib(shard)} per rank ({p.teacher.params:,} parameters in "
            f"model.dtype over {p.actor.shard} rank(s)), and with it the {over[0].name} phase "
            f"needs {_gib(over[0].device_bytes)} of this {kind} device's {_gib(memory)} (without "
            "it the run fits; `lightrft plan` shows every term): use a smaller teacher, more ranks or a larger shard_size"
        )
