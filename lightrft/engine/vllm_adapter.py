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
``logit_bias`` -100; vLLM's processed log-probs then include that bias, unlike the native
engine's (the difference is the suppressed mass, ~0 once a model has learnt not to emit them).
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

``vllm`` is imported only when a ``VLLMEngine`` is built: this module imports without it. vLLM's
PyPI wheel is CUDA-only. Written against vllm 0.32.0 (the newest release pinning torch 2.13).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightrft.data.media import Media
from lightrft.engine.external import (
    MEDIA_LOGIT_BIAS,
    RNGState,
    Trajectory,
    check_finish_reason,
    collapse_placeholders,
    continue_in_rounds,
    hf_weight_names,
    tp_groups,
)
from lightrft.engine.protocol import (
    Completion,
    Continuation,
    Request,
    SamplingParams,
    check_awake,
    check_requests,
    check_sleep_level,
    check_wake_tags,
    per_request_params,
)

VLLM_VERSION = "0.32.0"


def import_vllm():
    """``import vllm`` with an actionable error when it is missing."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"VLLMEngine needs vLLM: pip install 'lightrft[vllm]' (vllm=={VLLM_VERSION}, CUDA "
            "only); the native engine (lightrft.engine.NativeEngine) needs nothing extra"
        ) from e
    return vllm


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
    if not isinstance(media, Media):
        raise ValueError(
            f"a request's media is a {type(media).__name__}; pass the Media the prompt datasets "
            "give (lightrft.data.media)"
        )
    mm: dict[str, Any] = {}
    if media.audio is not None:
        if audio_token_id is None:
            raise ValueError("the request has audio but the model is not audio-language")
        prompt["prompt_token_ids"] = collapse_placeholders(
            prompt["prompt_token_ids"], audio_token_id, media.audio.num_tokens, kind="audio"
        )
        mm["audio"] = [(wave, media.audio.sampling_rate) for wave in media.audio.audios]
    if media.image is not None:
        if image_token_id is None:
            raise ValueError("the request has images but the model is not vision-language")
        prompt["prompt_token_ids"] = collapse_placeholders(
            prompt["prompt_token_ids"], image_token_id, media.image.num_tokens
        )
        mm["image"] = list(media.image.images)
        if media.image.processor_kwargs:
            prompt["mm_processor_kwargs"] = dict(media.image.processor_kwargs)
    if media.video is not None:
        if video_token_id is None:
            raise ValueError("the request has videos but the model takes no video")
        video = media.video
        prompt["prompt_token_ids"] = collapse_placeholders(
            prompt["prompt_token_ids"], video_token_id, video.num_tokens, kind="video"
        )
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


def _sampled_logprobs(token_ids: Sequence[int], logprobs) -> list[float]:
    """Per-token log-probs from vLLM's ``CompletionOutput.logprobs`` (one dict per token)."""
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs; SamplingParams(logprobs=0) was expected")
    return [float(step[tok].logprob) for tok, step in zip(token_ids, logprobs, strict=True)]


def completions_from_outputs(
    outputs: Sequence[Any], request_index: Sequence[int], prompts: Sequence[list[int]]
) -> list[Completion]:
    """Our completions from vLLM ``RequestOutput``s (one per request, ``n`` outputs each)."""
    result = []
    for out, i, prompt in zip(outputs, request_index, prompts, strict=True):
        prompt_lp = None
        if getattr(out, "prompt_logprobs", None) is not None:
            # Entry 0 is None (nothing precedes the first prompt token).
            prompt_lp = [
                float(step[tok].logprob)
                for tok, step in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
            ]
        for sample in out.outputs:
            reason = check_finish_reason(sample.finish_reason, "vLLM", i, sample.index)
            ids = list(sample.token_ids)
            result.append(
                Completion(
                    request_index=i,
                    sample_index=sample.index,
                    prompt_token_ids=list(prompt),
                    token_ids=ids,
                    logprobs=_sampled_logprobs(ids, sample.logprobs),
                    finish_reason=reason,
                    text=sample.text if sample.text else None,
                    prompt_logprobs=prompt_lp,
                )
            )
    return result


