"""Per-token log-probs of a Hugging Face causal LM through the fused kernel, without logits.

The model's own forward runs (so FSDP2's hooks all-gather the root-managed parameters: the
embeddings, the final norm and the LM head), with three forward hooks:

1. on the decoder trunk (``model.get_decoder()``, e.g. ``model.model``) to capture the final,
   normalised hidden states ``[B, T, H]``;
2. on the LM head, registered *first* so that it runs while FSDP2 still holds the head's weight
   unsharded (in the root's group for the whole forward; in a frozen model's own head group only
   during the head's forward). It computes the log-probs with ``lm_head.weight``;
3. on the root module, registered first too, which returns them as the module's output, so
   FSDP2 registers its pre-backward hook on them and all-gathers the root's weights (the trained
   head among them) again before the kernel's backward.

``logits_to_keep=1`` makes the model's own LM head project a single position (a ``[B, 1, V]``
product that is dropped) instead of all ``T``. Tied embeddings need nothing special: the LM head
weight *is* the embedding matrix, and its gradient accumulates into the one parameter.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightrft.kernels.logprobs import Backend, GradHint, fused_linear_logprobs, select_backend
from lightrft.kernels.losses import fused_linear_cross_entropy


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT wrapper (possibly FSDP2-sharded: the class changes, the
    ``peft_config`` attribute stays); :mod:`lightrft.models.lora` owns the other LoRA rules."""
    return isinstance(getattr(model, "peft_config", None), dict)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The HF model a PEFT wrapper wraps (``get_base_model()``), else ``model`` itself."""
    return model.get_base_model() if is_peft_model(model) else model


def _check_ids(input_ids: Tensor, targets: Tensor | None) -> Tensor:
    """Validate ``input_ids`` [B, T] and return the next-token targets [B, T-1]."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    if targets is None:
        return input_ids[:, 1:]
    if targets.shape != (b, t - 1):
        raise ValueError(
            f"targets must be [B, T-1] = [{b}, {t - 1}] (the next token of each position), "
            f"got {tuple(targets.shape)}"
        )
    return targets


