"""Scalar reward models scored in-process: a transformer backbone read at the last real token.

Two checkpoint layouts are supported:

- ``classifier``: an HF ``*ForSequenceClassification`` (e.g. Skywork-Reward, the usual
  TRL/OpenRLHF export), or an export of ``recipes/reward_model.py``, whose ``config.json`` also
  names its heads, pooling and reward statistics (see docs/reward_models.md); with the
  ``likelihood`` pooling that export is a causal LM scoring the response tokens' mean
  log-probability.
- ``value_head``: a backbone (``AutoModel``: a causal LM checkpoint works, its LM head is
  ignored) plus a linear ``hidden -> 1`` head whose weight ``{value_head_key}.weight`` (and
  optional bias) lies in one of the directory's ``*.safetensors`` files.

Scoring runs :class:`lightrft.models.reward.RewardNet`, the module reward-model training runs.
The default pooling reads the hidden state of the last non-padding token, located from the
attention mask rather than by ``pad_token_id`` as the HF classifier does (which misreads sequences
that end in a pad-equal EOS). Position ids come from the mask as well, so left and right padding
give the same scores.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from lightrft.config import at_least
from lightrft.data.io import Records
from lightrft.data.media import Media, MediaOptions
from lightrft.data.preference import (
    encode_with_media,
    pad_sequences,
    render_for_scoring,
    response_start,
)
from lightrft.data.records import MediaSamples
from lightrft.distributed import all_gather_objects
from lightrft.models.loading import check_local, from_pretrained_dir, to_dtype
from lightrft.models.multimodal import checkpoint_config, load_processors
from lightrft.models.parallel import build_mesh
from lightrft.models.reward import RewardNet, load_reward_net, read_reward_config
from lightrft.rewards.base import Prompt, Sample, media_parts


def load_value_head(path: str | Path, key: str = "value_head") -> nn.Linear:
    """The ``hidden -> 1`` linear head stored as ``{key}.weight`` (and ``{key}.bias``) in the
    ``*.safetensors`` files of directory ``path``."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"reward model path {str(path)!r} must be a local directory to read a "
            "value head from it"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for suffix in ("weight", "bias"):
                if f"{key}.{suffix}" in f.keys():
                    tensors[suffix] = f.get_tensor(f"{key}.{suffix}")
    if "weight" not in tensors:
        raise ValueError(
            f"no tensor '{key}.weight' in the safetensors files of {str(path)!r}; "
            "set value_head_key to the head's name, or use head='classifier' for a "
            "*ForSequenceClassification checkpoint"
        )
    head = nn.Linear(tensors["weight"].numel(), 1, bias="bias" in tensors)  # weight [1, H]
    head.load_state_dict({k: v.reshape(getattr(head, k).shape) for k, v in tensors.items()})
    return head


