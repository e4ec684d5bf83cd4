"""The native rollout engine: batched sampling in pure torch over the Hugging Face model class.

The engine keeps its own inference copy of the weights and drives the HF decoder stack one step
at a time with a preallocated KV cache:

* prompts are left-padded and prefilled once per request; the ``n`` samples of a request then
  share that prompt's keys and values (copied into ``n`` cache rows), so a GRPO group costs one
  prefill instead of ``n``;
* every step feeds one token per live row; rows that stop are compacted away in batches, so
  finished sequences stop costing compute;
* sampling, stop tokens and per-row seeds are handled in :mod:`lightrft.engine.sampling`.

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
import difflib
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lightrft.data.media import Media
from lightrft.engine import sampling as smp
from lightrft.engine.protocol import (
    Completion,
    Request,
    SamplingParams,
    check_awake,
    check_requests,
    check_sleep_level,
    check_wake_tags,
    per_request_params,
)

TEXT_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
AUDIO_MODEL_TYPES = ("qwen2_audio",)
SUPPORTED_MODEL_TYPES = TEXT_MODEL_TYPES + VISION_MODEL_TYPES + AUDIO_MODEL_TYPES


class KVCache:
    """Per-layer key/value buffers ``[rows, kv_heads, max_len, head_dim]`` for one decoding wave.

    It implements only ``update``, the one method HF attention layers call on
    ``past_key_values``: the layer's new keys and values are written at ``self.pos`` for rows
    ``self.rows`` and the filled prefix is returned. The engine owns the write position.
    """

    def __init__(self, storage: torch.Tensor, layers: int, rows: int, max_len: int) -> None:
        # storage: [layers, 2, rows, kv_heads, max_len, head_dim], a view into the engine's pool.
        assert storage.shape[0] == layers and storage.shape[2] >= rows
        self.kv = storage
        self.max_len = max_len
        self.rows = slice(0, rows)
        self.pos = 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key, value: [B, kv_heads, q, head_dim]
        q = key.shape[2]
        end = self.pos + q
        assert end <= self.max_len, "KV cache overflow"
        buf = self.kv[layer_idx]
        buf[0, self.rows, :, self.pos : end] = key
        buf[1, self.rows, :, self.pos : end] = value
        return buf[0, self.rows, :, :end], buf[1, self.rows, :, :end]

    def expand(self, src_rows: torch.Tensor, length: int) -> None:
        """Rows ``0..len(src_rows)-1`` become copies of rows ``src_rows`` (first ``length`` slots)."""
        n = src_rows.numel()
        self.kv[:, :, :n, :, :length] = self.kv[:, :, src_rows, :, :length]

    def compact(self, alive: torch.Tensor, length: int) -> torch.Tensor:
        """Drop dead rows by moving live rows from the tail into the holes; returns the order.

        ``alive``: [A] bool over the current rows. Only as many rows as there are holes are
        copied (first ``length`` slots), not the whole cache. The result ``src`` ([n_alive])
        says which old row each new row holds.
        """
        n = int(alive.sum())
        holes = (~alive[:n]).nonzero().squeeze(-1)
        movers = alive[n:].nonzero().squeeze(-1) + n
        assert holes.numel() == movers.numel()
        if holes.numel():
            self.kv[:, :, holes, :, :length] = self.kv[:, :, movers, :, :length]
        src = torch.arange(alive.numel(), device=alive.device)
        src[holes] = movers
        self.rows = slice(0, n)
        return src[:n]


@dataclass
class _Wave:
    """Per-row state of one decoding wave (all tensors [R] unless noted)."""

    request: torch.Tensor  # index into the caller's request list
    sample: torch.Tensor  # sample index within the request
    seed: torch.Tensor
    temperature: torch.Tensor
    first_temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    max_new: torch.Tensor
    stop_ids: torch.Tensor  # [R, S], padded with -1


class NativeEngine:
    """A colocated rollout engine over an HF causal LM (see the module docstring).

    ``model``: an HF directory (loaded with :func:`lightrft.models.load_causal_lm`) or an
    unsharded HF ``nn.Module``, which is copied. ``tokenizer``: defaults to the directory's; gives
    the end-of-sequence ids and detokenised text. ``dtype``: weights and KV cache (default bf16 on
    CUDA, fp32 on CPU). ``max_model_len``: prompt plus response tokens (default: the model's
    ``max_position_embeddings``). ``max_num_seqs``: rows decoded together (a request's ``n``
    samples always go in the same wave). ``max_prefill_tokens``: padded prompt tokens per prefill
    forward. ``max_kv_tokens``: KV-cache token slots per wave (rows x padded length); bounds the
    cache's memory (bytes = slots x layers x 2 x kv_heads x head_dim x dtype size). ``truncate_prompts``: keep the last tokens of a too-long prompt instead of raising.
    ``seed``: the stream from which requests without a seed draw theirs. ``compile``: compile each
    decoder block's MLP with ``torch.compile(dynamic=True)`` (meant for GPUs).
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
        from lightrft.data import modality
        from lightrft.kernels.hf import mrope_model
        from lightrft.models.loading import load_causal_lm, load_tokenizer, to_dtype
        from lightrft.models.multimodal import load_vision_model
        from lightrft.models.parallel import decoder_layers, default_param_dtype

        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if max_kv_tokens is not None and max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1 or None, got {max_kv_tokens}")
        if isinstance(model, nn.Module):
            src_device = next(model.parameters()).device
            self.device = torch.device(device) if device is not None else src_device
        else:
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = to_dtype(dtype) if dtype is not None else default_param_dtype(self.device)

        if isinstance(model, nn.Module):
            _check_supported(model.config)
            _check_unsharded(model)
            self.model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        else:
            from transformers import AutoConfig

            load = (
                load_vision_model
                if modality.is_multimodal(AutoConfig.from_pretrained(model))
                else load_causal_lm
            )
            self.model = load(
                model, dtype=self.dtype, device=self.device, attn_implementation="sdpa"
            )
            if tokenizer is None:
                tokenizer = load_tokenizer(model)
        self.tokenizer = tokenizer
        self.model.eval().requires_grad_(False)
        config = self.model.config
        _check_supported(config)
        if getattr(config, "_attn_implementation", None) != "sdpa":
            # Our prepared boolean masks are what the SDPA attention path consumes as-is.
            self.model.set_attn_implementation("sdpa")
        self.base = getattr(self.model, self.model.base_model_prefix)
        # transformers >= 5.2x names the KV cache argument `cache` (`past_key_values` warns).
        params = inspect.signature(self.base.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.lm_head = self.model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.is_vision = modality.is_vision_language(config)
        self.is_audio = modality.is_audio_language(config)
        # Media kinds the model takes, with their placeholder token ids.
        self.media_token_ids: dict[str, int] = {}
        if self.is_vision:
            self.media_token_ids["image"] = modality.image_token_id(config)
        if self.is_audio:
            self.media_token_ids["audio"] = modality.audio_token_id(config)
        # Vision-language models: the image token, the M-RoPE position maker (Qwen-VL). Both:
        # the tokens only the processor may place, never the sampler.
        self.image_token_id = self.media_token_ids.get("image")
        self.rope = mrope_model(self.model) if self.is_vision else None
        self.suppress_ids = (
            torch.tensor(modality.media_token_ids(config), dtype=torch.long, device=self.device)
            if self.media_token_ids
            else None
        )
        config = config.get_text_config()
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (prompt + 1 token), got {max_model_len}")
        window = getattr(config, "sliding_window", None)
        sliding = getattr(config, "use_sliding_window", config.model_type == "mistral")
        sliding = bool(sliding)
        if sliding and window is not None and self.max_model_len > window:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's sliding_window={window}; "
                "the native engine only does full attention: pass max_model_len <= sliding_window"
            )
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_kv_tokens = max_kv_tokens
        self.truncate_prompts = truncate_prompts
        self.eos_token_ids = _eos_ids(self.model, tokenizer)
        self.pad_token_id = _pad_id(self.model, tokenizer, self.eos_token_ids)
        self._seed_rng = torch.Generator().manual_seed(seed)
        if compile:
            # Only the MLPs: pure tensor code with a dynamic row count. Compiling whole blocks
            # would trace into the KV cache, whose layer index and write position are Python
            # ints that force a recompile per layer and per step.
            for layer in decoder_layers(self.model):
                layer.mlp.compile(dynamic=True)

        # Every name a checkpoint may use (tied weights appear under both names) -> parameter.
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._canonical = {id(p): n for n, p in reversed(list(self._params.items()))}
        self._shapes = {n: p.shape for n, p in self._params.items()}
        self._kv_pool: torch.Tensor | None = None
        self._kv_awake = True
        self._weights_awake = True
        self._weights_version = 0  # bumped whenever the weights' storage is replaced
        self._unloaded: set[str] = set()  # canonical names not loaded since a level-2 sleep
        # Per request, during generate(): its media (None without).
        self._media: list[Media | None] = []

    # ---------------------------------------------------------------- sleep / wake / weights
    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache; level 2 also frees the weights (reload all of them)."""
        check_sleep_level(level)
        self._kv_pool = None
        self._kv_awake = False
        if level == 2 and self._weights_awake:
            for p in self._unique_params():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._weights_awake = False
            self._weights_version += 1

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``["weights"]`` (contents undefined until loaded) and/or ``["kv_cache"]``."""
        tags = check_wake_tags(tags)
        if "weights" in tags and not self._weights_awake:
            for name, p in self._canonical_items():
                p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=p.device)
            self._unloaded = {name for name, _ in self._canonical_items()}
            self._weights_awake = True
            self._weights_version += 1
        if "kv_cache" in tags:
            self._kv_awake = True

    @property
    def is_sleeping(self) -> bool:
        return not (self._kv_awake and self._weights_awake)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, full_tensor)`` pairs into the engine (cast to its dtype and device).

        Every name and shape is checked before anything is copied, so a bad batch changes
        nothing.
        """
        if not self._weights_awake:
            raise ValueError(
                "the engine's weights are released (sleep level 2); call "
                "wake_up(['weights']) before load_weights"
            )
        params, tensors = [], []
        for name, tensor in weights:
            param = self._params.get(name)
            if param is None:
                close = difflib.get_close_matches(name, list(self._params), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"load_weights: unknown parameter name {name!r}{hint}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the engine "
                    f"expects {tuple(param.shape)}"
                )
            params.append(param)
            tensors.append(tensor.to(param.device))
        if params:
            torch._foreach_copy_(params, tensors)  # one batched copy, casting to our dtype
        for param in params:
            self._unloaded.discard(self._canonical[id(param)])

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
        if not self._weights_awake:
            raise ValueError(
                "the engine's weights are released (sleep level 2); call "
                "wake_up(['weights']) before weight_buffers"
            )
        out = []
        for name in names:
            param = self._params.get(name)
            if param is None:
                close = difflib.get_close_matches(name, list(self._params), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"weight_buffers: unknown parameter name {name!r}{hint}")
            out.append(param.data)
            self._unloaded.discard(self._canonical[id(param)])
        return out

    def reset_prefix_cache(self) -> bool:
        """Nothing to drop: prompt KV states are shared only within one ``generate`` call."""
        return True

    def _unique_params(self) -> list[nn.Parameter]:
        return [p for _, p in self._canonical_items()]

    def _canonical_items(self) -> list[tuple[str, nn.Parameter]]:
        return [
            (self._canonical[id(p)], p) for p in {id(p): p for p in self._params.values()}.values()
        ]

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[Request],
        sampling: SamplingParams | Sequence[SamplingParams],
    ) -> list[Completion]:
        """Sample ``n`` completions per request; returned ordered by (request, sample)."""
        tags = (("weights", self._weights_awake), ("kv_cache", self._kv_awake))
        check_awake([tag for tag, awake in tags if not awake], self._unloaded)
        requests = list(requests)
        params = per_request_params(sampling, len(requests))
        check_requests(requests, self.vocab_size)
        self._media = [self._request_media(i, r) for i, r in enumerate(requests)]
        prompts = [
            self._fit_prompt(i, r.prompt_token_ids, p)
            for i, (r, p) in enumerate(zip(requests, params, strict=True))
        ]
        seeds = [
            p.seed
            if p.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            for p in params
        ]
        out: dict[tuple[int, int], Completion] = {}
        try:
            for wave in self._waves(prompts, params):
                out.update(self._generate_wave(wave, prompts, params, seeds))
        finally:
            self._media = []
        return [out[(i, j)] for i, p in enumerate(params) for j in range(p.n)]

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
            takes = " and ".join("images" if k == "image" else k for k in self.media_token_ids)
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

    def _fit_prompt(self, index: int, ids: list[int], p: SamplingParams) -> list[int]:
        limit = self.max_model_len - 1  # at least one token must fit after the prompt
        if len(ids) <= limit:
            return list(ids)
        if not self.truncate_prompts or self._media[index] is not None:
            raise ValueError(
                f"requests[{index}] has {len(ids)} prompt tokens; the engine's max_model_len is "
                f"{self.max_model_len} (room for at most {limit} prompt tokens). Shorten it, raise "
                "max_model_len, or build the engine with truncate_prompts=True (in a recipe, "
                "the prompt dataset checks lengths at load: its max_prompt_length and "
                "truncation options)"
            )
        keep = max(1, self.max_model_len - p.max_tokens)
        return list(ids[-keep:])

    def _waves(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Group request indices (sorted by prompt length) into waves.

        A wave holds at most ``max_num_seqs`` rows and, when ``max_kv_tokens`` is set, a KV
        cache of at most that many token slots (rows x (longest prompt + longest response)).
        A single request that exceeds either bound still gets a wave of its own.
        """
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        budget = self.max_kv_tokens or float("inf")
        waves, cur = [], []
        rows = plen = new = 0
        for i in order:
            n, p_len = params[i].n, len(prompts[i])
            new_i = min(params[i].max_tokens, self.max_model_len - p_len)
            grown = (rows + n) * (max(plen, p_len) + max(new, new_i))
            if cur and (rows + n > self.max_num_seqs or grown > budget):
                waves.append(cur)
                cur, rows, plen, new = [], 0, 0, 0
            cur.append(i)
            rows, plen, new = rows + n, max(plen, p_len), max(new, new_i)
        if cur:
            waves.append(cur)
        return waves

    def _kv_storage(self, rows: int, length: int) -> torch.Tensor:
        """A [layers, 2, rows, kv_heads, length, head_dim] view of the reusable pool."""
        shape = (self.num_layers, 2, rows, self.kv_heads, length, self.head_dim)
        numel = 1
        for s in shape:
            numel *= s
        if self._kv_pool is None or self._kv_pool.numel() < numel:
            self._kv_pool = None  # free the old pool before allocating the larger one
            self._kv_pool = torch.empty(numel, dtype=self.dtype, device=self.device)
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

    def _prefill_positions(
        self, tokens: torch.Tensor, pos: torch.Tensor, real: torch.Tensor, media: Media | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill positions and the per-row decode offset (``rope_deltas``, [C]).

        Text models: ``pos`` ([C, P]) and zeros. M-RoPE models: the model's 3-D positions
        ([3, C, P]) of the left-padded rows (``real``: [C, P] bool, False on padding).
        """
        zero = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        if self.rope is None:
            return pos, zero
        mm = (tokens == self.image_token_id).int()  # [C, P]
        images = media.image if media is not None else None
        grid = None if images is None else images.image_grid_thw.to(tokens.device)
        pos3, deltas = self.rope.get_rope_index(
            tokens, mm_token_type_ids=mm, image_grid_thw=grid, attention_mask=real.long()
        )
        return pos3, deltas.reshape(-1).to(torch.long)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _generate_wave(
        self,
        wave: list[int],
        prompts: list[list[int]],
        params: list[SamplingParams],
        seeds: list[int],
    ) -> dict[tuple[int, int], Completion]:
        dev = self.device
        lens = torch.tensor([len(prompts[i]) for i in wave])
        plen = int(lens.max())
        u = len(wave)
        tokens = torch.full((u, plen), self.pad_token_id, dtype=torch.long)
        for r, i in enumerate(wave):
            tokens[r, plen - len(prompts[i]) :] = torch.tensor(prompts[i])
        tokens = tokens.to(dev)
        pad = (plen - lens).to(dev)  # [U] left padding per prompt
        state = self._wave_state(wave, prompts, params, seeds)
        rows = state.request.numel()
        max_new = int(state.max_new.max())
        total = plen + max_new
        cache = KVCache(self._kv_storage(rows, total), self.num_layers, rows, total)
        slot = torch.arange(total, device=dev)
        key_ok = slot[None, :] >= pad[:, None]  # [U, T] False on left padding

        # Prefill each prompt once, in chunks of at most max_prefill_tokens padded tokens.
        last_hidden = []
        prompt_lp: dict[int, list[float]] = {}
        chunk = max(1, self.max_prefill_tokens // plen)
        causal = slot[:plen, None] >= slot[None, :plen]  # [P, P]
        eye = torch.eye(plen, dtype=torch.bool, device=dev)
        deltas = []
        for r0 in range(0, u, chunk):
            r1 = min(u, r0 + chunk)
            # Padding queries attend to themselves only, so no softmax row is empty (NaN).
            mask = (causal[None] & key_ok[r0:r1, None, :plen]) | eye  # [C, P, P]
            pos = (slot[None, :plen] - pad[r0:r1, None]).clamp(min=0)  # [C, P]
            media = Media.cat([self._media[i] for i in wave[r0:r1]])
            pos, delta = self._prefill_positions(
                tokens[r0:r1], pos, key_ok[r0:r1, :plen], media
            )  # [C, P] or [3, C, P]; [C]
            deltas.append(delta)
            cache.rows, cache.pos = slice(r0, r1), 0
            hidden = self._forward(tokens[r0:r1], pos, mask[:, None], cache, media)  # [C, P, H]
            last_hidden.append(hidden[:, -1])
            for r in range(r0, r1):
                i = wave[r]
                if params[i].prompt_logprobs:
                    prompt_lp[i] = self._prompt_logprobs(
                        hidden[r - r0, int(pad[r]) :], prompts[i], params[i]
                    )
        logits_u = self._logits(torch.cat(last_hidden))  # [U, V]

        # The n samples of a prompt start from copies of its prefilled rows.
        src = torch.repeat_interleave(
            torch.arange(u, device=dev), torch.tensor([params[i].n for i in wave], device=dev)
        )
        cache.expand(src, plen)
        cache.rows, cache.pos = slice(0, rows), plen
        logits = logits_u[src]  # [R, V]
        key_ok = key_ok[src]  # [R, T]
        row_pad = pad[src]  # [R]
        # Decode position = tokens so far + rope delta (0 without M-RoPE).
        row_delta = torch.cat(deltas)[src]  # [R]

        out_tok = torch.full((rows, max_new), -1, dtype=torch.long, device=dev)
        out_lp = torch.zeros((rows, max_new), dtype=torch.float32, device=dev)
        out_len = torch.zeros(rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
        live = torch.arange(rows, device=dev)  # original row held by each cache row
        s = state
        for step in range(max_new):
            temp = s.first_temperature if step == 0 else s.temperature
            tok, lp = smp.sample(
                logits, temp, s.top_k, s.top_p, smp.uniforms(s.seed, step), self.suppress_ids
            )
            out_tok[live, step] = tok
            out_lp[live, step] = lp
            hit_stop = (tok[:, None] == s.stop_ids).any(-1)  # [A]
            done = hit_stop | (step + 1 >= s.max_new)
            if bool(done.any()):
                out_len[live[done]] = step + 1
                stopped[live[done & hit_stop]] = True
                if bool(done.all()):
                    break
                # Finished rows leave the batch at once: they cost no further compute.
                keep = cache.compact(~done, plen + step)
                live, tok, key_ok, row_pad = live[keep], tok[keep], key_ok[keep], row_pad[keep]
                row_delta = row_delta[keep]
                s = _select(s, keep)
            t = plen + step  # cache slot of the token being fed
            mask = key_ok[:, None, None, : t + 1]  # [A, 1, 1, t+1]
            pos = (t - row_pad + row_delta)[:, None]  # [A, 1]
            if self.rope is not None:
                pos = pos[None].expand(3, -1, -1)  # [3, A, 1]: text tokens use one position
            hidden = self._forward(tok[:, None], pos, mask, cache)  # [A, 1, H]
            cache.pos = t + 1
            logits = self._logits(hidden[:, -1])  # [A, V]

        return self._completions(
            state, wave, prompts, params, prompt_lp, out_tok, out_lp, out_len, stopped
        )

    def _wave_state(
        self,
        wave: list[int],
        prompts: list[list[int]],
        params: list[SamplingParams],
        seeds: list[int],
    ) -> _Wave:
        req, smp_idx = [], []
        for i in wave:
            req += [i] * params[i].n
            smp_idx += list(range(params[i].n))
        per_row = [params[i] for i in req]
        stops = [self._stop_ids(p) for p in per_row]
        width = max(1, max(len(x) for x in stops))
        stop_ids = torch.full((len(req), width), -1, dtype=torch.long)
        for r, x in enumerate(stops):
            stop_ids[r, : len(x)] = torch.tensor(x, dtype=torch.long)
        dev = self.device

        def vec(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        request_seed = vec([seeds[i] for i in req], torch.long)
        return _Wave(
            request=vec(req, torch.long),
            sample=vec(smp_idx, torch.long),
            seed=smp.row_seeds(request_seed, vec(smp_idx, torch.long)),
            temperature=vec([p.temperature for p in per_row]),
            first_temperature=vec(
                [
                    p.temperature
                    if p.first_token_temperature is None
                    else p.first_token_temperature
                    for p in per_row
                ]
            ),
            top_k=vec([max(p.top_k, 0) for p in per_row], torch.long),
            top_p=vec([p.top_p for p in per_row]),
            # Positions left after each row's own prompt bound its response length.
            max_new=vec(
                [min(params[i].max_tokens, self.max_model_len - len(prompts[i])) for i in req],
                torch.long,
            ),
            stop_ids=stop_ids.to(dev),
        )

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt: list[int], p: SamplingParams
    ) -> list[float]:
        # hidden: [L, H] for the prompt's own tokens; token t+1 is scored from position t.
        if len(prompt) < 2:
            return []
        logits = self._logits(hidden[:-1])  # [L-1, V]
        targets = torch.tensor(prompt[1:], device=logits.device)
        lp = smp.token_logprobs(logits, targets, p.temperature, max(p.top_k, 0), p.top_p)
        return lp.tolist()

    def _completions(
        self,
        state: _Wave,
        wave: list[int],
        prompts: list[list[int]],
        params: list[SamplingParams],
        prompt_lp: dict[int, list[float]],
        out_tok: torch.Tensor,
        out_lp: torch.Tensor,
        out_len: torch.Tensor,
        stopped: torch.Tensor,
    ) -> dict[tuple[int, int], Completion]:
        toks, lps = out_tok.tolist(), out_lp.tolist()
        lens, stop = out_len.tolist(), stopped.tolist()
        req, smp_idx = state.request.tolist(), state.sample.tolist()
        result = {}
        for r in range(len(req)):
            i, n = req[r], lens[r]
            ids = toks[r][:n]
            text = None
            if params[i].detokenize and self.tokenizer is not None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            result[(i, smp_idx[r])] = Completion(
                request_index=i,
                sample_index=smp_idx[r],
                prompt_token_ids=prompts[i],
                token_ids=ids,
                logprobs=lps[r][:n],
                finish_reason="stop" if stop[r] else "length",
                text=text,
                prompt_logprobs=prompt_lp.get(i),
            )
        return result


def _select(s: _Wave, keep: torch.Tensor) -> _Wave:
    return _Wave(**{k: v[keep] for k, v in vars(s).items()})


def _check_unsharded(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(
                f"NativeEngine needs an unsharded model, but parameter {name!r} is a DTensor; "
                "build the engine from the HF directory and call sync_weights(model, engine)"
            )


def _check_supported(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"NativeEngine supports model types {SUPPORTED_MODEL_TYPES}, got "
            f"{config.model_type!r}; use VLLMEngine for other architectures"
        )


def _eos_ids(model: nn.Module, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if src is not None:
            ids += [src] if isinstance(src, int) else list(src)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def _pad_id(model: nn.Module, tokenizer, eos: list[int]) -> int:
    for src in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(model.config, "pad_token_id", None),
        eos[0] if eos else None,
    ):
        if src is not None:
            return int(src)
    return 0