def forward_on_hidden(
    model: nn.Module,
    input_ids: Tensor,
    fn: Callable[[Tensor, Tensor, Tensor | None], Any],
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    media: Any = None,
    keep_last: bool = False,
    trunk_inputs: Callable | None = None,
    **model_kwargs,
) -> Any:
    """Run ``model``'s forward and return ``fn(hidden [B, T-1, H], lm_head.weight, lm_head.bias)``
    computed inside it, where FSDP2 holds the LM head unsharded (see the module docstring).

    ``hidden[:, i]`` is the final hidden state that predicts token ``i + 1``. ``fn``'s result
    replaces the model's output, so it must be a tensor or a tuple of tensors. ``keep_last``:
    ``hidden`` is ``[B, T, H]`` (a sequence-parallel slice, whose targets are already shifted).
    ``trunk_inputs``: a forward pre-hook (with kwargs) on the decoder trunk, which may rewrite
    its inputs (a sequence-parallel slice of a multimodal row's merged embeddings).

    ``media``: for a vision- or audio-language model, the batch's
    :class:`~lightrft.data.media.Media` (its images and audio in the order their placeholder
    runs appear in ``input_ids``, row by row); see :func:`media_forward_kwargs` for the
    positions it implies.
    """
    from torch.distributed.fsdp import FSDPModule

    trunk = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if trunk is None or trunk is model or head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{type(model).__name__} is not a Hugging Face causal LM with a decoder trunk "
            "(get_decoder()) and a linear LM head (get_output_embeddings())"
        )
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"{type(model).__name__} soft-caps its logits (final_logit_softcapping={softcap}); "
            "the fused kernel computes plain log_softmax(h W^T + b) and does not support it"
        )
    kwargs = dict(model_kwargs, attention_mask=attention_mask, position_ids=position_ids)
    kwargs.setdefault("use_cache", False)
    if media is not None:
        mask_and_positions = dict(attention_mask=attention_mask, position_ids=position_ids)
        kwargs.update(media_forward_kwargs(model, input_ids, **mask_and_positions, media=media))
    captured: dict[str, Tensor] = {}

    def capture_hidden(_mod, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        captured["hidden"] = hidden  # [B, T, H], after the final norm

    def compute_in_head(_mod, _args, _output):
        # While the head's weight is unsharded: in the root's FSDP2 group (for the whole
        # forward), or in its own group (a frozen model's, gathered only for the head).
        hidden = captured.pop("hidden")  # [B, T, H]
        hidden = hidden if keep_last else hidden[:, :-1]  # [B, T-1, H]
        if isinstance(head, FSDPModule) and torch.is_grad_enabled() and hidden.requires_grad:
            raise ValueError(
                "the LM head is an FSDP2 group of its own (parallelize does that for a model "
                "without trainable parameters), so its weight is resharded after its forward "
                "and no backward can read it; compute under torch.no_grad()"
            )
        captured["out"] = fn(hidden, head.weight, getattr(head, "bias", None))

    def return_it(_mod, _args, _output):
        # A view (the kernel's reshaped log-probs) would carry FSDP2's pre-backward hook on a
        # tensor an in-place op could bypass; a copy of these [B, T] values is cheap and exact.
        out = captured.pop("out")
        if isinstance(out, tuple):
            return tuple(t.clone() if t._base is not None else t for t in out)
        return out.clone() if out._base is not None else out

    # A PEFT wrapper's forward takes **kwargs: ask the model it wraps.
    if "logits_to_keep" in inspect.signature(type(unwrap_peft(model)).forward).parameters:
        kwargs.setdefault("logits_to_keep", 1)
    with contextlib.ExitStack() as hooks:  # each handle removes its hook on exit
        hooks.enter_context(trunk.register_forward_hook(capture_hidden))
        if trunk_inputs is not None:
            hooks.enter_context(trunk.register_forward_pre_hook(trunk_inputs, with_kwargs=True))
        # prepend=True: before FSDP2's post-forward hooks, so the head's weight is still
        # unsharded and the root's output is ours (FSDP2 registers its pre-backward hook on it).
        hooks.enter_context(head.register_forward_hook(compute_in_head, prepend=True))
        hooks.enter_context(model.register_forward_hook(return_it, prepend=True))
        return model(input_ids=input_ids, **kwargs)


def causal_lm_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    *,
    targets: Tensor | None = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    grad_hint: GradHint | None = None,
    sequence_parallel: Any = None,
    **model_kwargs,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs ``[B, T-1]`` of the next tokens under ``model``, computed from its final
    hidden states with :func:`fused_linear_logprobs` (the ``[B, T, V]`` logits never exist).

    Args:
        model: an HF causal LM (``*ForCausalLM``), plain or FSDP2-sharded (``parallelize``);
            call it on every rank, as any FSDP forward.
        input_ids: ``[B, T]`` token ids (padded, or packed rows with per-sample ``position_ids``).
        targets: ``[B, T-1]`` tokens to score at positions ``0..T-2``; default
            ``input_ids[:, 1:]``. Set ``ignore_index`` where no log-prob is wanted (prompt,
            padding): those give 0, get no gradient and cost no LM-head compute.
        attention_mask, position_ids, **model_kwargs: passed to the model's forward.
        media: a multimodal batch's ``Media`` (see :func:`forward_on_hidden`).
        temperature, return_entropy, chunk_size, backend: as in :func:`fused_linear_logprobs`.
        entropy_grad: with ``return_entropy``, False computes the entropy without gradient in a
            second, no-grad pass over the same hidden states (only to log it), so the log-probs
            keep the fastest backend (Liger's Triton kernel on CUDA has no entropy).
        grad_hint: see :func:`fused_linear_logprobs`; its rows index the flattened
            ``[B * (T-1)]`` positions (e.g. :func:`~lightrft.kernels.response_grad_hint`).
        sequence_parallel: a :class:`lightrft.models.ulysses.Ulysses`: this rank computes
            its slice of the positions and the result is gathered over its SP group (no
            ``grad_hint`` yet; ``media`` for the model types ``lightrft.models.ulysses``
            allows).

    Returns:
        fp32 log-probs ``[B, T-1]``, or ``(log-probs, entropy)``.
    """
    targets = _check_ids(input_ids, targets)
    fwd = dict(model_kwargs, attention_mask=attention_mask, position_ids=position_ids)
    sp = sequence_parallel
    if sp is not None:
        if grad_hint is not None:
            raise ValueError("sequence_parallel does not take a grad_hint yet")
        length = targets.shape[1]
        shard, fwd = _sp_inputs(model, sp, input_ids, targets, ignore_index, fwd)
        input_ids, targets = shard.input_ids, shard.targets
    b, t1 = targets.shape

    def run(hidden: Tensor, weight: Tensor, bias: Tensor | None, entropy: bool, backend: str):
        out = fused_linear_logprobs(
            hidden.reshape(b * t1, hidden.shape[-1]),
            weight,
            targets.reshape(-1),
            bias=bias,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=entropy,
            ignore_index=ignore_index,
            backend=backend,
            grad_hint=grad_hint,  # ignored under no_grad
        )
        return tuple(x.view(b, t1) for x in out) if entropy else out.view(b, t1)

    def logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None):
        if not return_entropy:
            return run(hidden, weight, bias, False, backend)
        chosen = select_backend(hidden, backend=backend, grad_hint=grad_hint is not None)
        if not entropy_grad and chosen == "liger":
            # Log-probs on Liger's kernel (it has no entropy), entropy from a no-grad pass.
            lp = run(hidden, weight, bias, False, backend)
            with torch.no_grad():
                detached = None if bias is None else bias.detach()
                _, ent = run(hidden.detach(), weight.detach(), detached, True, "torch")
            return lp, ent
        # One pass: the entropy costs an exp and a dot per row on top of the log-probs; an
        # entropy without gradient leaves the backward as cheap as log-probs alone.
        lp, ent = run(hidden, weight, bias, True, backend)
        return lp, ent if entropy_grad else ent.detach()

    out = forward_on_hidden(model, input_ids, logprobs, **fwd)
    if sp is None:
        return out
    return tuple(sp.gather(x, length) for x in out) if return_entropy else sp.gather(out, length)


def causal_lm_cross_entropy(
    model: nn.Module,
    input_ids: Tensor,
    *,
    targets: Tensor | None = None,
    num_tokens: int | float | Tensor | None = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    sequence_parallel: Any = None,
    **model_kwargs,
) -> Tensor:
    """Mean next-token NLL of ``model`` (the SFT loss) via :func:`fused_linear_cross_entropy`.

    ``targets`` as in :func:`causal_lm_token_logprobs` (``ignore_index`` where no loss is taken);
    ``num_tokens``: the divisor (e.g. the loss-token count of the whole optimizer step across
    micro-batches and ranks), default the number of non-ignored targets. When autograd is on,
    the gradients are computed during the forward (3 LM-head matmuls per chunk instead of 4).

    ``sequence_parallel`` (a :class:`lightrft.models.ulysses.Ulysses`): this rank's share of
    the loss, its slice of the positions divided by ``num_tokens`` (default: the scored targets
    of the whole rows); the shares of the SP group sum to the loss.
    """
    targets = _check_ids(input_ids, targets)
    fwd = dict(model_kwargs, attention_mask=attention_mask, position_ids=position_ids)
    if sequence_parallel is not None:
        shard, fwd = _sp_inputs(model, sequence_parallel, input_ids, targets, ignore_index, fwd)
        input_ids, targets = shard.input_ids, shard.targets
        num_tokens = shard.num_tokens if num_tokens is None else num_tokens

    def cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return fused_linear_cross_entropy(
            hidden,
            weight,
            targets,
            bias=bias,
            ignore_index=ignore_index,
            num_tokens=num_tokens,
            chunk_size=chunk_size,
            backend=backend,
        )

    return forward_on_hidden(model, input_ids, cross_entropy, **fwd)


def _sp_inputs(model, sp, input_ids, targets, ignore_index, kwargs):
    """This rank's sequence-parallel slice (``input_ids``: what the model gets) and the
    :func:`forward_on_hidden` keyword arguments for it (``kwargs``: the whole rows',
    ``attention_mask`` and ``position_ids`` among them). A text row is cut before the model; a multimodal row
    enters whole (padded to a multiple of N), so that the images' features are merged into the
    embeddings and the M-RoPE positions computed over the whole row, and is cut at the decoder
    trunk's entry (:meth:`~lightrft.models.ulysses.SequenceShard.trunk_inputs`)."""
    sp.prepare(model)
    mask, pos = kwargs.pop("attention_mask"), kwargs.pop("position_ids")
    shard = sp.shard(
        input_ids, targets, attention_mask=mask, position_ids=pos, ignore_index=ignore_index
    )
    kwargs["keep_last"] = True
    if kwargs.get("media") is None:
        return shard, {**kwargs, "position_ids": shard.position_ids, "ulysses": shard}
    shard.input_ids = shard.whole_input_ids
    kwargs["trunk_inputs"] = shard.trunk_inputs
    mask, pos = shard.whole_attention_mask, shard.whole_position_ids
    return shard, {**kwargs, "attention_mask": mask, "position_ids": pos}


# ------------------------------------------------------------------ media forward kwargs


def mrope_model(model: nn.Module) -> nn.Module | None:
    """The base model that computes M-RoPE positions (``get_rope_index``), or None (LLaVA)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    return base if callable(getattr(base, "get_rope_index", None)) else None


def media_forward_kwargs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    media,
) -> dict[str, torch.Tensor | None]:
    """The keyword arguments of a multimodal forward over ``input_ids`` ``[B, T]`` whose media
    tokens belong to ``media`` (a :class:`~lightrft.data.media.Media` of the batch, in order).

    Each kind adds its inputs: images ``pixel_values`` (and ``image_grid_thw``), videos
    ``pixel_values_videos`` and ``video_grid_thw`` (and Qwen2.5-VL's ``second_per_grid_ts``), audio
    ``input_features`` and ``feature_attention_mask`` (Qwen2-Audio takes ordinary positions).
    M-RoPE models (Qwen-VL) also get:

    * ``mm_token_type_ids`` rebuilt over prompt + completion (1 on image tokens, 2 on video
      tokens; the processor's covers the prompt only; Qwen2-VL refuses grids without it);
    * no 2-D ``position_ids`` for a padded batch (``attention_mask`` given): 2-D positions
      silently replace the 3-D M-RoPE ones, so the model computes them from ids, grids and mask;
    * for packed rows (``attention_mask=None``, ``position_ids`` restarting at 0 per sample), the
      ``(4, B, T)`` form: per-sample text positions (from which transformers finds the sample
      boundaries) over the per-sample 3-D M-RoPE positions.

    Models without M-RoPE (LLaVA) take ordinary positions, so their packing works as for text.
    """
    from lightrft.models.modality import is_audio_language, is_vision_language

    config, name = getattr(model, "config", None), type(model).__name__
    if media.audio is not None and not is_audio_language(config):
        raise ValueError(f"audio was given but {name} is not an audio-language model")
    if media.image is not None and not is_vision_language(config):
        raise ValueError(f"images were given but {name} is not a vision-language model")
    video = media.video
    if video is not None and getattr(config, "video_token_id", None) is None:
        raise ValueError(f"videos were given but {name} takes no video (no video_token_id)")
    kwargs: dict[str, torch.Tensor | None] = {
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        **media.model_inputs(input_ids.device),
    }
    images = media.image
    rope = mrope_model(model)
    if rope is None or (images is None and video is None):
        return kwargs
    mm = mm_token_types(model.config, input_ids)  # [B, T]
    kwargs["mm_token_type_ids"] = mm
    if attention_mask is not None or position_ids is None:
        kwargs["position_ids"] = None
    else:
        kwargs["position_ids"] = packed_mrope_positions(
            rope,
            input_ids,
            mm,
            None if images is None else images.image_grid_thw,
            position_ids,
            video_grid_thw=None if video is None else video.video_grid_thw,
            second_per_grid_ts=None if video is None else video.second_per_grid_ts,
        )
    return kwargs


def mm_token_types(config, input_ids: torch.Tensor) -> torch.Tensor:
    """Qwen-VL's ``mm_token_type_ids`` of ``input_ids``: 1 on image tokens, 2 on video tokens,
    0 elsewhere (int32, the shape of ``input_ids``)."""
    from lightrft.models.modality import image_token_id

    mm = (input_ids == image_token_id(config)).int()
    video = getattr(config, "video_token_id", None)
    if video is not None:
        mm = mm + 2 * (input_ids == int(video)).int()
    return mm


def packed_mrope_positions(
    rope: nn.Module,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    position_ids: torch.Tensor,
    *,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(4, B, T)`` positions of packed rows: row 0 the given per-sample text positions
    ``[B, T]`` (restarting at 0 per sample), rows 1-3 each sample's own M-RoPE positions."""
    b, t = input_ids.shape
    out = torch.empty((4, b, t), dtype=torch.long, device=input_ids.device)
    out[0] = position_ids
    at = {1: 0, 2: 0}  # next image / video grid row
    rows = {1: image_grid_thw, 2: video_grid_thw}
    for r in range(b):
        starts = (position_ids[r] == 0).nonzero().flatten().tolist() + [t]
        for s, e in zip(starts[:-1], starts[1:], strict=True):
            mm = mm_token_type_ids[r, s:e]
            # An image or a video is one run of its placeholder tokens (vision start/end
            # markers separate runs).
            grids: dict[int, torch.Tensor | None] = {1: None, 2: None}
            extra = {}
            for kind in (1, 2):
                runs = int(((mm[1:] == kind) & (mm[:-1] != kind)).sum()) + int(mm[0] == kind)
                if not runs:
                    continue
                assert rows[kind] is not None, "vision tokens without their grid rows"
                grids[kind] = rows[kind][at[kind] : at[kind] + runs]  # type: ignore[index]
                if kind == 2 and second_per_grid_ts is not None:
                    extra["second_per_grid_ts"] = second_per_grid_ts[at[2] : at[2] + runs]
                at[kind] += runs
            pos, _ = rope.get_rope_index(
                input_ids[r : r + 1, s:e],
                mm_token_type_ids=mm[None],
                image_grid_thw=grids[1],
                video_grid_thw=grids[2],
                **extra,
            )  # [3, 1, e - s]
            out[1:, r, s:e] = pos[:, 0]
    return out