def collective_plan(
    lengths: Sequence[int],
    kinds: Sequence[tuple[str, ...]],
    micro_batch_size: int,
    world_size: int,
) -> list[tuple[list[int], bool]]:
    """The micro-batches of a scoring (a collective one, or in one process ``world_size=1``):
    ``(sample indices, real)``; rank ``r`` runs entries ``r, r + world_size, ...``, so every rank
    runs the same number of forwards.

    Samples are grouped by the media kinds they carry (``kinds``: e.g. ``()``, ``("image",)``),
    each group sorted by length (``lengths``) and cut into ``micro_batch_size`` chunks, and each
    group's chunk count is rounded up to a multiple of ``world_size`` with fillers (its first
    sample again, ``real=False``, scored and dropped). So at each step every rank's forward has
    the same kinds of media: a vision- or audio-language model runs (and all-gathers) the same
    towers on every rank, as FSDP2's collectives need.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, k in enumerate(kinds):
        groups.setdefault(tuple(k), []).append(i)
    plan: list[tuple[list[int], bool]] = []
    for key in sorted(groups):
        members = sorted(groups[key], key=lambda i: lengths[i])  # stable: index order on ties
        chunks = [
            members[s : s + micro_batch_size] for s in range(0, len(members), micro_batch_size)
        ]
        plan += [(c, True) for c in chunks]
        plan += [([members[0]], False)] * (-len(chunks) % world_size)
    return plan


def _value_head_net(
    path: str | Path,
    key: str,
    *,
    dtype: str,
    device: str | torch.device,
    trust_remote_code: bool,
    attn_implementation: str | None,
    mesh,
    offload: bool,
) -> RewardNet:
    """The ``value_head`` layout as a frozen :class:`RewardNet`: the backbone (``AutoModel``) and
    the head ``key``. With ``mesh``, FSDP2-sharded over it, each rank reading only its slices of
    the backbone (the ``hidden -> 1`` head is read whole and sharded from that value)."""
    from transformers import AutoModel

    from lightrft.models.sharded import (
        SafetensorsIndex,
        build_on_meta,
        checkpoint_names,
        prepare_and_parallelize,
    )

    head = load_value_head(path, key).to(to_dtype(dtype))
    load = dict(
        dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    if mesh is None:
        backbone = from_pretrained_dir(AutoModel, path, device="cpu", **load)
        return RewardNet(backbone, head).requires_grad_(False).to(device)
    backbone = build_on_meta(path, **load, auto_class=AutoModel)
    names, converted = checkpoint_names(backbone, list(SafetensorsIndex.read(path).files))
    net = RewardNet(backbone, head).requires_grad_(False)
    within = f"{net.base_name}."  # the backbone's names inside the RewardNet
    return prepare_and_parallelize(
        net,
        None,
        mesh=mesh,
        device=device,
        checkpoint=(
            path,
            {within + k: v for k, v in names.items()},
            {within + c for c in converted},
        ),
        offload=offload,
        param_dtype=to_dtype(dtype),
        scoring=True,  # scoring only: no rank gathers the vocabulary-sized embedding
    )


class RewardModel:
    """A scalar reward model as a reward function: ``rm(prompts, responses, ...) -> Tensor [B]``.

    Each (prompt, response) pair is rendered with the reward model's own chat template (a string
    prompt is one user message; a list is a conversation) and the response appended as the
    assistant turn; with ``chat_template=False`` the texts are concatenated as given. Sequences
    longer than ``max_length`` tokens lose their start, which keeps the response end where the
    score is read. Scoring runs in eval mode under ``torch.inference_mode``, ``micro_batch_size``
    sequences at a time, sorted by length so that little padding is computed.

    A model with several named heads returns ``score_head``'s score and keeps every head's
    scores of the last call in ``last_head_scores`` (name -> ``[B]``), which
    :class:`~lightrft.rewards.CombinedReward` logs as ``reward/<name>/<head>/mean``.

    Args:
        path: HF directory (or hub id, for ``classifier``) of the reward model, or a training
            checkpoint of ``recipes/reward_model.py`` (``<output_dir>/checkpoints/step_N``),
            exported first as ``lightrft export`` does (:func:`lightrft.export.resolve_model_dir`:
            cached, collective under a process group).
        head: ``"classifier"``, ``"value_head"`` or ``"auto"`` (classifier if ``config.json``
            names a ``*ForSequenceClassification`` architecture).
        value_head_key: tensor name prefix of the value head (``value_head`` layout only).
        score_head: the head whose score is the reward (default: the first).
        normalize: subtract the head's reward mean and divide by its std, as measured on the
            held-out split at the end of training (``lightrft_reward.stats`` in ``config.json``).
        micro_batch_size: sequences per forward pass.
        max_length: most tokens per sequence.
        dtype, device: where and in what precision the model runs.
        offload: keep the model on the CPU between calls and move it to ``device`` only to
            score, so the rollout and training phases get the accelerator memory back (sharded:
            FSDP2's CPU offload, the shards in CPU memory, each block copied to ``device``
            as it runs).
        chat_template: render with the tokenizer's chat template.
        padding_side: side on which micro-batches are padded; scores do not depend on it.
        scale, bias: returned reward = ``scale * score + bias`` (e.g. to undo an RM's offset).
        media: a vision- or audio-language reward model's media options (the ``media``
            section, :class:`~lightrft.data.media.MediaOptions`), as its
            :class:`~lightrft.data.PreferenceDataset` took them (same keys and defaults): give
            the values its preference data had. A video part holds the frames the prompt
            dataset sampled and their rate (:func:`~lightrft.data.conversation`); they are
            re-sampled at ``media.video.fps`` (or to ``num_frames``) and sized to the bounds,
            as the preference data sampled and sized the video file.

    A vision- or audio-language reward model (an export of ``recipes/reward_model.py`` with the
    ``likelihood`` pooling) needs the conversations: it reads the images, videos and audio in
    their media parts, renders and expands them exactly as its preference data was
    (:func:`~lightrft.data.preference.encode_with_media`), and refuses a sequence longer than
    ``max_length`` (cutting it would cut media tokens). Audio longer than the feature
    extractor's chunk is clipped to it, as the datasets clip it.

    With the chat template, a sample is rendered from its conversation when it has one
    (``Sample.conversation``: the recipes give each prompt's chat), else from its prompt.

    Under a process group of several ranks (torchrun) the model is sharded over all of them with
    FSDP2 (parameters only), each rank reading only its slices of the checkpoint, so each
    reward model costs a rank ``1 / world_size`` of its weights; laid out for scoring, it is
    vocabulary-parallel (each rank keeps its rows of the input embedding and LM head, never
    gathered: :mod:`lightrft.models.vocab_parallel`) and gathers one weight matrix at a time
    while it runs. Scoring is then a collective
    (``collective`` is true): every rank calls the model every time, with or without samples of
    its own; the samples of all ranks are gathered, scored in micro-batches the ranks take in
    turn (:func:`collective_plan`), and each rank gets its own scores back. In one process it
    loads whole, as before.
    """

    name = "reward_model"

    def __init__(
        self,
        path: str,
        head: Literal["auto", "classifier", "value_head"] = "auto",
        value_head_key: str = "value_head",
        score_head: str | None = None,
        normalize: bool = False,
        micro_batch_size: int = 8,
        max_length: int = 2048,
        dtype: str = "float32",
        device: str = "cpu",
        offload: bool = False,
        chat_template: bool = True,
        padding_side: Literal["left", "right"] = "right",
        scale: float = 1.0,
        bias: float = 0.0,
        trust_remote_code: bool = False,
        attn_implementation: str | None = "sdpa",
        media: MediaOptions | None = None,
    ) -> None:
        from lightrft.export import resolve_model_dir

        # A training checkpoint of recipes/reward_model.py is exported (once, cached) into the
        # directory its final/ would be: heads, pooling and statistics included.
        path = resolve_model_dir(path, trust_remote_code=trust_remote_code)
        check_local(path)
        # A text model's tokenizer twice, or a vision- or audio-language model's processor.
        processor, tokenizer = load_processors(path, trust_remote_code=trust_remote_code)
        self._options(
            tokenizer, micro_batch_size, max_length, padding_side, chat_template, scale, bias
        )
        # Media only from the conversations' parts, read and bounded as the preference data's
        # options say (checked here, before the weights load).
        samples = MediaSamples(processor, media, given=f"{path} is a text-only reward model")
        multimodal = bool(samples.kinds)  # vision- or audio-language
        if multimodal and not chat_template:
            raise ValueError(
                f"{path} is a vision- or audio-language reward model: it needs chat_template=true "
                "(the chat template places the image and audio tokens, as in its training)"
            )
        if head == "auto":  # an HF classifier, or any export of recipes/reward_model.py
            archs = (checkpoint_config(path) or {}).get("architectures") or []
            classifier = any(a.endswith("ForSequenceClassification") for a in archs)
            head = "classifier" if classifier or read_reward_config(path) else "value_head"
        if head not in ("classifier", "value_head"):
            raise ValueError(f"head must be 'auto', 'classifier' or 'value_head', got {head!r}")
        # Under a process group of several ranks the model is sharded over all of them (FSDP2,
        # parameters only) and scored collectively; in one process it loads whole.
        mesh = build_mesh(None, None, device)
        if mesh is not None and torch.device(device).index is not None:
            raise ValueError(
                f"device={device!r}: a reward model sharded over the ranks runs on each rank's "
                f"own device; give the device type only ({torch.device(device).type!r})"
            )
        load = functools.partial(
            load_reward_net if head == "classifier" else _value_head_net,
            dtype=dtype,
            device=device,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            mesh=mesh,
            offload=offload,
        )
        net = load(path) if head == "classifier" else load(path, value_head_key)
        if multimodal and net.pooling != "likelihood":
            raise ValueError(
                f"{path}: a vision- or audio-language model scores with "
                "pooling='likelihood' only (transformers has no classifier class for it)"
            )
        self._setup(
            net,
            media=samples if multimodal else None,
            score_head=score_head,
            stats=((read_reward_config(path) or {}).get("stats") or {}) if normalize else None,
            device=device,
            offload=offload,
            sharded=mesh is not None,
        )

    @classmethod
    def from_modules(
        cls,
        backbone: nn.Module,
        head: nn.Module,
        tokenizer: Any,
        *,
        micro_batch_size: int = 8,
        max_length: int = 2048,
        device: str | torch.device | None = None,
        chat_template: bool = True,
        padding_side: Literal["left", "right"] = "right",
        scale: float = 1.0,
        bias: float = 0.0,
    ) -> RewardModel:
        """A reward model from an already built backbone (returning ``last_hidden_state``), a
        ``hidden -> 1`` head and a tokenizer, e.g. to share a model object with the recipe."""
        self = cls.__new__(cls)
        self._options(
            tokenizer, micro_batch_size, max_length, padding_side, chat_template, scale, bias
        )
        dev = device if device is not None else next(backbone.parameters()).device
        self._setup(RewardNet(backbone, head), device=dev)
        return self

    def _options(
        self,
        tokenizer,
        micro_batch_size: int,
        max_length: int,
        padding_side: str,
        chat_template: bool,
        scale: float,
        bias: float,
    ) -> None:
        """Refuse a reward model's bad options before its weights load (named, as passed), and
        keep them."""
        at_least("micro_batch_size", micro_batch_size, 1)
        at_least("max_length", max_length, 2)
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the reward model's tokenizer has no chat template; pass "
                "chat_template=False to score prompt + response as plain text"
            )
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.chat_template = chat_template
        self.padding_side = padding_side
        self.scale, self.bias = float(scale), float(bias)
        ids = (tokenizer.pad_token_id, tokenizer.eos_token_id)
        self.pad_id = int(next((i for i in ids if i is not None), 0))  # pad, else eos, else 0

    def _setup(
        self,
        net: RewardNet,
        *,
        media=None,
        score_head: str | None = None,
        stats: dict[str, dict[str, float]] | None = None,
        device,
        offload: bool = False,
        sharded: bool = False,
    ) -> None:
        if score_head is None:
            score_head = net.heads[0]
        if score_head not in net.heads:
            raise ValueError(f"score_head={score_head!r} is not a head of the model: {net.heads}")
        self.head_index = net.heads.index(score_head)
        self.mean, self.std = 0.0, 1.0
        if stats is not None:
            if score_head not in stats:
                raise ValueError(
                    f"normalize=true but the model's config.json has no reward statistics for "
                    f"head {score_head!r} (lightrft_reward.stats); export it with "
                    "recipes/reward_model.py and an eval_dataset"
                )
            self.mean, self.std = float(stats[score_head]["mean"]), float(stats[score_head]["std"])
        self.device = torch.device(device)
        # A sharded model's forward is a collective: every rank calls the model every time
        # (with no samples too); CombinedReward and the recipes read this flag.
        self.collective = sharded
        # Sharded, FSDP2 placed the shards (in CPU memory with offload) and gathers each block
        # to the device as it runs; whole, the model moves to the device only to score.
        self.offload = offload and not sharded
        if not sharded:
            net = net.to("cpu" if offload else self.device)
        self.net = net.eval().requires_grad_(False)
        self.media = media  # MediaSamples of a vision- or audio-language reward model, else None
        self.last_head_scores: dict[str, torch.Tensor] = {}

    def render(self, prompt: Prompt, response: str) -> str:
        """The text the reward model reads for one (prompt, response) pair."""
        return render_for_scoring(
            self.tokenizer, prompt, response, chat_template=self.chat_template
        )

    def encode(
        self, prompts: Sequence[Prompt], responses: Sequence[str]
    ) -> tuple[list[list[int]], list[int] | None]:
        """The token ids the model reads (at most ``max_length``, keeping the end, where the
        score is read) and, for the ``likelihood`` pooling, each one's first response token."""
        texts = [self.render(p, r) for p, r in zip(prompts, responses, strict=True)]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        seqs = [seq[-self.max_length :] for seq in ids]
        if self.net.pooling != "likelihood":
            return seqs, None
        starts = [
            max(
                1,
                response_start(self.tokenizer, p, full, chat_template=self.chat_template)
                - (len(full) - len(seq)),
            )
            for p, full, seq in zip(prompts, ids, seqs, strict=True)
        ]
        return seqs, starts

    def encode_conversations(
        self, conversations: Sequence[Prompt | None], responses: Sequence[str]
    ) -> tuple[list[list[int]], list[int], list[Any]]:
        """A vision- or audio-language reward model's inputs: each (conversation, response)
        rendered and its images, videos and audio expanded as in its preference data; the token ids,
        each one's first response token, and its media (a :class:`~lightrft.data.media.Media`,
        or None)."""
        if any(c is None for c in conversations):
            raise ValueError(
                "a vision- or audio-language reward model renders each sample's conversation "
                "(the chat its prompt came from, with its images and audio); a prompt rendered "
                "without a chat template has none: use apply_chat_template=true in the prompt "
                "dataset"
            )
        src = Records.from_list([{} for _ in conversations], name="sample")
        seqs, starts, processed = [], [], []
        for i, (chat, response) in enumerate(zip(conversations, responses, strict=True)):
            (ids,), (start,), media = encode_with_media(
                self.tokenizer, self.media, src, i, chat, [response]
            )
            if len(ids) > self.max_length:
                raise ValueError(
                    f"sample {i} has {len(ids)} tokens with its media tokens, over the reward "
                    f"model's max_length={self.max_length} (cutting it would cut image, video or "
                    "audio tokens); raise max_length, or lower media.image.max_pixels "
                    "(media.video.max_pixels, media.video.max_frames)"
                )
            seqs.append(ids)
            starts.append(start)
            processed.append(self.media.process(media) if media is not None else None)
        return seqs, starts, processed

    def score_ids(
        self,
        seqs: list[list[int]],
        starts: list[int] | None = None,
        media: Sequence[Media | None] | None = None,
    ) -> torch.Tensor:
        """Rewards [N] (float32, CPU) of token sequences, ``micro_batch_size`` at a time; every
        head's raw scores (``[N]`` each) in ``last_head_scores``. ``starts``: each sequence's
        first response token (``likelihood`` pooling only). ``media``: each sequence's
        :class:`~lightrft.data.media.Media` (or None).

        The micro-batches are :func:`collective_plan`'s. A sharded model's scoring is a
        collective of every rank (one with no samples too): the ranks' samples are gathered, the
        ranks take the planned micro-batches in turn, each rank running as many forwards as
        every other, and the scores are gathered back; this rank's rows are returned."""
        if any(len(s) == 0 for s in seqs):
            raise ValueError("cannot score an empty token sequence")
        if (starts is None) != (self.net.pooling != "likelihood"):
            raise ValueError(
                "starts (the response start of each sequence) go with, and only "
                "with, the likelihood pooling"
            )
        world, rank = 1, 0
        parts = [(seqs, starts, None if media is None else list(media))]
        if self.collective:
            world, rank = dist.get_world_size(), dist.get_rank()
            parts = all_gather_objects(parts[0])  # every rank's samples, in rank order
        all_seqs = [s for p in parts for s in p[0]]
        all_starts = None if starts is None else [x for p in parts for x in p[1]]
        all_media = [m for p in parts for m in (p[2] or [None] * len(p[0]))]
        kinds = [() if m is None else tuple(k for k, _ in m.kinds()) for m in all_media]
        plan = collective_plan([len(s) for s in all_seqs], kinds, self.micro_batch_size, world)
        done: list[tuple[list[int], torch.Tensor]] = []
        if self.offload:
            self.net.to(self.device)
        try:
            with torch.inference_mode():
                for chunk, real in plan[rank::world]:
                    batch = pad_sequences(
                        [all_seqs[i] for i in chunk],
                        self.pad_id,
                        self.padding_side,
                        None if all_starts is None else [all_starts[i] for i in chunk],
                    )
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    # In row order (None: no sample has media); the forward moves the pixels to the
                    # ids' device.
                    batch["media"] = Media.cat([all_media[i] for i in chunk])
                    out = self.net(num_sequences=len(chunk), **batch).float().cpu()  # [b, heads]
                    if real:  # a filler (a copy of a real sample) only pairs the collectives up
                        done.append((chunk, out))
        finally:
            if self.offload:
                self.net.to("cpu")
        scores = torch.empty(len(all_seqs), len(self.net.heads), dtype=torch.float32)
        for part in all_gather_objects(done) if self.collective else [done]:
            for chunk, out in part:
                scores[chunk] = out
        offset = sum(len(p[0]) for p in parts[:rank])
        scores = scores[offset : offset + len(seqs)]  # [N, heads]
        self.last_head_scores = {h: scores[:, k] for k, h in enumerate(self.net.heads)}
        raw = (scores[:, self.head_index] - self.mean) / self.std
        return self.scale * raw + self.bias

    def __call__(self, samples: Sequence[Sample]) -> torch.Tensor:
        if not samples:  # sharded, a collective: join the forwards of the ranks that have samples
            if not self.collective:
                return torch.empty(0)  # nothing to score, so no offloaded model to move
            return self.score_ids([], [] if self.net.pooling == "likelihood" else None)
        responses = [s.response for s in samples]
        if self.media is not None:
            return self.score_ids(
                *self.encode_conversations([s.conversation for s in samples], responses)
            )
        # With the chat template, the chats the prompts were rendered from, where given.
        prompts = [
            s.conversation if self.chat_template and s.conversation is not None else s.prompt
            for s in samples
        ]
        for i, p in enumerate(prompts if self.chat_template else ()):
            if media_parts(p):
                raise ValueError(
                    f"sample {i}'s prompt has images, videos or audio, which a text reward "
                    "model cannot see or hear: score it with a vision- or audio-language "
                    "reward model, or with chat_template=false (the rendered prompt text)"
                )
        return self.score_ids(*self.encode(prompts, responses))