class VLLMEngine:
    """A colocated ``vllm.LLM`` (see the module docstring); build it on every rank.

    ``model``: an HF directory or hub id. ``tensor_parallel_size``: ranks per vLLM instance
    (consecutive ranks; requests are pooled within a group). ``seed``: base seed, offset by the
    group index so groups sample differently while members of a group agree. ``llm_kwargs`` go
    to ``vllm.LLM`` unchanged (e.g. ``enforce_eager=True``, ``max_num_batched_tokens``).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        tensor_parallel_size: int = 1,
        dtype: str | torch.dtype = "bfloat16",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        seed: int = 0,
        enable_sleep_mode: bool = True,
        enable_prefix_caching: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        from lightrft.models.loading import to_dtype

        vllm = import_vllm()
        if not torch.cuda.is_available():
            raise ValueError("VLLMEngine needs a CUDA GPU; use NativeEngine on CPU")
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        groups = tp_groups(world, tensor_parallel_size)
        self.tp_size = tensor_parallel_size
        self.tp_group = None
        if tensor_parallel_size > 1:
            self.tp_group, _ = dist.new_subgroups_by_enumeration(groups)
        # external_launcher reads the torchrun variables; a plain single process gets defaults.
        for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world)):
            os.environ.setdefault(key, str(value))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")

        self.dtype = to_dtype(dtype)
        self.enable_sleep_mode = enable_sleep_mode
        rng = RNGState()
        self.llm = vllm.LLM(
            model=str(model),
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=enable_sleep_mode,
            seed=seed + rank // tensor_parallel_size,
            dtype=self.dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        rng.restore()
        self._vllm = vllm
        hf_config = self.llm.llm_engine.model_config.hf_config
        from lightrft.data import modality

        vlm = modality.is_vision_language(hf_config)
        alm = modality.is_audio_language(hf_config)
        self.vocab_size = int(hf_config.get_text_config().vocab_size)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.image_token_id = modality.image_token_id(hf_config) if vlm else None
        self.audio_token_id = modality.audio_token_id(hf_config) if alm else None
        self.video_token_id = (
            int(hf_config.video_token_id)
            if vlm and hf_config.model_type in ("qwen2_vl", "qwen2_5_vl")
            else None
        )
        self.suppress_token_ids = modality.media_token_ids(hf_config)
        self._names, self._required = hf_weight_names(hf_config)
        self._asleep: set[str] = set()
        self._unloaded: set[str] = set()

    # ---------------------------------------------------------------- sleep / wake / weights
    def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        if not self.enable_sleep_mode:
            raise ValueError("this VLLMEngine was built with enable_sleep_mode=False")
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        if level == 2:
            self._unloaded = set(self._required)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = check_wake_tags(tags)
        if self._asleep:
            self.llm.wake_up(tags=list(tags))
        self._asleep -= set(tags)

    def _model(self) -> torch.nn.Module:
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
        return worker.model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._asleep:
            raise ValueError(
                "the engine's weights are asleep; call wake_up(['weights']) before load_weights"
            )
        weights = list(weights)
        unknown = [name for name, _ in weights if name not in self._names]
        if unknown:
            raise ValueError(f"load_weights: unknown parameter name(s) {unknown[:8]}")
        self._model().load_weights(weights)
        self._unloaded -= {name for name, _ in weights}

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        requests: Sequence[Request],
        sampling: SamplingParams | Sequence[SamplingParams],
        continuation: Continuation | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions per request, ordered by (request, sample); with a
        ``continuation``, whole multi-turn trajectories (see the module docstring)."""
        check_awake(sorted(self._asleep), self._unloaded)
        if continuation is not None and self.tp_group is not None:
            raise ValueError(
                "multi-turn generation (a continuation) is not supported with "
                "tensor_parallel_size > 1 yet: the ranks of a group would have to run each "
                "other's continuations; use tensor_parallel_size=1"
            )
        requests = list(requests)
        params = per_request_params(sampling, len(requests))
        check_requests(requests, self.vocab_size)
        for p in params:
            if p.prompt_logprobs and (p.temperature not in (0, 1) or p.top_k > 0 or p.top_p < 1):
                raise ValueError(
                    "VLLMEngine returns prompt_logprobs only at temperature 1 without top-k / "
                    "top-p (vLLM's prompt log-probs are not processed)"
                )
        local = len(requests)
        if self.tp_group is not None:
            # Every member of a TP group must run the same batch: pool the group's requests.
            import torch.distributed as dist

            pooled: list[Any] = [None] * self.tp_size
            dist.all_gather_object(pooled, (requests, params), group=self.tp_group)
            offset = sum(len(r) for r, _ in pooled[: dist.get_rank(self.tp_group)])
            requests = [r for rs, _ in pooled for r in rs]
            params = [p for _, ps in pooled for p in ps]
        else:
            offset = 0
        completions = self._generate_all(requests, params)
        if continuation is not None:
            completions = self._continue(requests, params, completions, continuation)
        mine = [c for c in completions if offset <= c.request_index < offset + local]
        for c in mine:
            c.request_index -= offset
        return mine

    def _prompt(self, ids: list[int], req: Request) -> dict[str, Any]:
        return vllm_prompt(
            ids, req.media, self.image_token_id, self.audio_token_id, self.video_token_id
        )

    def _sampling(self, p: SamplingParams, **kwargs: Any) -> dict[str, Any]:
        return vllm_sampling_kwargs(p, suppress_token_ids=self.suppress_token_ids, **kwargs)

    def _generate_all(
        self, requests: list[Request], params: list[SamplingParams]
    ) -> list[Completion]:
        vllm = self._vllm
        plain = [i for i, p in enumerate(params) if p.first_token_temperature is None]
        fire = [i for i, p in enumerate(params) if p.first_token_temperature is not None]
        result: list[Completion] = []
        if plain:
            outs = self.llm.generate(
                [self._prompt(requests[i].prompt_token_ids, requests[i]) for i in plain],
                [vllm.SamplingParams(**self._sampling(params[i])) for i in plain],
                use_tqdm=False,
            )
            result += completions_from_outputs(
                outs, plain, [requests[i].prompt_token_ids for i in plain]
            )
        if fire:
            result += self._generate_fire(requests, params, fire)
        result.sort(key=lambda c: (c.request_index, c.sample_index))
        return result

    def _generate_fire(
        self, requests: list[Request], params: list[SamplingParams], index: list[int]
    ) -> list[Completion]:
        """FIRE in two passes: n first tokens at the hot temperature, then one continuation each."""
        vllm = self._vllm
        prompts = [requests[i].prompt_token_ids for i in index]
        firsts = completions_from_outputs(
            self.llm.generate(
                [self._prompt(requests[i].prompt_token_ids, requests[i]) for i in index],
                [vllm.SamplingParams(**self._sampling(params[i], first_token=True)) for i in index],
                use_tqdm=False,
            ),
            index,
            prompts,
        )
        todo = [
            c
            for c in firsts
            if c.finish_reason != "stop" and params[c.request_index].max_tokens > 1
        ]
        if not todo:
            return firsts
        rest_prompts, rest_params = [], []
        for c in todo:
            p = params[c.request_index]
            kwargs = self._sampling(p)
            # A distinct stream per sample: each continuation is its own n=1 request.
            seed = None if p.seed is None else p.seed + 1_000_003 * (c.sample_index + 1)
            kwargs.update(n=1, max_tokens=p.max_tokens - 1, seed=seed, prompt_logprobs=None)
            rest_prompts.append(
                self._prompt(c.prompt_token_ids + c.token_ids, requests[c.request_index])
            )
            rest_params.append(vllm.SamplingParams(**kwargs))
        rests = self.llm.generate(rest_prompts, rest_params, use_tqdm=False)
        tokenizer = self.llm.get_tokenizer()
        for c, out in zip(todo, rests, strict=True):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            c.token_ids = c.token_ids + ids
            c.logprobs = c.logprobs + _sampled_logprobs(ids, sample.logprobs)
            c.finish_reason = check_finish_reason(
                sample.finish_reason, "vLLM", c.request_index, c.sample_index
            )
            if params[c.request_index].detokenize:
                c.text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return firsts

    def _continue(
        self,
        requests: list[Request],
        params: list[SamplingParams],
        firsts: list[Completion],
        continuation: Continuation,
    ) -> list[Completion]:
        """Later turns, in rounds (:func:`~lightrft.engine.external.continue_in_rounds`): each
        trajectory that goes on is one ``n=1`` request of prompt + response so far."""
        vllm = self._vllm

        def sample_round(going: list[Trajectory]) -> list[tuple[list[int], list[float], str]]:
            prompts, sampling = [], []
            for t in going:
                c = t.completion
                kwargs = self._sampling(t.params)
                kwargs.update(n=1, max_tokens=t.max_tokens, seed=t.seed)
                kwargs.pop("prompt_logprobs", None)  # the prompt's were asked on turn 1
                req = requests[c.request_index]
                prompts.append(self._prompt(c.prompt_token_ids + c.token_ids, req))
                sampling.append(vllm.SamplingParams(**kwargs))
            outs = self.llm.generate(prompts, sampling, use_tqdm=False)
            result = []
            for t, out in zip(going, outs, strict=True):
                sample, c = out.outputs[0], t.completion
                ids = list(sample.token_ids)
                reason = check_finish_reason(
                    sample.finish_reason, "vLLM", c.request_index, c.sample_index
                )
                result.append((ids, _sampled_logprobs(ids, sample.logprobs), reason))
            return result

        tokenizer = self.llm.get_tokenizer()
        return continue_in_rounds(
            firsts,
            params,
            [self._budget(c, params[c.request_index]) for c in firsts],
            continuation,
            sample_round,
            vocab_size=self.vocab_size,
            forbidden=set(self.suppress_token_ids),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )

    def _budget(self, c: Completion, p: SamplingParams) -> int:
        """Response tokens a trajectory may hold: ``max_tokens``, and the model length."""
        return min(p.max_tokens, self.max_model_len - len(c.prompt_token_ids))
