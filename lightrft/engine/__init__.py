"""Rollout engines behind one protocol (:class:`Engine`): the native torch engine, the in-process
vLLM adapter, the SGLang adapter, and the weight sync that streams a trainer's (FSDP2) weights
into any of them.

A recipe step::

    engine.wake_up()
    completions = engine.generate(requests, sampling)
    engine.sleep(level)
    ...train...
    sync_weights(actor, engine)
"""

from lightrft.engine.native import NativeEngine
from lightrft.engine.protocol import (
    Completion,
    Continuation,
    Engine,
    Request,
    Resume,
    SamplingParams,
    Turn,
)
from lightrft.engine.sglang_adapter import SGLangEngine
from lightrft.engine.sync import SyncStats, iter_weight_buckets, sync_weights
from lightrft.engine.vllm_adapter import VLLMEngine

__all__ = [
    "Completion",
    "Continuation",
    "Engine",
    "NativeEngine",
    "Request",
    "Resume",
    "SGLangEngine",
    "SamplingParams",
    "SyncStats",
    "Turn",
    "VLLMEngine",
    "iter_weight_buckets",
    "sync_weights",
]
