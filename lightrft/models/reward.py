"""Scalar reward models: a transformer backbone, a pooling of its hidden states, named heads.

:class:`RewardNet` is the one module both reward-model training (``recipes/reward_model.py``)
and scoring (:class:`lightrft.rewards.RewardModel`) run, so a trained model scores the same in
RL as in its evaluation. Its parameter names are those of the HF ``*ForSequenceClassification``
it was built from (``model.*`` backbone, ``score.*`` heads, plus ``pooler.*`` for attention
pooling), so an export is that HF directory: ``transformers`` loads a one-head, last-token model
as it is, and ``config.json`` gains a ``lightrft_reward`` block (heads, pooling, probe layer,
reward statistics) that :func:`load_reward_net` reads back.

Pooling works on ``segment_ids [R, T]`` (the sequence index of each token, -1 on padding), so
padded batches (either side) and packed rows pool the same way:

- ``last``: the hidden state of each sequence's last real token (mask-based, never by pad id);
- ``mean``: the mean over the sequence's tokens;
- ``attention``: a softmax over the sequence's tokens of a learned linear score, then the
  weighted mean (one ``hidden -> 1`` layer; small, as in attention-pooled classifiers).

``likelihood`` pools token log-probabilities instead of hidden states: the head is the backbone's
own LM head (an HF causal LM, not a classifier) and the score is the mean log-probability of the
response tokens (``scored [R, T]`` marks them) plus, when ``end_token_id`` is set, of the end token
after the response (so a response cut short scores low). Training it with a preference loss
sharpens a language model into a judge that starts where the model's own knowledge is: a
classifier head on a pooled state has to learn to read that knowledge out first, which a small
model does slowly (docs/reward_models.md measures both). One head; no probe layer. Its export is
the causal LM directory with the ``lightrft_reward`` block.

``probe_layer=k`` reads the output of decoder block ``k`` (1-based; ``hidden_states[k]``)
instead of the final, normed hidden state: a probing reward model on a middle layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.models.loading import check_local, load_model, to_dtype
from lightrft.models.multimodal import checkpoint_config, checkpoint_is_multimodal

POOLINGS = ("last", "mean", "attention", "likelihood")
CONFIG_KEY = "lightrft_reward"
_HEAD_NAMES = ("score", "classifier", "v_head", "value_head")


class AttentionPooling(nn.Module):
    """Token weights ``softmax(w . h + b)`` within each sequence."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden).squeeze(-1)  # [R, T] token logits


