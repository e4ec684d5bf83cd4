"""The SGLang adapter: SGLang's offline ``sglang.Engine`` behind the engine protocol.

Written against sglang 0.5.21, the newest release that pins torch 2.13 (0.5.22 pins 2.14.1);
file paths below are inside its wheel (``sglang/srt/...``). Like the vLLM adapter it is
optional (``pip install 'lightrft[sglang]'``), CUDA only, and imported only when built.

**Process layout.** ``sglang.Engine`` is "offline" but not in-process like vLLM's
``external_launcher``: the tokenizer manager runs in this process, the model in a scheduler
subprocess it spawns (``entrypoints/engine.py``, ``Engine._launch_subprocesses``). Every trainer
rank builds its own engine on its own GPU (``base_gpu_id`` = the rank's current CUDA device, the
trainer's); tensor parallelism (one engine over several ranks' GPUs) is not supported. Weights
reach the subprocess through ``update_weights_from_tensor``, which serializes CUDA tensors as IPC
handles (``MultiprocessingSerializer``): no copy through the host.

**Requests.** Token-id prompts (``input_ids``), one SGLang request per sample: a request's ``n``
samples are ``n`` requests. SGLang's own ``n`` must be equal across a batch
(``managers/io_struct.py``, ``GenerateReqInput._handle_parallel_sampling``) and its seeded
sampling draws from (seed, position) only, so ``n`` copies of one seeded request would be ``n``
identical samples; separate requests give every sample its own seed (the radix cache still
prefills a shared prompt once when it can). ``max_new_tokens`` is capped at what the context
leaves: SGLang refuses a request whose prompt plus ``max_new_tokens`` exceeds the context
(``managers/tokenizer_manager.py``, ``_validate_one_request``), where our protocol ends it
``"length"``.

**Log-probs** (``return_logprob``, ``meta_info["output_token_logprobs"]``, one
``(logprob, token_id, text)`` per sampled token): SGLang's standard sampler returns
``log(softmax(logits / temperature))`` (``layers/sampler.py``, ``Sampler.forward``): after the
temperature, **before top-k / top-p** (the filtered distribution is built inside
``_sample_from_probs`` and not kept). The native engine and ``VLLMEngine`` return log-probs after
top-k / top-p too (the protocol's definition). They agree whenever top-k and top-p are off
(``rollout.top_p: 1``, the GRPO default); with a filter on, SGLang's are lower by the log of the
kept mass (and so still equal what a trainer scoring at the temperature computes). Greedy rows get the argmax
token's log-prob at temperature 1 in all three. ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (log-probs
before the temperature) is refused.

**Seeds.** SGLang honours a per-request ``sampling_seed`` only when the engine runs with
``enable_deterministic_inference`` (``sampling/sampling_batch_info.py``: without it the seeds
are dropped; with it an unseeded request gets seed 42). ``SGLangEngine(deterministic=True)``
turns it on (SGLang then samples with torch instead of FlashInfer, and uses batch-invariant
kernels: slower); a request without a seed then draws one from the engine's own generator.
With ``deterministic=False`` (the default) seeds cannot be honoured: the engine says so once
(a warning) and samples are not reproducible.

**Sleep / wake** (``enable_memory_saver``): level 1 releases SGLang's ``kv_cache`` and
``cuda_graph`` memory and keeps the weights; level 2 also releases ``weights``, whose contents
are then lost (unless built with ``enable_weights_cpu_backup=True``). SGLang's resume of a tag
that is not released fails (``managers/scheduler_components/weight_updater.py``,
``resume_memory_occupation`` removes it from a set), so only released tags are resumed.

**Weight sync.** In 0.5.21 ``update_weights_from_tensor`` is refused outside a weight-update
session (``weight_updater.py``: "must run between begin_weight_update() and
end_weight_update()"). The first ``load_weights`` after a generation opens one, every bucket
goes in with ``flush_cache=False``, and ``reset_prefix_cache`` (which ``sync_weights`` calls
last) closes it and flushes the radix cache; ``generate`` closes a session left open.

**Images** go as ``image_data`` (the resized PIL images) with each image's placeholder run
collapsed to one token: SGLang's processor decodes the ids and expands the images again
(``multimodal/processors/base_processor.py``, ``load_mm_data``). ``Engine.generate`` takes no
per-request processor settings, so the engine checks that SGLang's expanded prompt has the
dataset's length and refuses a mismatch. Audio is not supported.

**Multi-turn** uses the same rounds loop as ``VLLMEngine``
(:meth:`~lightrft.engine.external.ExternalEngine._continue`).
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightrft.data.media import Media
from lightrft.engine.external import (
    MEDIA_LOGIT_BIAS,
    ExternalEngine,
    check_finish_reason,
    collapse_media,
    kept_rng_state,
    turn_seed,
)
from lightrft.engine.protocol import (
    Completion,
    Continuation,
    Request,
    SamplingParams,
    check_sleep_level,
    check_wake_tags,
    check_weight_names,
    checked_call,
)
from lightrft.models.loading import load_tokenizer, to_dtype

SGLANG_VERSION = "0.5.21"

# Our wake-up tags as SGLang's memory tags (sglang/srt/constants.py): CUDA-graph buffers go and
# come back with the KV cache.
SGLANG_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}


def import_sglang():
    """``import sglang`` with an actionable error when it is missing."""
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            f"SGLangEngine needs SGLang: pip install 'lightrft[sglang]' (sglang=={SGLANG_VERSION}, "
            "CUDA only); the native engine (lightrft.engine.NativeEngine) needs nothing extra"
        ) from e
    return sglang


def sglang_sampling_params(
    p: SamplingParams,
    *,
    max_new_tokens: int,
    seed: int | None,
    first_token: bool = False,
    suppress_token_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """SGLang's sampling-params dict (``sampling/sampling_params.py``) for one sample.

    ``first_token=True``: the first phase of FIRE, one token at ``first_token_temperature``.
    SGLang itself turns temperature 0 into top-k 1 and top-k -1 into "whole vocabulary".
    """
    d: dict[str, Any] = {
        "max_new_tokens": 1 if first_token else max_new_tokens,
        "temperature": p.first_token_temperature if first_token else p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "ignore_eos": p.ignore_eos,
    }
    if p.stop_token_ids:
        d["stop_token_ids"] = [int(t) for t in p.stop_token_ids]
    if seed is not None:
        d["sampling_seed"] = int(seed)
    if suppress_token_ids:
        # SGLang's logit_bias keys are strings (JSON object keys).
        d["logit_bias"] = {str(int(t)): MEDIA_LOGIT_BIAS for t in suppress_token_ids}
    return d


def sglang_prompt(
    ids: Sequence[int], media: Media | None, image_token_id: int | None
) -> tuple[list[int], list[Any] | None]:
    """``(input_ids, images)`` of a request whose ids hold expanded image placeholders."""
    if media is None:
        return list(ids), None
    collapsed = collapse_media(ids, media, {"image": image_token_id})
    if media.audio is not None or media.video is not None:
        kind = "audio" if media.audio is not None else "video"
        raise ValueError(
            f"SGLangEngine takes images only; for {kind} use NativeEngine or VLLMEngine"
        )
    return collapsed, None if media.image is None else list(media.image.images)


def sample_from_output(out: dict[str, Any], request: int, sample: int) -> tuple:
    """``(ids, logprobs, finish_reason, prompt_tokens)`` of one ``Engine.generate`` output dict
    (``managers/tokenizer_manager.py``: ``output_ids`` with the stop token kept,
    ``meta_info["finish_reason"]["type"]`` in stop / length / abort)."""
    meta = out["meta_info"]
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise RuntimeError(
            f"SGLang aborted request {request} sample {sample}: {reason.get('message')}"
        )
    kind = check_finish_reason(kind, "SGLang", request, sample)
    ids = [int(t) for t in out["output_ids"]]
    steps = meta.get("output_token_logprobs")
    if steps is None:
        raise ValueError("SGLang returned no log-probs; return_logprob=True was expected")
    if len(steps) != len(ids) or any(int(s[1]) != t for s, t in zip(steps, ids, strict=False)):
        raise ValueError(
            f"SGLang's log-probs of request {request} sample {sample} do not follow its tokens"
        )
    return ids, [float(s[0]) for s in steps], kind, int(meta["prompt_tokens"])


class SGLangEngine(ExternalEngine):
    """An ``sglang.Engine`` on this rank's GPU (see the module docstring); build it on every rank.

    ``model``: an HF directory or hub id. ``tokenizer``: decodes ``Completion.text`` (default:
    the model's). ``gpu_memory_utilization``: SGLang's ``mem_fraction_static`` (weights + KV
    pool). ``deterministic``: honour seeds (``enable_deterministic_inference``). ``seed``: the
    engine's own seed (offset by the rank). ``engine_kwargs`` go to ``sglang.Engine`` unchanged
    (``ServerArgs`` names, e.g. ``disable_cuda_graph=True``, ``attention_backend="triton"``).
    """

    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        *,
        dtype: str | torch.dtype = "bfloat16",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        seed: int = 0,
        deterministic: bool = False,
        enable_sleep_mode: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        sgl = import_sglang()  # first: a missing extra fails before anything loads
        from transformers import AutoConfig

        if not torch.cuda.is_available():
            raise ValueError("SGLangEngine needs a CUDA GPU; use NativeEngine on CPU")
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"):
            raise ValueError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return log-probs before the "
                "temperature, not the sampling distribution's; unset it"
            )
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        gpu = torch.cuda.current_device()  # the trainer's GPU on this rank
        self.dtype = to_dtype(dtype)
        self.deterministic = deterministic
        self.enable_sleep_mode = enable_sleep_mode
        self._weights_backup = bool(engine_kwargs.get("enable_weights_cpu_backup", False))
        with kept_rng_state():
            self.llm = sgl.Engine(
                model_path=str(model),
                tp_size=1,
                base_gpu_id=gpu,
                random_seed=seed + rank,
                dtype=str(self.dtype).removeprefix("torch."),
                context_length=max_model_len,
                mem_fraction_static=gpu_memory_utilization,
                max_running_requests=max_num_seqs,
                enable_memory_saver=enable_sleep_mode,
                enable_deterministic_inference=deterministic,
                **engine_kwargs,
            )
        hf_config = AutoConfig.from_pretrained(str(model))
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        self._setup(hf_config, int(self.llm.tokenizer_manager.context_len), seed + rank)

    def _setup(self, hf_config, max_model_len: int, seed: int) -> None:
        """The state every engine needs, whatever built ``self.llm`` (the tests build it over a
        fake ``sglang.Engine``)."""
        super()._setup(hf_config, max_model_len)
        self._updating = False  # a weight-update session is open in SGLang
        self._seeds = random.Random(seed)  # seeds of unseeded requests (deterministic mode)
        self._warned_seed = False

    # ---------------------------------------------------------------- sleep / wake / weights
    def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        if not self.enable_sleep_mode:
            raise ValueError("this SGLangEngine was built with enable_sleep_mode=False")
        self._end_weight_update()
        tags = ("kv_cache",) if level == 1 else ("weights", "kv_cache")
        todo = [t for t in tags if t not in self._asleep]
        if todo:
            self.llm.release_memory_occupation(tags=[s for t in todo for s in SGLANG_TAGS[t]])
        self._asleep |= set(todo)
        if level == 2 and not self._weights_backup:
            self._unloaded = set(self._required)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = check_wake_tags(tags)
        todo = [t for t in tags if t in self._asleep]
        if todo:
            self.llm.resume_memory_occupation(tags=[s for t in todo for s in SGLANG_TAGS[t]])
        self._asleep -= set(todo)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = list(weights)
        asleep = "weights" in self._asleep
        check_weight_names([name for name, _ in weights], self._names, asleep, "load_weights")
        if not self._updating:
            _check_ok(self.llm.begin_weight_update(), "begin_weight_update")
            self._updating = True
        # The radix cache is flushed once, when the session closes (reset_prefix_cache).
        _check_ok(
            self.llm.update_weights_from_tensor(named_tensors=weights, flush_cache=False),
            "update_weights_from_tensor",
        )
        self._unloaded -= {name for name, _ in weights}

    def reset_prefix_cache(self) -> bool:
        self._end_weight_update()
        if "kv_cache" in self._asleep:
            return True  # releasing the KV cache flushed it, and nothing has run since
        return bool(getattr(self.llm.flush_cache(), "success", True))

    def _end_weight_update(self) -> None:
        if self._updating:
            self._updating = False
            _check_ok(self.llm.end_weight_update(), "end_weight_update")

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        requests: Sequence[Request],
        sampling: SamplingParams | Sequence[SamplingParams],
        continuation: Continuation | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions per request, ordered by (request, sample); with a
        ``continuation``, whole multi-turn trajectories (see the module docstring)."""
        requests, params = checked_call(self, requests, sampling)
        if any(p.prompt_logprobs for p in params):
            raise ValueError("SGLangEngine does not return prompt_logprobs; use NativeEngine")
        if any(r.resume is not None for r in requests):  # it would restart from the prompt
            raise ValueError("SGLangEngine does not continue a Request.resume; use NativeEngine")
        prompts = [self._prompt(r.prompt_token_ids, r) for r in requests]
        budgets = [self._budget(r, p) for r, p in zip(requests, params, strict=True)]
        if self._updating:  # weights were loaded without reset_prefix_cache: finish the update
            self.reset_prefix_cache()
        # Every (sample, turn) draws from its own seed (turn_seed); a FIRE sample's two passes
        # share one, drawn at different positions (SGLang's seeded draws hash the position).
        params = [replace(p, seed=self._base_seed(p.seed)) for p in params]
        items = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        # FIRE: every sample's first token at the hot temperature, then the rest of it.
        outs = self._run(
            [prompts[i] for i, _ in items],
            [
                sglang_sampling_params(
                    params[i],
                    max_new_tokens=budgets[i],
                    seed=turn_seed(params[i].seed, j, 0),
                    first_token=params[i].first_token_temperature is not None,
                    suppress_token_ids=self.suppress_token_ids,
                )
                for i, j in items
            ],
        )
        completions = []
        for (i, j), o in zip(items, outs, strict=True):
            ids, lps, reason, prompt_len = sample_from_output(o, i, j)
            self._check_prompt_len(requests[i], prompt_len, i)
            completions.append(
                Completion(
                    request_index=i,
                    sample_index=j,
                    prompt_token_ids=list(requests[i].prompt_token_ids),
                    token_ids=ids,
                    logprobs=lps,
                    finish_reason=reason,
                    text=self._decode(ids) if params[i].detokenize else None,
                )
            )
        self._fire_rest(requests, params, completions)
        if continuation is not None:
            completions = self._continue(requests, params, completions, continuation)
        return completions

    def _base_seed(self, seed: int | None) -> int | None:
        """A request's seed as sent to SGLang (None: SGLang's own randomness)."""
        if not self.deterministic:
            if seed is not None and not self._warned_seed:
                self._warned_seed = True
                warnings.warn(
                    "SGLangEngine ignores SamplingParams.seed unless built with "
                    "deterministic=True (SGLang's enable_deterministic_inference): samples are "
                    "not reproducible",
                    stacklevel=3,
                )
            return None
        if seed is None:  # SGLang would give every unseeded row seed 42
            seed = self._seeds.getrandbits(62)
        return seed

    def _prompt(self, ids: list[int], req: Request) -> tuple[list[int], list[Any] | None]:
        return sglang_prompt(ids, req.media, self.image_token_id)

    def _run(
        self, prompts: list[tuple[list[int], list[Any] | None]], sampling: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """One ``Engine.generate`` over a batch of ``(input_ids, images)``: its output dicts."""
        if not prompts:
            return []
        images = [imgs or [] for _, imgs in prompts]
        outs = self.llm.generate(
            input_ids=[ids for ids, _ in prompts],
            sampling_params=sampling,
            # One list per request, [] for none: SGLang reads "a list per request" off the first
            # entry only (managers/io_struct.py, GenerateReqInput._normalize_image_data).
            image_data=images if any(images) else None,
            return_logprob=True,
        )
        assert len(outs) == len(prompts), (len(outs), len(prompts))
        return outs

    def _budget(self, req: Request, p: SamplingParams) -> int:
        """Response tokens a sample may hold: ``max_tokens``, and what the context leaves."""
        room = self.max_model_len - len(req.prompt_token_ids)
        if room < 1:
            raise ValueError(
                f"a prompt of {len(req.prompt_token_ids)} tokens leaves no room to generate "
                f"under max_model_len={self.max_model_len}"
            )
        return min(p.max_tokens, room)

    def _check_prompt_len(self, req: Request, got: int | None, index: int) -> None:
        """SGLang re-expands image placeholders itself: its prompt must be the dataset's."""
        if got is not None and got != len(req.prompt_token_ids):
            raise ValueError(
                f"SGLang expanded request {index}'s prompt to {got} tokens, the dataset to "
                f"{len(req.prompt_token_ids)}: its image processor sized the images differently "
                "(SGLang takes no per-request processor settings)"
            )

    def _sample_on(
        self, requests: list[Request], going: list[tuple[Completion, SamplingParams, int, Any]]
    ) -> list[tuple[list[int], list[float], str]]:
        """One request per ``(completion, params, max_tokens, seed)`` that goes on from its
        prompt + response so far: the ``(ids, log-probs, finish reason)`` each sampled."""
        outs = self._run(
            [
                self._prompt(c.prompt_token_ids + c.token_ids, requests[c.request_index])
                for c, *_ in going
            ],
            [
                sglang_sampling_params(
                    p, max_new_tokens=m, seed=seed, suppress_token_ids=self.suppress_token_ids
                )
                for _, p, m, seed in going
            ],
        )
        return [
            sample_from_output(out, c.request_index, c.sample_index)[:3]
            for (c, *_), out in zip(going, outs, strict=True)
        ]


def _check_ok(result: Any, what: str) -> None:
    """SGLang's control calls answer ``(success, message)``; a failure must not pass silently."""
    if isinstance(result, tuple) and len(result) >= 2 and not result[0]:
        raise RuntimeError(f"SGLang {what} failed: {result[1]}")
