"""The native rollout engine: batched sampling in pure torch over the Hugging Face model class.

The engine keeps its own inference copy of the weights and drives the HF decoder stack one step
at a time with a preallocated KV cache:

* continuous batching: the cache has ``max_num_seqs`` rows (fewer under ``max_kv_tokens``);
  every step feeds one token per active row, rows that finish free their cache rows at once,
  and in the same step the next waiting requests (in call order, whole: a request waits until
  its ``n`` samples fit) are admitted and decode from the next step on beside the others.
  ``engine.stats`` counts the last call's steps, the requests admitted while others decoded
  and the most rows active at once;
* a newcomer's prompt is left-padded and prefilled once (newcomers of a step together); its
  ``n`` samples then share that prompt's keys and values (copied into ``n`` cache rows), so a
  GRPO group costs one prefill instead of ``n``. Every row has the same layout (prompt ending at
  slot ``plen``, the call's longest prompt; response token ``a`` at slot ``plen + a``); a row's
  response index and stream counter are offsets from the step counter set at admission, so a
  sample does not depend on when it was admitted;
* active rows sit first in the cache; rows that stop are compacted away (rows from the tail move
  into their places), so finished sequences stop costing compute;
* multi-turn (a ``continuation``): a row whose turn ends at a stop token moves behind the
  decoding rows and keeps its cache row while its continuation runs on a thread pool; when the
  observation is ready, the row's stop token and the observation ids are prefilled at the row's
  own positions (nothing it holds is recomputed) and it decodes on. Rows therefore sit at
  different lengths: each writes its own cache slot and masks the rest;
* sampling, stop tokens and per-row seeds are handled in :mod:`lightrft.engine.sampling`; a
  row's random stream is indexed by how many tokens it has sampled, so a seeded trajectory does
  not depend on the batch or on when its observations arrive.

Supported: decoder-only Llama-style models (``llama``, ``qwen2``, ``qwen3``, ``mistral``) whose
base model accepts a prepared 4D boolean attention mask, and the vision- and audio-language models
built on them (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``llava``; ``qwen2_audio``). Anything else
should use the vLLM adapter.

Multimodal requests carry their processed media (``Request.media``, a
:class:`~lightrft.data.media.Media`) and prompt ids whose placeholders are already expanded (what
the datasets produce). Audio (Qwen2-Audio): the audio tower runs once per request in the prefill,
positions are ordinary, and the audio placeholder is never sampled. Images: the vision tower runs
once per request, in the prefill; the ``n`` samples share its keys and values like any prompt. M-RoPE
models (Qwen-VL) get their 3-D prefill positions from the model's ``get_rope_index`` and decode
at ``position + rope_delta`` (the offset by which the images shift later text positions), as
Hugging Face generation does. Vision placeholder and marker tokens are never sampled; reported
log-probs are the model's own (without that mask), the quantity the trainer computes.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from lightrft.config import at_least
from lightrft.data.media import Media
from lightrft.engine import sampling as smp
from lightrft.engine.protocol import (
    Completion,
    Continuation,
    FinishReason,
    Request,
    SamplingParams,
    Turn,
    check_observation,
    check_resumes,
    check_sleep_level,
    check_wake_tags,
    check_weight_names,
    checked_call,
    sampled_mask,
)
from lightrft.models import modality
from lightrft.models.forward import mm_token_types, mrope_model
from lightrft.models.loading import head_dim, load_model, load_tokenizer, to_dtype
from lightrft.models.parallel import decoder_layers, default_param_dtype

TEXT_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
AUDIO_MODEL_TYPES = ("qwen2_audio",)
SUPPORTED_MODEL_TYPES = TEXT_MODEL_TYPES + VISION_MODEL_TYPES + AUDIO_MODEL_TYPES
_GRID_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")  # get_rope_index's


class KVCache:
    """Per-layer key/value buffers ``[rows, kv_heads, max_len, head_dim]`` of one ``generate``.

    It implements only ``update``, the one method HF attention layers call on
    ``past_key_values``. Before each forward the engine says, with :meth:`at`, which rows feed
    tokens, the cache slot of every new token (rows may sit at different lengths: a row back
    from an observation is longer than its neighbours) and how many slots attention reads.
    """

    def __init__(self, storage: torch.Tensor) -> None:
        # storage: [layers, 2, rows, kv_heads, max_len, head_dim], a view into the engine's pool.
        self.kv = storage
        self.max_len = storage.shape[4]

    def at(
        self, rows: slice, slots: torch.Tensor, end: int, real: torch.Tensor | None = None
    ) -> None:
        """The next forward feeds cache rows ``rows``; ``slots`` ([B, q]) is where each new
        token's keys go; attention reads slots ``[0, end)``. ``real`` ([B, q] bool, on the
        CPU): which queries are tokens rather than right padding (None: all); padding's keys
        are not kept."""
        assert end <= self.max_len, "KV cache overflow"
        self.rows, self.end = rows, end
        dev = slots.device
        if real is None:
            self._pick = None
            self._where = (torch.arange(slots.shape[0], device=dev)[:, None], slots)
        else:
            b, j = (x.to(dev) for x in real.nonzero(as_tuple=True))
            self._pick = (b, j)
            self._where = (b, slots[b, j])

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key, value: [B, kv_heads, q, head_dim]
        buf = self.kv[layer_idx]
        keys, values = buf[0, self.rows], buf[1, self.rows]  # [B, kv_heads, max_len, D]
        key, value = key.transpose(1, 2), value.transpose(1, 2)  # [B, q, kv_heads, D]
        if self._pick is not None:
            key, value = key[self._pick], value[self._pick]
        row, slot = self._where
        keys[row, :, slot] = key
        values[row, :, slot] = value
        return keys[:, :, : self.end], values[:, :, : self.end]

    def reorder(self, src: list[int], length: int) -> None:
        """Row ``i`` becomes old row ``src[i]`` (first ``length`` slots); only rows that change
        place are copied, and rows whose source is -1 (a newcomer, prefilled next; a row left
        as it is) not at all. The sources are read before anything is written."""
        moved = [i for i, j in enumerate(src) if i != j and j >= 0]
        if moved:
            dev = self.kv.device
            dst = torch.tensor(moved, device=dev)
            src_rows = torch.tensor(src, device=dev)[dst]
            self.kv[:, :, dst, :, :length] = self.kv[:, :, src_rows, :, :length]


@dataclass
class SchedulerStats:
    """Counters of the native engine's last ``generate`` call (``engine.stats``)."""

    steps: int = 0  # decoding forward steps
    sampled_tokens: int = 0  # tokens sampled (what a token_budget counts)
    admitted_while_decoding: int = 0  # requests that entered rows freed while others decoded
    max_active_rows: int = 0  # most rows decoding in one step