def pool_hidden(
    hidden: torch.Tensor,
    segment_ids: torch.Tensor,
    num_sequences: int,
    pooling: str = "last",
    token_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """One vector per sequence ``[N, H]`` from ``hidden [R, T, H]`` and ``segment_ids [R, T]``.

    ``token_logits [R, T]`` are the attention pooling's scores (``pooling="attention"`` only).
    """
    R, T, H = hidden.shape
    if pooling == "last":
        return hidden.reshape(R * T, H)[last_positions(segment_ids, num_sequences)]  # [N, H]
    seg = segment_ids.reshape(-1)  # [R*T]
    real = seg >= 0
    seg = seg[real]
    # Sums in fp32 (fp64 for fp64): a bf16 sum of token states loses their precision, and a
    # bf16 count stops at 256.
    acc = torch.promote_types(hidden.dtype, torch.float32)
    rows = hidden.reshape(R * T, H)[real].to(acc)  # [n_real, H]
    out = torch.zeros(num_sequences, H, dtype=acc, device=hidden.device)
    if pooling == "mean":
        counts = torch.bincount(seg, minlength=num_sequences)  # [N]
        return (out.index_add(0, seg, rows) / counts[:, None]).to(hidden.dtype)  # [N, H]
    if pooling == "attention":
        assert token_logits is not None, "attention pooling needs token_logits"
        logit = token_logits.reshape(-1)[real].float()  # [n_real]
        peak = torch.full((num_sequences,), float("-inf"), device=hidden.device)
        peak = peak.scatter_reduce(0, seg, logit.detach(), reduce="amax")  # [N], for stability
        w = torch.exp(logit - peak[seg])  # [n_real]
        denom = torch.zeros(num_sequences, device=hidden.device).index_add(0, seg, w)  # [N]
        w = (w / denom[seg]).to(acc)
        return out.index_add(0, seg, rows * w[:, None]).to(hidden.dtype)  # [N, H]
    raise ValueError(f"pooling must be one of {POOLINGS[:3]}, got {pooling!r}")


def last_positions(segment_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Flat index ``[N]`` (into ``R * T``) of each sequence's last real token."""
    seg = segment_ids.reshape(-1)  # [R*T]
    real = seg >= 0
    pos = torch.arange(seg.numel(), device=seg.device)[real]
    last = torch.full((num_sequences,), -1, dtype=torch.long, device=seg.device)
    return last.scatter_reduce(0, seg[real], pos, reduce="amax")  # [N]


def likelihood_scores(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    input_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    scored: torch.Tensor,
    num_sequences: int,
    end_token_id: int | None = None,
) -> torch.Tensor:
    """Mean log-probability ``[N]`` (fp32) of each sequence's scored tokens under ``lm_head``.

    ``hidden [R, T, H]`` are the final hidden states; token ``t`` of a row is predicted from
    ``hidden[:, t - 1]``, so ``scored [R, T]`` must be false on each sequence's first token.
    With ``end_token_id``, the end token's log-probability after each sequence's last token
    counts as one more scored token (unless that last token is already the end token). No
    ``[tokens, vocab]`` logits are kept: the fused kernel (``lightrft.kernels``) gives
    ``log_softmax(lm_head(h))[target]``, or, for a head sharded by vocabulary rows over the ranks
    (a sharded reward model), its vocabulary-parallel form, a collective.
    """
    from lightrft.kernels import fused_linear_logprobs
    from lightrft.models.vocab_parallel import vocab_parallel_logprobs, vocab_rows

    R, T, H = hidden.shape
    hidden_rows = hidden[:, :-1].reshape(-1, H)  # [R*(T-1), H]
    targets = torch.where(scored[:, 1:], input_ids[:, 1:], -100).reshape(-1)  # [R*(T-1)]
    seg = segment_ids[:, :-1].reshape(-1)  # the sequence each predicting position belongs to
    if end_token_id is not None:
        last = last_positions(segment_ids, num_sequences)  # [N]
        ends_open = input_ids.reshape(-1)[last] != end_token_id  # [N]
        extra = hidden.reshape(R * T, H)[last[ends_open]]  # [n_open, H]
        hidden_rows = torch.cat([hidden_rows, extra])
        targets = torch.cat([targets, torch.full_like(last[ends_open], end_token_id)])
        seg = torch.cat([seg, ends_open.nonzero().squeeze(-1)])
    keep = targets != -100
    hidden_rows, targets, seg = hidden_rows[keep], targets[keep], seg[keep]
    rows = vocab_rows(lm_head.weight)
    if rows is None:
        logp = fused_linear_logprobs(hidden_rows, lm_head.weight, targets, bias=lm_head.bias)
    else:
        local = lm_head.weight.to_local().to(hidden.device)  # offload: rows kept in CPU memory
        bias = None if lm_head.bias is None else lm_head.bias.to_local().to(hidden.device)
        logp = vocab_parallel_logprobs(hidden_rows, local, targets, rows, bias)  # [n_scored] fp32
    sums = torch.zeros(num_sequences, device=hidden.device).index_add(0, seg, logp)
    counts = torch.bincount(seg, minlength=num_sequences)
    return sums / counts.clamp(min=1)  # a sequence with nothing scored scores 0


class RewardNet(nn.Module):
    """Backbone + pooling + a ``hidden -> len(heads)`` linear head; ``forward`` gives ``[N, heads]``.

    Args:
        base: the transformer body (returns ``last_hidden_state`` / ``hidden_states``).
        head: the linear head, one output per named head.
        heads: head names, in output order.
        pooling: ``"last"``, ``"mean"``, ``"attention"`` or ``"likelihood"`` (``head`` is then
            the LM head and ``heads`` one name).
        end_token_id: ``likelihood`` only: the token whose log-probability after the response
            is scored too (the tokenizer's EOS for plain-text data; ``None`` with a chat
            template, whose end-of-turn tokens are part of the response).
        probe_layer: read decoder block ``probe_layer``'s output (1-based) instead of the last.
        base_name, head_name: attribute names, those of the HF class (``model``, ``score``), so
            parameter names match its checkpoint.
        hf_model: the HF ``*ForSequenceClassification`` the parts come from, used to save.
    """

    def __init__(
        self,
        base: nn.Module,
        head: nn.Linear,
        *,
        heads: Sequence[str] = ("reward",),
        pooling: str = "last",
        end_token_id: int | None = None,
        probe_layer: int | None = None,
        base_name: str = "model",
        head_name: str = "score",
        hf_model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        _check_pooling(pooling, heads, probe_layer, end_token_id)
        if pooling != "likelihood" and head.out_features != len(heads):
            raise ValueError(
                f"the head has {head.out_features} outputs but {len(heads)} heads are named "
                f"({list(heads)})"
            )
        self.base_name, self.head_name = base_name, head_name
        setattr(self, base_name, base)
        setattr(self, head_name, head)
        self.pooler = AttentionPooling(head.in_features) if pooling == "attention" else None
        self.heads = list(heads)
        self.pooling = pooling
        self.end_token_id = end_token_id
        self.probe_layer = probe_layer
        # Kept out of the module tree (it holds the same submodules): only its config and
        # save_pretrained are used.
        self._hf = [hf_model] if hf_model is not None else []

    @property
    def base(self) -> nn.Module:
        return getattr(self, self.base_name)

    @property
    def head(self) -> nn.Linear:
        return getattr(self, self.head_name)

    def get_output_embeddings(self) -> nn.Linear | None:
        """The LM head of the ``likelihood`` pooling (``None`` otherwise). Its weight is read
        directly, not through the head's forward: DeepSpeed ZeRO-3 finds it here and gathers it
        with the root module."""
        return self.head if self.pooling == "likelihood" else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        num_sequences: int,
        attention_mask: torch.Tensor | None = None,
        scored: torch.Tensor | None = None,
        media=None,
    ) -> torch.Tensor:
        """Scores ``[N, heads]``. ``scored [R, T]`` (the response tokens) is read by the
        ``likelihood`` pooling only, which needs it. ``media``: a vision-language batch's
        :class:`~lightrft.data.media.Media` (its sequences' images, in order)."""
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "position_ids": position_ids}
        if media is not None:
            from lightrft.models.forward import media_forward_kwargs

            kwargs = media_forward_kwargs(self._hf[0], input_ids, media=media, **kwargs)
        out = self.base(
            input_ids=input_ids,
            use_cache=False,
            output_hidden_states=self.probe_layer is not None,
            **kwargs,
        )
        hidden = (
            out.last_hidden_state
            if self.probe_layer is None
            else out.hidden_states[self.probe_layer]
        )  # [R, T, H]
        if self.pooling == "likelihood":
            if scored is None:
                raise ValueError("pooling='likelihood' needs the scored-token mask `scored`")
            # The head's weight is read, its forward not called: a trained head is in the root's
            # FSDP2 group (whole in the root's forward), a scoring one's vocabulary-parallel.
            return likelihood_scores(
                hidden, self.head, input_ids, segment_ids, scored, num_sequences, self.end_token_id
            )[:, None]  # [N, 1]
        logits = self.pooler(hidden) if self.pooler is not None else None
        pooled = pool_hidden(hidden, segment_ids, num_sequences, self.pooling, logits)  # [N, H]
        return self.head(pooled)  # [N, heads]

    def save_pretrained(self, out_dir: str | Path, **kwargs: Any) -> None:
        """Save as the HF classifier directory (``export_hf`` calls this with the full state)."""
        if not self._hf:
            raise ValueError("this RewardNet was not built from an HF model and cannot be saved")
        self._hf[0].save_pretrained(out_dir, **kwargs)

    def reward_config(self, stats: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
        """The ``lightrft_reward`` block of an exported ``config.json``."""
        return {
            "heads": self.heads,
            "pooling": self.pooling,
            "probe_layer": self.probe_layer,
            "end_token_id": self.end_token_id,
            "stats": stats or {},
        }


def _check_pooling(
    pooling: str, heads: Sequence[str], probe_layer: int | None, end_token_id: int | None
) -> None:
    """What a pooling takes: one of :data:`POOLINGS`; ``likelihood`` scores with the LM head (one
    head, no probe layer), and only it takes an ``end_token_id``."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling != "likelihood":
        if end_token_id is not None:
            raise ValueError("end_token_id applies to pooling='likelihood' only")
        return
    if len(heads) != 1:
        raise ValueError(
            f"pooling='likelihood' scores with the LM head: one head only, got {list(heads)}"
        )
    if probe_layer is not None:
        raise ValueError("pooling='likelihood' reads the LM head's input: no probe_layer")


def build_reward_net(
    path: str | Path,
    *,
    heads: Sequence[str] = ("reward",),
    pooling: str = "last",
    end_token_id: int | None = None,
    probe_layer: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
) -> RewardNet:
    """A trainable reward model from any HF causal LM or ``*ForSequenceClassification`` dir.

    The HF classifier class of the model type is built with ``num_labels=len(heads)``; a causal
    LM checkpoint gives its body (the LM head is dropped) and a fresh head (seeded by the
    caller's ``torch.manual_seed``). ``pooling="likelihood"`` loads the causal LM whole and
    scores with its own LM head (``end_token_id``: see :class:`RewardNet`).
    """
    spec = dict(heads=heads, pooling=pooling, end_token_id=end_token_id, probe_layer=probe_layer)
    load = dict(
        dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    return _build(path, spec, load, meta=False)[0].to(device)


def _build(
    path: str | Path, spec: dict[str, Any], load: dict[str, Any], *, meta: bool
) -> tuple[RewardNet, tuple[str | Path, dict[str, str], set[str]] | None]:
    """The :class:`RewardNet` of ``spec`` (heads, pooling, end token, probe layer) on the HF
    model at ``path`` (``load``: dtype, remote code, attention), and, built on the meta device
    (``meta``), the checkpoint ``(path, names, converted)`` each rank reads its slices from.

    It wraps the HF classifier, or for the ``likelihood`` pooling the causal LM with its own LM
    head (its parameter names stay the causal LM's: ``model.*``, ``lm_head.*``). New parameters
    (the classifier's head when the checkpoint lacks it; the attention pooler) are drawn from
    the run's seed in a forked RNG, as transformers initialises a head (normal,
    ``initializer_range``): the same values on every rank and in every loading path, whatever
    was drawn before. The LM head is never new: a tied one is in no checkpoint (it is the input
    embedding), and replacing it would score with a random head."""
    from transformers import AutoModelForSequenceClassification

    from lightrft.models.sharded import SafetensorsIndex, build_on_meta, checkpoint_names

    check_local(path)
    _check_pooling(**spec)
    classifier: dict[str, Any] = {}  # a causal LM, or a vision-language model, as the actor loads
    if spec["pooling"] != "likelihood":
        # A classifier head (``last`` / ``mean`` / ``attention``) needs a text backbone:
        # transformers has no sequence-classification class for vision-language models.
        if checkpoint_is_multimodal(path):
            raise ValueError(
                f"{path} is a vision- or audio-language model: pooling={spec['pooling']!r} needs "
                "a *ForSequenceClassification class, which transformers does not have for it; "
                "use pooling='likelihood' (the model's own LM head scores the response)"
            )
        heads = spec["heads"]  # the HF classifier config's label keys: one output per head
        labels = dict(
            num_labels=len(heads),
            id2label=dict(enumerate(heads)),
            label2id={h: i for i, h in enumerate(heads)},
        )
        classifier = dict(auto_class=AutoModelForSequenceClassification, **labels)
    checkpoint = None
    if meta:
        files = SafetensorsIndex.read(path).files
        hf = build_on_meta(path, **load, **classifier)
        names, converted = checkpoint_names(hf, list(files))
        checkpoint = (path, names, converted)
        missing = {name for name in hf.state_dict() if names.get(name) not in files}
    elif classifier:
        kwargs = {"dtype": to_dtype(load["dtype"]), "trust_remote_code": load["trust_remote_code"]}
        if load["attn_implementation"]:
            kwargs["attn_implementation"] = load["attn_implementation"]
        hf, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
            **labels,
            **kwargs,
        )
        missing = set(info.get("missing_keys", ()))
        missing |= {k if isinstance(k, str) else k[0] for k in info.get("mismatched_keys", ())}
    else:
        hf = load_model(path, **load)
    if classifier:
        probe, n_layers = spec["probe_layer"], getattr(hf.config, "num_hidden_layers", None)
        if probe is not None and (probe < 1 or (n_layers is not None and probe > n_layers)):
            raise ValueError(
                f"probe_layer must be between 1 and the number of layers ({n_layers}), got {probe}"
            )
        head_name = next(
            (n for n in _HEAD_NAMES if isinstance(getattr(hf, n, None), nn.Linear)), None
        )
        if head_name is None:
            raise ValueError(f"{type(hf).__name__} has no linear head named any of {_HEAD_NAMES}")
        head = getattr(hf, head_name)
    else:  # its own LM head: in the checkpoint, or tied to the input embedding
        head = hf.get_output_embeddings()
        head_name = next((n for n, m in hf.named_children() if m is head), None)
        if head_name is None or not isinstance(head, nn.Linear):
            raise ValueError(
                f"{type(hf).__name__} has no linear LM head among its children: pooling="
                "'likelihood' needs a causal LM"
            )
    dtype = to_dtype(load["dtype"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed())
        if classifier and f"{head_name}.weight" in missing:
            new = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
            nn.init.normal_(new.weight, std=getattr(hf.config, "initializer_range", 0.02))
            if new.bias is not None:
                nn.init.zeros_(new.bias)
            head = new.to(dtype=dtype)
            setattr(hf, head_name, head)
        base_name = hf.base_model_prefix
        net = RewardNet(
            getattr(hf, base_name),
            head,
            **spec,
            base_name=base_name,
            head_name=head_name,
            hf_model=hf,
        )
    if net.pooler is not None:
        net.pooler.to(dtype=dtype)
    return net, checkpoint


def load_reward_net_parallel(
    path: str | Path,
    *,
    heads: Sequence[str] = ("reward",),
    pooling: str = "last",
    end_token_id: int | None = None,
    probe_layer: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    prepare: Callable[[RewardNet], nn.Module] | None = None,
    mesh=None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    shard: bool | None = None,
    offload: bool = False,
    param_dtype: torch.dtype | None = None,
    scoring: bool = False,
) -> nn.Module:
    """:func:`build_reward_net`, ``prepare`` (LoRA) and ``parallelize``: the reward-model
    recipe's one call, as :func:`~lightrft.models.sharded.load_parallel` is the other recipes'.
    ``param_dtype``: the sharded forward's compute dtype (default: bf16 on an accelerator).
    ``scoring``: sharded and frozen, laid out to score with the least memory per rank: only its
    rows of the input embedding and LM head (:mod:`lightrft.models.vocab_parallel`), one weight
    matrix gathered at a time (:func:`~lightrft.models.parallel.parallelize`).

    Sharded (``shard=True``, or ``shard=None`` under
    :func:`~lightrft.models.parallel.default_sharding`), no rank holds the whole backbone: the
    classifier is built on the meta device, sharded, and each rank reads only its slices of
    the checkpoint. A head the checkpoint lacks (a causal-LM backbone) is created in full on
    every rank from the same RNG state, as transformers initialises it
    (normal, ``initializer_range``); the pooler likewise.
    """
    from lightrft.models.parallel import default_sharding
    from lightrft.models.sharded import prepare_and_parallelize

    spec = dict(heads=heads, pooling=pooling, end_token_id=end_token_id, probe_layer=probe_layer)
    load = dict(
        dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    if shard is None:
        shard = default_sharding(offload=offload, scoring=scoring)
    net, checkpoint = _build(path, spec, load, meta=shard)
    return prepare_and_parallelize(
        net if shard else net.to(device),
        prepare,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        mesh=mesh,
        device=device,
        checkpoint=checkpoint,
        offload=offload,
        param_dtype=param_dtype,
        scoring=scoring,
    )


def set_reward_config(model: nn.Module, block: dict[str, Any]) -> None:
    """Put the ``lightrft_reward`` block (:meth:`RewardNet.reward_config`) into the HF config
    that the export of ``model`` (a RewardNet, plain or sharded) writes."""
    setattr(model._hf[0].config, CONFIG_KEY, block)


def read_reward_config(path: str | Path) -> dict[str, Any] | None:
    """The ``lightrft_reward`` block of ``path/config.json``, or ``None``."""
    return (checkpoint_config(path) or {}).get(CONFIG_KEY)


def load_reward_net(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    mesh=None,
    offload: bool = False,
) -> RewardNet:
    """A trained reward model from an HF ``*ForSequenceClassification`` directory (or, for a
    ``likelihood`` export, the causal LM directory), frozen.

    Reads heads, pooling and probe layer from ``config.json``'s ``lightrft_reward`` block (an
    export of ``recipes/reward_model.py``); a plain HF classifier has one head, last-token
    pooling. Attention-pooling weights (``pooler.*``) come from the safetensors files.

    ``mesh``: shard the model over it with FSDP2 (:func:`load_reward_net_parallel`: built on
    the meta device, each rank reads only its slices; parameters only, no gradients), its
    forward then a collective every rank of the mesh joins, vocabulary-parallel: each rank
    keeps only its rows of the input embedding and LM head, never gathered
    (:mod:`lightrft.models.vocab_parallel`). ``offload``: with a mesh, the shards live in CPU
    memory and are copied to ``device`` for each all-gather.
    """
    cfg = checkpoint_config(path) or {}
    meta = cfg.get(CONFIG_KEY) or {}
    heads = meta.get("heads")
    if heads is None:
        labels = cfg.get("id2label") or {}
        heads = ["reward"] if len(labels) <= 1 else [labels[str(i)] for i in range(len(labels))]
    spec: dict[str, Any] = dict(
        heads=heads,
        pooling=meta.get("pooling", "last"),
        end_token_id=meta.get("end_token_id"),
        probe_layer=meta.get("probe_layer"),
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )

    def frozen(net: RewardNet) -> RewardNet:
        # Before sharding: parallelize() lays a model out for scoring only if it has no
        # trainable parameters (its vocabulary tables' rows kept per rank, never gathered).
        _load_pooler(net, path)
        return net.requires_grad_(False)

    sharded = mesh is not None
    return load_reward_net_parallel(
        path,
        **spec,
        device=device,
        prepare=frozen,
        mesh=mesh,
        shard=sharded,
        offload=offload and sharded,  # offload applies with a mesh only
        param_dtype=to_dtype(dtype),  # sharded, the scores' precision is the model's dtype
        scoring=sharded,  # sharded, scoring only: no rank gathers a vocabulary-sized table
    )


def _load_pooler(net: RewardNet, path: str | Path) -> None:
    """An attention pooler's weights (``pooler.*`` in the safetensors files), in place."""
    from safetensors import safe_open

    if net.pooler is None:
        return
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith("pooler."):
                    found[key.removeprefix("pooler.")] = f.get_tensor(key)
    if not found:
        raise ValueError(f"{path}: attention pooling, but no pooler.* tensors in its weights")
    net.pooler.load_state_dict(found)