@dataclass
class _RowState:
    """Per-trajectory state of one ``generate`` (all tensors [R] unless noted; each row's
    request and sample index are :class:`_Trajectories`' ``request`` and ``sample``).

    Response index and sample count of a decoding row grow by one per step, so the loop keeps
    them as offsets from the step counter (``shift``, ``kshift``), set when a row is admitted
    and changed only when it comes back from an observation: a step needs no per-row
    bookkeeping on the host.
    """

    seed: torch.Tensor
    temperature: torch.Tensor
    first_temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    max_new: torch.Tensor  # response budget (assistant + observation tokens) of this call
    stop_ids: torch.Tensor  # [R, S], padded with -1
    pad: torch.Tensor  # left padding of the row's prompt (decode position = slot - pad + delta)
    delta: torch.Tensor  # M-RoPE decode offset (0 without)
    shift: torch.Tensor  # response index of the next sampled token - step
    # tokens sampled so far (its stream counter) - step; before admission, a Resume's tokens
    kshift: torch.Tensor


class NativeEngine:
    """A colocated rollout engine over an HF causal LM (see the module docstring).

    ``model``: an HF directory (loaded with :func:`lightrft.models.load_model`) or an
    unsharded HF ``nn.Module``, which is copied. ``tokenizer``: defaults to the directory's; gives
    the end-of-sequence ids and detokenised text. ``dtype``: weights and KV cache (default bf16 on
    CUDA, fp32 on CPU). ``max_model_len``: prompt plus response tokens (default: the model's
    ``max_position_embeddings``). ``max_num_seqs``: rows decoded together (cache rows; a
    request is admitted when its ``n`` samples fit). ``max_prefill_tokens``: padded prompt tokens
    per prefill forward. ``max_kv_tokens``: KV-cache token slots (rows x (longest prompt +
    longest response)); bounds the cache's memory (bytes = slots x layers x 2 x kv_heads x
    head_dim x dtype size). ``truncate_prompts``: keep the last tokens of a too-long prompt
    instead of raising.
    ``seed``: the stream from which requests without a seed draw theirs. ``compile``: compile each
    decoder block's MLP with ``torch.compile(dynamic=True)`` (meant for GPUs). After a call,
    ``stats`` holds its scheduler counters (:class:`SchedulerStats`).
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        tokenizer=None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 512,
        max_prefill_tokens: int = 16384,
        max_kv_tokens: int | None = None,
        truncate_prompts: bool = False,
        seed: int = 0,
        compile: bool = False,
    ) -> None:
        at_least("max_num_seqs", max_num_seqs, 1)
        at_least("max_prefill_tokens", max_prefill_tokens, 1)
        at_least("max_kv_tokens", max_kv_tokens, 1)  # None: unbounded
        if isinstance(model, nn.Module):
            config, default_device = model.config, next(model.parameters()).device
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)  # checked before anything loads
            default_device = "cuda" if torch.cuda.is_available() else "cpu"
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"NativeEngine supports model types {SUPPORTED_MODEL_TYPES}, got "
                f"{config.model_type!r}; use VLLMEngine for other architectures"
            )
        self.device = torch.device(device if device is not None else default_device)
        self.dtype = to_dtype(dtype) if dtype is not None else default_param_dtype(self.device)
        if isinstance(model, nn.Module):
            from torch.distributed.tensor import DTensor

            for name, p in model.named_parameters():
                if isinstance(p, DTensor):
                    raise ValueError(
                        f"NativeEngine needs an unsharded model, but parameter {name!r} is a "
                        "DTensor; build the engine from the HF directory and call "
                        "sync_weights(model, engine)"
                    )
            self.model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        else:
            self.model = load_model(model, dtype=self.dtype, device=self.device)  # SDPA attention
            if tokenizer is None:
                tokenizer = load_tokenizer(model)
        self.tokenizer = tokenizer
        self.model.eval().requires_grad_(False)
        config = self.model.config
        if getattr(config, "_attn_implementation", None) != "sdpa":
            # Our prepared boolean masks are what the SDPA attention path consumes as-is.
            self.model.set_attn_implementation("sdpa")
        self.base = getattr(self.model, self.model.base_model_prefix)
        # transformers >= 5.2x names the KV cache argument `cache` (`past_key_values` warns).
        params = inspect.signature(self.base.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.lm_head = self.model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        # Media kinds the model takes, with their placeholder token ids.
        self.media_token_ids = modality.placeholder_ids(config)
        # Vision-language models: the M-RoPE position maker (Qwen-VL). Multimodal ones: the
        # tokens only the processor may place, never the sampler.
        self.rope = mrope_model(self.model) if modality.is_vision_language(config) else None
        self.suppress_ids = (
            torch.tensor(modality.media_token_ids(config), dtype=torch.long, device=self.device)
            if self.media_token_ids
            else None
        )
        config = config.get_text_config()
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (prompt + 1 token), got {max_model_len}")
        window = getattr(config, "sliding_window", None)
        sliding = bool(getattr(config, "use_sliding_window", config.model_type == "mistral"))
        if sliding and window is not None and self.max_model_len > window:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's sliding_window={window}; "
                "the native engine only does full attention: pass max_model_len <= sliding_window"
            )
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_kv_tokens = max_kv_tokens
        self.truncate_prompts = truncate_prompts
        # End-of-sequence ids: the generation config's, the model's, the tokenizer's (each None,
        # an id or a list of ids).
        gen, top = getattr(self.model, "generation_config", None), self.model.config
        eos = (getattr(gen, "eos_token_id", None), getattr(top, "eos_token_id", None))
        eos += (getattr(tokenizer, "eos_token_id", None),)
        ids = [x for e in eos if e is not None for x in ([e] if isinstance(e, int) else e)]
        self.eos_token_ids = list(dict.fromkeys(ids))
        # The tokenizer's pad id, else the model's, else the first end-of-sequence id, else 0.
        pads = (getattr(tokenizer, "pad_token_id", None), getattr(top, "pad_token_id", None))
        self.pad_token_id = next((int(x) for x in (*pads, *ids[:1]) if x is not None), 0)
        self._seed_rng = torch.Generator().manual_seed(seed)
        if compile:
            # Only the MLPs: pure tensor code with a dynamic row count. Compiling whole blocks
            # would trace into the KV cache, whose layer index and write position are Python
            # ints that force a recompile per layer and per step.
            for layer in decoder_layers(self.model):
                layer.mlp.compile(dynamic=True)

        # Every name a checkpoint may use (tied weights appear under both names) -> parameter.
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # Each parameter's canonical name: its first, as named_parameters() gives it.
        self._canonical = {id(p): n for n, p in reversed(list(self._params.items()))}
        self._shapes = {n: p.shape for n, p in self._params.items()}
        self._kv_pool: torch.Tensor | None = None
        self._asleep: set[str] = set()  # what sleep released: "weights", "kv_cache"
        self._weights_version = 0  # bumped whenever the weights' storage is replaced
        self._unloaded: set[str] = set()  # canonical names not loaded since a level-2 sleep
        self.stats = SchedulerStats()

    # ---------------------------------------------------------------- sleep / wake / weights
    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache; level 2 also frees the weights (reload all of them)."""
        check_sleep_level(level)
        self._kv_pool = None
        self._asleep.add("kv_cache")
        if level == 2 and "weights" not in self._asleep:
            for _, p in self.model.named_parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._asleep.add("weights")
            self._weights_version += 1

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``["weights"]`` (contents undefined until loaded) and/or ``["kv_cache"]``."""
        tags = check_wake_tags(tags)
        if "weights" in tags and "weights" in self._asleep:
            for name, p in self.model.named_parameters():
                p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=p.device)
            self._unloaded = {name for name, _ in self.model.named_parameters()}
            self._weights_version += 1
        self._asleep -= set(tags)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, full_tensor)`` pairs into the engine (cast to its dtype and device).

        Every name and shape is checked before anything is copied, so a bad batch changes
        nothing.
        """
        weights = list(weights)
        asleep = "weights" in self._asleep
        check_weight_names([name for name, _ in weights], self._params, asleep, "load_weights")
        params, tensors = [self._params[name] for name, _ in weights], []
        for (name, tensor), param in zip(weights, params, strict=True):
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the engine "
                    f"expects {tuple(param.shape)}"
                )
            tensors.append(tensor.to(param.device))
        if params:
            torch._foreach_copy_(params, tensors)  # one batched copy, casting to our dtype
        self._unloaded -= {self._canonical[id(param)] for param in params}

    @property
    def weights_version(self) -> int:
        """Changes whenever the weights' storage is replaced (a level-2 sleep, waking the weights):
        tensors from :meth:`weight_buffers` are valid while it stays the same."""
        return self._weights_version

    def weight_buffers(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The engine's own weight tensors for these HF names, to be written in place.

        A writer that fills them (``sync_weights`` gathers straight into them) saves the copy
        that :meth:`load_weights` makes. The names count as loaded from this call on: write every
        one before the next ``generate``. The tensors stay valid while :attr:`weights_version`
        does not change. Unknown names raise, as in :meth:`load_weights`.
        """
        check_weight_names(names, self._params, "weights" in self._asleep, "weight_buffers")
        params = [self._params[name] for name in names]
        self._unloaded -= {self._canonical[id(param)] for param in params}
        return [param.data for param in params]

    def reset_prefix_cache(self) -> bool:
        """Nothing to drop: prompt KV states are shared only within one ``generate`` call."""
        return True

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[Request],
        sampling: SamplingParams | Sequence[SamplingParams],
        continuation: Continuation | None = None,
        token_budget: int | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions per request; returned ordered by (request, sample).

        ``continuation``: see :class:`~lightrft.engine.protocol.Turn`. It runs on a thread pool
        (one worker per cache row, at most 64) while the other rows decode.

        ``token_budget`` (partial rollouts): stop once the call has sampled this many tokens,
        at the end of that decoding step (each step samples one token per active row, so the
        call overshoots by less than one token per row). Rows still decoding, and the samples
        of requests not yet admitted, come back ``finish_reason="partial"``; a later call
        continues each with ``Request(prompt, resume=Resume(...))``, re-prefilling its tokens.
        """
        requests, params = checked_call(self, requests, sampling, token_budget)
        if token_budget is not None and continuation is not None:
            raise ValueError(
                "token_budget (partial rollouts) does not take a continuation: a multi-turn "
                "row waiting on its tools cannot be cut and re-prefilled"
            )
        check_resumes(requests, params, self.vocab_size)
        # Each request with its media checked (None without).
        requests = [replace(r, media=self._request_media(i, r)) for i, r in enumerate(requests)]
        prefixes = [[] if r.resume is None else list(r.resume.token_ids) for r in requests]
        prompts = [
            self._fit_prompt(i, r, p, prefixes[i])
            for i, (r, p) in enumerate(zip(requests, params, strict=True))
        ]
        seeds = [
            p.seed
            if p.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            for p in params
        ]
        if not requests:
            return []
        prior = [len(x) for x in prefixes]
        # Tokens each request may still sample: its max_tokens less what a resumed request
        # sampled before, and no further than max_model_len.
        room = [
            min(p.max_tokens - k, self.max_model_len - len(x))
            for x, p, k in zip(prompts, params, prior, strict=True)
        ]
        # The row layout of the call: every prompt ends at slot plen (the longest prompt, a
        # resumed response's tokens included), response token a of this call sits at slot
        # plen + a; rows hold plen + max_new slots.
        plen, max_new = max(len(x) for x in prompts), max(room)
        # Cache rows: at most max_num_seqs and, when max_kv_tokens is set, at most that many
        # token slots (rows x (plen + max_new)); never fewer than the widest request's n (its
        # samples are admitted together).
        rows = min(self.max_num_seqs, sum(p.n for p in params))
        if self.max_kv_tokens is not None:
            rows = min(rows, self.max_kv_tokens // (plen + max_new))
        rows = max(rows, max(p.n for p in params))
        pool = None
        if continuation is not None:
            pool = ThreadPoolExecutor(min(rows, 64), thread_name_prefix="continuation")
        try:
            forbidden = () if self.suppress_ids is None else set(self.suppress_ids.tolist())
            check = functools.partial(
                check_observation, vocab_size=self.vocab_size, forbidden=forbidden
            )
            run = _Trajectories(
                requests, params, prompts, prior, room, seeds, continuation, pool, check
            )
            return self._generate_all(run, rows, plen, max_new, token_budget)
        finally:
            if pool is not None:
                # A continuation that hangs must not hang generate() once it has failed.
                pool.shutdown(wait=False, cancel_futures=True)

    def _request_media(self, index: int, req: Request) -> Media | None:
        """The request's media, each kind checked against the model and its placeholder
        tokens."""
        if req.media is None:
            return None
        if not isinstance(req.media, Media):
            raise ValueError(
                f"requests[{index}].media is a {type(req.media).__name__}; pass the Media the "
                "prompt datasets give (lightrft.data.media)"
            )
        kinds = dict(req.media.kinds())
        if kinds and not self.media_token_ids:
            raise ValueError(
                f"requests[{index}] carries media but the engine's model "
                f"({self.model.config.model_type}) is not a multimodal model (not a "
                "vision-language model, nor an audio-language one)"
            )
        unknown = [k for k in kinds if k not in self.media_token_ids]
        if unknown:
            takes = " and ".join(
                {"image": "images", "video": "videos"}.get(k, k) for k in self.media_token_ids
            )
            raise ValueError(
                f"requests[{index}] carries {' and '.join(unknown)}; the native engine takes "
                f"{takes} only for this model ({self.model.config.model_type})"
            )
        for kind, value in kinds.items():
            found = sum(1 for t in req.prompt_token_ids if t == self.media_token_ids[kind])
            if found != sum(value.num_tokens):
                raise ValueError(
                    f"requests[{index}] has {found} {kind} tokens but its {len(value)} {kind}(s) "
                    f"take {sum(value.num_tokens)}: prompt ids must hold the expanded "
                    "placeholders"
                )
        return req.media if kinds else None

    def _fit_prompt(
        self, index: int, req: Request, p: SamplingParams, prefix: list[int]
    ) -> list[int]:
        """The ids the engine prefills: the prompt (kept whole, or its end), then a resumed
        response's tokens."""
        ids = req.prompt_token_ids
        limit = self.max_model_len - 1  # at least one token must fit after the prompt
        if len(ids) + len(prefix) <= limit:
            return list(ids) + prefix
        if prefix:
            raise ValueError(
                f"requests[{index}] has {len(ids)} prompt tokens and resumes after "
                f"{len(prefix)} more; the engine's max_model_len is {self.max_model_len}: "
                "nothing is left to sample"
            )
        if not self.truncate_prompts or req.media is not None:
            raise ValueError(
                f"requests[{index}] has {len(ids)} prompt tokens; the engine's max_model_len is "
                f"{self.max_model_len} (room for at most {limit} prompt tokens). Shorten it, raise "
                "max_model_len, or build the engine with truncate_prompts=True (in a recipe, "
                "the prompt dataset checks lengths at load: its max_prompt_length and "
                "truncation options)"
            )
        keep = max(1, self.max_model_len - p.max_tokens)
        return list(ids[-keep:])

    def _kv_storage(self, rows: int, length: int) -> torch.Tensor:
        """A [layers, 2, rows, kv_heads, length, head_dim] view of the reusable pool."""
        shape = (self.num_layers, 2, rows, self.kv_heads, length, self.head_dim)
        numel = math.prod(shape)
        if self._kv_pool is None or self._kv_pool.numel() < numel:
            self._kv_pool = None  # free the old pool before allocating the larger one
            # Zeros, not empty: rows of different lengths read slots that they mask out but
            # never wrote, and a NaN there would survive the mask (0 * NaN in softmax @ V).
            self._kv_pool = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return self._kv_pool[:numel].view(shape)

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache,
        media: Media | None = None,
    ):
        """Hidden states [B, q, H] of the base model for token ids [B, q]."""
        extra = media.model_inputs(self.device, self.dtype) if media is not None else {}
        out = self.base(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_arg: cache},
            **extra,
        )
        return out.last_hidden_state

    def _generate_all(
        self, run: _Trajectories, cap: int, plen: int, max_new: int, token_budget: int | None
    ) -> list[Completion]:
        """Decode every request through ``cap`` cache rows with continuous batching (every
        prompt ends at slot ``plen``; a row holds ``plen + max_new`` slots, see :meth:`generate`).

        Each step samples one token per active row and feeds it back; rows that finish free
        their cache rows at once, and the next waiting request (first come, first served) is
        admitted as soon as ``n`` rows are free: its prompt is prefilled once into one row,
        copied into its ``n`` rows, and its samples decode from the next step on beside the
        others. A row's response index and stream counter are offsets from the step counter
        (``shift``, ``kshift``), so a newcomer needs only its own offsets.

        With a ``token_budget``, the loop ends after the step whose tokens spend it: the rows
        that did not end there, and the requests still queued, are cut (``"partial"``).
        """
        dev = self.device
        params = run.params
        total = plen + max_new
        state = self._row_state(run, plen)
        n_rows = len(run.request)
        cache = KVCache(self._kv_storage(cap, total))
        out_tok = torch.full((n_rows, max_new), -1, dtype=torch.long, device=dev)
        out_lp = torch.zeros((n_rows, max_new), dtype=torch.float32, device=dev)
        # Trajectory ids of request i: first_row[i] .. first_row[i + 1] - 1.
        first_row = [0, *itertools.accumulate(p.n for p in params)]
        queue = deque(range(len(params)))
        prompt_lp: dict[int, list[float]] = {}
        self.stats = SchedulerStats()

        def admit(free: int) -> list[int]:
            # Whole requests only: their n samples share one prefill.
            taken = []
            while queue and params[queue[0]].n <= free:
                free -= params[queue[0]].n
                taken.append(queue.popleft())
            return taken

        s = state  # the active rows' state, in cache-row order (set below)
        live = tok = logits = None
        step = 0
        while True:
            keep = run.rows[: run.active]  # the rows that decode on
            if keep:
                # Sample the active rows' next tokens ([A]) and record them at their response
                # indices. A row's stream is indexed by the tokens it sampled; FIRE's
                # temperature applies to the trajectory's first token only.
                first = (step + s.kshift) == 0
                temp = torch.where(first, s.first_temperature, s.temperature)
                u = smp.uniforms(s.seed, step + s.kshift)
                tok, lp = smp.sample(logits, temp, s.top_k, s.top_p, u, self.suppress_ids)
                at = step + s.shift
                out_tok[live, at] = tok
                out_lp[live, at] = lp
                hit_stop = (tok[:, None] == s.stop_ids).any(-1)  # [A]
                done = hit_stop | (at + 1 >= s.max_new)  # the row's turn ended
                self.stats.sampled_tokens += len(keep)
            spent = token_budget is not None and self.stats.sampled_tokens >= token_budget
            if keep and (spent or bool(done.any())):
                done_h, stop_h, at_h = done.tolist(), hit_stop.tolist(), at.tolist()
                for i, r in enumerate(keep):
                    if done_h[i]:
                        run.end_turn(r, at_h[i] + 1, stop_h[i], out_tok, out_lp)
                    elif spent:  # the token budget is spent: cut after the token just sampled
                        run.finish(r, at_h[i] + 1, "partial")
                keep = [r for i, r in enumerate(keep) if not done_h[i]]
            if spent:  # requests never admitted stay cut before their first token
                break
            back = run.collect(block=False)
            new = admit(cap - len(keep) - len(run.waiting) - len(back))
            # Wait for an observation only when nothing else can run.
            while not (keep or back or new) and run.waiting:
                back = run.collect(block=True)
                new = admit(cap - len(run.waiting) - len(back))
            if not (keep or back or new):
                assert not queue, "a request was never admitted"
                break
            if keep and new:
                self.stats.admitted_while_decoding += len(new)
            fresh = [r for i in new for r in range(first_row[i], first_row[i + 1])]
            if len(keep) < run.active or back or fresh:
                for r, feed, length in back:
                    obs = feed[1:]
                    out_tok[r, length : length + len(obs)] = torch.tensor(obs, device=dev)
                    state.shift[r], state.kshift[r] = run.resume(r, length, len(obs), step + 1)
                waiting = [r for r in run.rows if r in run.waiting]
                held = keep + [r for r, _, _ in back] + waiting
                # No held row has more than plen + step + shift filled slots.
                copy = min(total, plen + step + max((run.shift[r] for r in held), default=0))
                for r in fresh:  # the first token is sampled at the next step
                    run.shift[r] = -(step + 1)
                order = run.rearrange(keep, [r for r, _, _ in back], fresh, waiting)
                cache.reorder(order, copy)
                if keep:
                    tok = tok[torch.tensor(order[: len(keep)], dtype=torch.long, device=dev)]
                if fresh:
                    idx = torch.tensor(fresh, dtype=torch.long, device=dev)
                    state.shift[idx] = -(step + 1)
                    # A resumed row's stream goes on where it stopped (tokens sampled before).
                    state.kshift[idx] -= step + 1
                    lo = len(keep) + len(back)
                    new_logits, state.delta[idx] = self._prefill_prompts(
                        cache, lo, new, run, plen, prompt_lp
                    )
                live = torch.tensor(run.rows[: run.active], dtype=torch.long, device=dev)
                s = _RowState(**{k: v[live] for k, v in vars(state).items()})
            else:  # nothing changed place: every active row decodes this step
                run.keep_shift = run.active_shift
            parts = []
            if keep:
                parts.append(self._decode(cache, tok, s, len(keep), plen + step, run.keep_shift))
            if back:
                feeds = {r: (feed, plen + length - 1) for r, feed, length in back}
                k = len(keep)
                rows = [feeds[r] for r in run.rows[k : k + len(back)]]  # cache-row order
                parts.append(self._prefill_observations(cache, k, rows, s))
            if fresh:
                parts.append(new_logits)  # [n rows, V]
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]  # [A, V]
            self.stats.max_active_rows = max(self.stats.max_active_rows, run.active)
            step += 1
        self.stats.steps = step
        return self._completions(run, prompt_lp, out_tok, out_lp)

    def _prefill_prompts(
        self,
        cache: KVCache,
        first: int,
        reqs: list[int],
        run: _Trajectories,
        plen: int,
        prompt_lp: dict[int, list[float]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the prompts of requests ``reqs`` once each into cache rows ``first...``,
        left-padded so that every prompt ends at slot ``plen``, in chunks of at most
        ``max_prefill_tokens`` padded tokens, then copy each prompt's row into the rows of its
        ``n`` samples (request after request from row ``first`` on). Returns the next-token
        logits and decode position offsets of those rows ([N, V], [N]); the asked prompt
        log-probs go into ``prompt_lp``."""
        dev = self.device
        prompts = run.prompts
        tokens = pad_sequence(
            [torch.tensor(prompts[i]) for i in reqs],
            batch_first=True,
            padding_value=self.pad_token_id,
            padding_side="left",
        ).to(dev)  # [U, W]
        u, width = tokens.shape
        off = plen - width  # cache slot of the block's first column
        pad = width - torch.tensor([len(prompts[i]) for i in reqs], device=dev)  # [U] left padding
        col = torch.arange(width, device=dev)
        key_ok = col[None, :] >= pad[:, None]  # [U, W] False on left padding
        causal = col[:, None] >= col[None, :]  # [W, W]
        eye = torch.eye(width, dtype=torch.bool, device=dev)
        # Slots before the block hold another row's leftovers: never attended.
        before = torch.zeros(1, width, off, dtype=torch.bool, device=dev)
        last_hidden, deltas = [], []
        chunk = max(1, self.max_prefill_tokens // width)
        for r0 in range(0, u, chunk):
            r1 = min(u, r0 + chunk)
            # Padding queries attend to themselves only, so no softmax row is empty (NaN).
            mask = (causal[None] & key_ok[r0:r1, None, :]) | eye  # [C, W, W]
            mask = torch.cat([before.expand(r1 - r0, -1, -1), mask], -1)  # [C, W, plen]
            ids = tokens[r0:r1]
            pos = (col[None, :] - pad[r0:r1, None]).clamp(min=0)  # [C, W]
            delta = torch.zeros(r1 - r0, dtype=torch.long, device=dev)  # [C] decode offsets
            media = Media.cat([run.requests[i].media for i in reqs[r0:r1]])
            if self.rope is not None:
                # M-RoPE: the model's 3-D positions ([3, C, W]) of the left-padded rows and each
                # row's decode offset (its rope_deltas), from the images' and videos' grids (and
                # Qwen2.5-VL's second_per_grid_ts), those given.
                inputs = media.model_inputs() if media is not None else {}
                grids = {k: v.to(dev) for k, v in inputs.items() if k in _GRID_KEYS}
                mm = mm_token_types(self.model.config, ids)  # 1 image, 2 video tokens
                pos, delta = self.rope.get_rope_index(
                    ids, mm_token_type_ids=mm, attention_mask=key_ok[r0:r1].long(), **grids
                )
                delta = delta.reshape(-1).to(torch.long)
            deltas.append(delta)
            cache.at(slice(first + r0, first + r1), (off + col).expand(r1 - r0, -1), plen)
            hidden = self._forward(ids, pos, mask[:, None], cache, media)  # [C, W, H]
            last_hidden.append(hidden[:, -1])
            for r in range(r0, r1):
                i, p = reqs[r], run.params[reqs[r]]
                if p.prompt_logprobs:  # prompt token t + 1 is scored from position t
                    logits = self.lm_head(hidden[r - r0, int(pad[r]) : -1]).float()  # [L - 1, V]
                    targets = torch.tensor(prompts[i][1:], dtype=torch.long, device=dev)
                    lp = smp.token_logprobs(
                        logits, targets, p.temperature, max(p.top_k, 0), p.top_p
                    )
                    prompt_lp[i] = lp.tolist()
        src_rows = [k for k, i in enumerate(reqs) for _ in range(run.params[i].n)]
        cache.reorder([-1] * first + [first + k for k in src_rows], plen)
        src = torch.tensor(src_rows, device=dev)
        return self.lm_head(torch.cat(last_hidden)).float()[src], torch.cat(deltas)[src]

    def _decode(
        self, cache: KVCache, tok: torch.Tensor, s: _RowState, k: int, t: int, max_shift: int
    ) -> torch.Tensor:
        """Feed the sampled token of the first ``k`` cache rows (row ``r`` at slot
        ``t + shift[r]``); their next-token logits [k, V]."""
        write = t + s.shift[:k]  # [k]
        end = t + max_shift + 1
        slot = torch.arange(end, device=tok.device)
        cache.at(slice(0, k), write[:, None], end)
        pad = s.pad[:k]
        mask = (slot[None, :] >= pad[:, None]) & (slot[None, :] <= write[:, None])  # [k, end]
        pos = (write - pad + s.delta[:k])[:, None]  # [k, 1]
        if self.rope is not None:
            pos = pos[None].expand(3, -1, -1)  # [3, k, 1]: text tokens use one position
        hidden = self._forward(tok[:, None], pos, mask[:, None, None], cache)  # [k, 1, H]
        return self.lm_head(hidden[:, -1]).float()

    def _prefill_observations(
        self,
        cache: KVCache,
        first: int,
        feeds: list[tuple[list[int], int]],
        s: _RowState,
    ) -> torch.Tensor:
        """Feed rows back from an observation (cache rows ``first...``; ``s``: the active rows'
        state): row ``b`` feeds ``feeds[b] = (ids, slot)``, the turn's stop token then the
        observation, from that cache slot on. Their next-token logits.

        Only the new ids are computed, against the keys the row already holds: nothing is
        prefilled twice. Queries are right-padded; padding keeps no keys and attends like the
        row's last token, so no softmax row is empty.
        """
        dev = self.device
        q = max(len(x) for x, _ in feeds)
        chunk = max(1, self.max_prefill_tokens // q)
        logits = []
        for c0 in range(0, len(feeds), chunk):
            part = feeds[c0 : c0 + chunk]
            b = len(part)
            tokens = torch.full((b, q), self.pad_token_id, dtype=torch.long)
            for k, (x, _) in enumerate(part):
                tokens[k, : len(x)] = torch.tensor(x)
            n = torch.tensor([len(x) for x, _ in part])
            starts = [start for _, start in part]
            real = torch.arange(q)[None, :] < n[:, None]  # [b, q]
            last = torch.tensor(starts) + n - 1  # [b] slot of each row's last new token
            write = torch.tensor(starts)[:, None] + torch.arange(q)  # [b, q]
            query = torch.minimum(write, last[:, None]).to(dev)  # [b, q]
            end = int(last.max()) + 1
            slot = torch.arange(end, device=dev)
            rows = slice(first + c0, first + c0 + b)
            p, d = s.pad[rows], s.delta[rows]
            mask = (slot >= p[:, None, None]) & (slot <= query[:, :, None])  # [b, q, end]
            pos = query - p[:, None] + d[:, None]  # [b, q]
            if self.rope is not None:
                pos = pos[None].expand(3, -1, -1)  # [3, b, q]
            cache.at(rows, write.to(dev), end, real)
            hidden = self._forward(tokens.to(dev), pos, mask[:, None], cache)  # [b, q, H]
            logits.append(self.lm_head(hidden[torch.arange(b), (n - 1).to(dev)]).float())
        return torch.cat(logits)

    def _row_state(self, run: _Trajectories, plen: int) -> _RowState:
        """Per-trajectory state, one row per sample of every request, in (request, sample)
        order (a resumed request's one row is its ``Resume.sample_index``: its random
        stream); every prompt ends at slot ``plen``."""
        req = run.request
        per_row = [run.params[i] for i in req]
        # A row's stop ids: its own, and the end-of-sequence ids unless it ignores them.
        stops = [
            torch.tensor(
                [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)],
                dtype=torch.long,
            )
            for p in per_row
        ]
        stop_ids = pad_sequence(stops, batch_first=True, padding_value=-1)  # [R, S]
        dev = self.device

        def vec(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        request_seed = vec([run.seeds[i] for i in req], torch.long)
        # FIRE: each row's first-token temperature (its temperature when not set).
        fire = [
            p.temperature if p.first_token_temperature is None else p.first_token_temperature
            for p in per_row
        ]
        return _RowState(
            seed=smp.row_seeds(request_seed, vec(run.sample, torch.long)),
            temperature=vec([p.temperature for p in per_row]),
            first_temperature=vec(fire),
            top_k=vec([max(p.top_k, 0) for p in per_row], torch.long),
            top_p=vec([p.top_p for p in per_row]),
            # Positions left after each row's own prompt bound its response length.
            max_new=vec(run.budget, torch.long),
            stop_ids=stop_ids.to(dev),
            pad=vec([plen - len(run.prompts[i]) for i in req], torch.long),
            delta=vec([0] * len(req), torch.long),
            shift=vec([0] * len(req), torch.long),
            kshift=vec([run.prior[i] for i in req], torch.long),
        )

    def _completions(
        self,
        run: _Trajectories,
        prompt_lp: dict[int, list[float]],
        out_tok: torch.Tensor,
        out_lp: torch.Tensor,
    ) -> list[Completion]:
        """One completion per row, in row order: (request, sample). A resumed row's response
        starts with its ``Resume`` tokens and log-probs."""
        toks, lps = out_tok.tolist(), out_lp.tolist()
        multi = run.continuation is not None
        result = []
        for r, (i, n) in enumerate(zip(run.request, run.length, strict=True)):
            res = run.requests[i].resume
            ids, lp = toks[r][:n], lps[r][:n]
            if res is not None:
                ids, lp = list(res.token_ids) + ids, list(res.logprobs) + lp
            text = None
            if run.params[i].detokenize and self.tokenizer is not None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            result.append(
                Completion(
                    request_index=i,
                    sample_index=run.sample[r],
                    # The prompt as the engine kept it (its end, when truncated).
                    prompt_token_ids=run.prompts[i][: len(run.prompts[i]) - run.prior[i]],
                    token_ids=ids,
                    logprobs=lp,
                    finish_reason=run.reason[r],
                    text=text,
                    prompt_logprobs=prompt_lp.get(i),
                    sampled_mask=sampled_mask(run.spans[r], n) if multi else None,
                    turn_spans=run.spans[r] if multi else None,
                )
            )
        return result


class _Trajectories:
    """A call's requests as the engine runs them (their params, the ids it prefills, the
    tokens a resumed request sampled before, how many it may still sample, their seeds) and the
    host-side bookkeeping of their trajectories: turn spans, where each ended and why, the
    continuations running on the pool, and which trajectory each cache row holds.

    The cache rows (``rows``) hold the active rows first (those decoding on, those back from an
    observation, then those admitted this step), then the rows waiting on their continuation;
    the cache rows past those are free. ``shift`` is the host copy of each trajectory's
    ``_RowState.shift``; its maxima bound the cache slots a step reads (``keep_shift``: the rows
    decoded this step).
    """

    def __init__(
        self,
        requests: list[Request],
        params: list[SamplingParams],
        prompts: list[list[int]],
        prior: list[int],
        room: list[int],
        seeds: list[int],
        continuation: Continuation | None,
        pool: ThreadPoolExecutor | None,
        check: Callable[[object, Turn], list[int] | None],
    ) -> None:
        # Each row's request and sample index, in (request, sample) order: ``n`` rows a
        # request, and a resumed request's one row keeps its ``Resume.sample_index``.
        self.request: list[int] = []
        self.sample: list[int] = []
        for i, (p, r) in enumerate(zip(params, requests, strict=True)):
            self.request += [i] * p.n
            self.sample += list(range(p.n)) if r.resume is None else [r.resume.sample_index]
        self.requests, self.params, self.prompts, self.prior = requests, params, prompts, prior
        self.seeds = seeds
        self.max_turns = [params[i].max_turns for i in self.request]
        # Each row's response budget (assistant + observation tokens) in this call.
        self.budget = [room[i] for i in self.request]
        self.continuation, self.pool, self.check = continuation, pool, check
        rows = len(self.request)
        self.spans: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
        self.start = [0] * rows  # response index where the row's current turn began
        self.observed = [0] * rows  # observation tokens in the row's response
        self.length = [0] * rows  # response length once finished
        # "partial" until the row finishes: what a token budget cuts before admission stays so.
        self.reason: list[FinishReason] = ["partial"] * rows
        self.waiting: dict[int, tuple[Future, Turn]] = {}
        self.rows: list[int] = []  # the trajectory in each cache row
        self.active = 0
        self.shift = [0] * rows
        self.keep_shift = self.active_shift = 0

    def end_turn(
        self, r: int, length: int, stop: bool, out_tok: torch.Tensor, out_lp: torch.Tensor
    ) -> None:
        """Row ``r``'s turn ended with ``length`` response tokens: finish it, or hand the turn
        to the continuation when it stopped and turns remain."""
        self.spans[r].append((self.start[r], length))
        turns_left = self.max_turns[r] is None or len(self.spans[r]) < self.max_turns[r]
        if not (stop and self.continuation is not None and turns_left):
            self.finish(r, length, "stop" if stop else "length")
            return
        ids = out_tok[r, :length].tolist()
        turn = Turn(
            request_index=self.request[r],
            sample_index=self.sample[r],
            turn_index=len(self.spans[r]) - 1,
            token_ids=ids[self.start[r] :],
            logprobs=out_lp[r, self.start[r] : length].tolist(),
            response_token_ids=ids,
            # An observation must leave room to sample one more token.
            max_observation_tokens=self.budget[r] - length - 1,
        )
        self.waiting[r] = (self.pool.submit(self.continuation, turn), turn)

    def finish(self, r: int, length: int, reason: FinishReason) -> None:
        self.length[r], self.reason[r] = length, reason

    def collect(self, block: bool) -> list[tuple[int, list[int], int]]:
        """Rows whose observation is ready and fits, as ``(row, ids to feed, response
        length)``; the ids to feed are the turn's stop token (sampled, not yet fed) and the
        observation. Rows whose continuation said None, or whose observation does not fit,
        finish. ``block``: wait until at least one continuation returns."""
        if block and self.waiting:
            wait([f for f, _ in self.waiting.values()], return_when=FIRST_COMPLETED)
        ready = []
        for r in sorted(r for r, (f, _) in self.waiting.items() if f.done()):
            future, turn = self.waiting.pop(r)
            obs = self.check(future.result(), turn)
            length = len(turn.response_token_ids)
            if obs is None or len(obs) > turn.max_observation_tokens:
                self.finish(r, length, "stop" if obs is None else "length")
            else:
                ready.append((r, [turn.token_ids[-1], *obs], length))
        return ready

    def resume(self, r: int, length: int, observed: int, next_step: int) -> tuple[int, int]:
        """Row ``r`` (``length`` response tokens) goes on after ``observed`` observation tokens;
        its ``(shift, kshift)`` from the decoding step ``next_step`` on."""
        sampled = length - self.observed[r]
        self.observed[r] += observed
        self.start[r] = length + observed
        self.shift[r] = self.start[r] - next_step
        return self.shift[r], sampled - next_step

    def rearrange(
        self, keep: list[int], back: list[int], new: list[int], waiting: list[int]
    ) -> list[int]:
        """Lay the rows out anew, one group after the other; returns the old cache row of each
        new one, -1 for the rows of ``new`` (nothing to copy: prefilled next).

        A row already inside its group's range stays put; the others fill the holes in the order
        of their old slots, so a step copies only as many rows as change place.
        """
        old = {row: i for i, row in enumerate(self.rows)}
        order: list[int] = []
        for group in (keep, back, new, waiting):
            lo, hi = len(order), len(order) + len(group)
            held = [old[r] for r in group if r in old]
            stay = {i for i in held if lo <= i < hi}
            movers = iter(sorted(i for i in held if not lo <= i < hi))
            order += [i if i in stay else next(movers, -1) for i in range(lo, hi)]
        fresh = iter(new)  # only the new rows have no old cache row
        self.rows = [self.rows[j] if j >= 0 else next(fresh) for j in order]
        self.active = len(keep) + len(back) + len(new)
        self.keep_shift = max((self.shift[r] for r in keep), default=0)
        self.active_shift = max((self.shift[r] for r in self.rows[: self.active]), default=0)
        return order
