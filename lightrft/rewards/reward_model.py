"""Scalar reward models scored in-process: a transformer backbone read at the last real token.

Two checkpoint layouts are supported:

- ``classifier``: an HF ``*ForSequenceClassification`` with ``num_labels=1`` (e.g. Skywork-Reward,
  the usual TRL/OpenRLHF export). Its backbone is ``model.base_model`` and its head ``score``.
- ``value_head``: a backbone (``AutoModel``: a causal LM checkpoint works, its LM head is
  ignored) plus a linear ``hidden -> 1`` head whose weight ``{value_head_key}.weight`` (and
  optional bias) lies in one of the directory's ``*.safetensors`` files.

The score is read from the hidden state of the last non-padding token. Pooling is done here, from
the attention mask, rather than by the HF classifier, which locates the last token by
``pad_token_id`` and so misreads sequences that end in a pad-equal EOS. Position ids come from the
mask as well, so left and right padding give the same scores.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightrft.rewards.base import Prompt

__all__ = ["RewardModel", "load_value_head"]

_HEAD_NAMES = ("score", "classifier", "v_head", "value_head")


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
    weight = tensors["weight"].reshape(1, -1)  # [1, H]
    head = nn.Linear(weight.shape[1], 1, bias="bias" in tensors)
    with torch.no_grad():
        head.weight.copy_(weight)
        if "bias" in tensors:
            head.bias.copy_(tensors["bias"].reshape(1))
    return head


def _find_head(model: nn.Module) -> nn.Linear:
    for name in _HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            if head.out_features != 1:
                raise ValueError(
                    f"the reward model's head '{name}' has {head.out_features} "
                    "outputs; a scalar reward model needs num_labels=1"
                )
            return head
    raise ValueError(f"{type(model).__name__} has no linear head named any of {_HEAD_NAMES}")


def _detect_head(path: str | Path) -> str:
    cfg = Path(path) / "config.json"
    archs = (json.loads(cfg.read_text()).get("architectures") or []) if cfg.is_file() else []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "classifier"
    return "value_head"


class RewardModel:
    """A scalar reward model as a reward function: ``rm(prompts, responses, ...) -> Tensor [B]``.

    Each (prompt, response) pair is rendered with the reward model's own chat template (a string
    prompt is one user message; a list is a conversation) and the response appended as the
    assistant turn; with ``chat_template=False`` the texts are concatenated as given. Sequences
    longer than ``max_length`` tokens lose their start, which keeps the response end where the
    score is read. Scoring runs in eval mode under ``torch.inference_mode``, ``micro_batch_size``
    sequences at a time, sorted by length so that little padding is computed.

    Args:
        path: HF directory (or hub id, for ``classifier``) of the reward model.
        head: ``"classifier"``, ``"value_head"`` or ``"auto"`` (classifier if ``config.json``
            names a ``*ForSequenceClassification`` architecture).
        value_head_key: tensor name prefix of the value head (``value_head`` layout only).
        micro_batch_size: sequences per forward pass.
        max_length: most tokens per sequence.
        dtype, device: where and in what precision the model runs.
        chat_template: render with the tokenizer's chat template.
        padding_side: side on which micro-batches are padded; scores do not depend on it.
        scale, bias: returned reward = ``scale * score + bias`` (e.g. to undo an RM's offset).
    """

    name = "reward_model"

    def __init__(
        self,
        path: str,
        head: Literal["auto", "classifier", "value_head"] = "auto",
        value_head_key: str = "value_head",
        micro_batch_size: int = 8,
        max_length: int = 2048,
        dtype: str = "float32",
        device: str = "cpu",
        chat_template: bool = True,
        padding_side: Literal["left", "right"] = "right",
        scale: float = 1.0,
        bias: float = 0.0,
        trust_remote_code: bool = False,
        attn_implementation: str | None = "sdpa",
    ) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification

        from lightrft.models.loading import _check_local, load_tokenizer, to_dtype

        _check_local(path)
        if head == "auto":
            head = _detect_head(path)
        if head not in ("classifier", "value_head"):
            raise ValueError(f"head must be 'auto', 'classifier' or 'value_head', got {head!r}")
        kwargs: dict[str, Any] = {"dtype": to_dtype(dtype), "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        if head == "classifier":
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
            backbone, linear = model.base_model, _find_head(model)
        else:
            backbone = AutoModel.from_pretrained(path, **kwargs)
            linear = load_value_head(path, value_head_key).to(to_dtype(dtype))
        self._setup(
            backbone,
            linear,
            load_tokenizer(path, trust_remote_code=trust_remote_code),
            micro_batch_size=micro_batch_size,
            max_length=max_length,
            device=device,
            chat_template=chat_template,
            padding_side=padding_side,
            scale=scale,
            bias=bias,
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
        dev = device if device is not None else next(backbone.parameters()).device
        self._setup(
            backbone,
            head,
            tokenizer,
            micro_batch_size=micro_batch_size,
            max_length=max_length,
            device=dev,
            chat_template=chat_template,
            padding_side=padding_side,
            scale=scale,
            bias=bias,
        )
        return self

    def _setup(
        self,
        backbone,
        head,
        tokenizer,
        *,
        micro_batch_size,
        max_length,
        device,
        chat_template,
        padding_side,
        scale,
        bias,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the reward model's tokenizer has no chat template; pass "
                "chat_template=False to score prompt + response as plain text"
            )
        self.device = torch.device(device)
        self.backbone = backbone.to(self.device).eval().requires_grad_(False)
        self.head = head.to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.chat_template = chat_template
        self.padding_side = padding_side
        self.scale, self.bias = float(scale), float(bias)
        pad = (
            tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else (tokenizer.eos_token_id)
        )
        self.pad_id = int(pad) if pad is not None else 0

    def render(self, prompt: Prompt, response: str) -> str:
        """The text the reward model reads for one (prompt, response) pair."""
        if not self.chat_template:
            if not isinstance(prompt, str):
                raise ValueError("chat_template=False needs string prompts, got a conversation")
            return prompt + response
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        messages.append({"role": "assistant", "content": response})
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def tokenize(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[list[int]]:
        texts = [self.render(p, r) for p, r in zip(prompts, responses, strict=True)]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [seq[-self.max_length :] for seq in ids]  # keep the end, where the score is read

    def _pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)  # [b, T]
        mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [b, T]
        for row, s in enumerate(seqs):
            cols = (
                slice(0, len(s)) if self.padding_side == "right" else slice(width - len(s), width)
            )
            ids[row, cols] = torch.tensor(s, dtype=torch.long)
            mask[row, cols] = 1
        return ids, mask

    @torch.inference_mode()
    def score_ids(self, seqs: list[list[int]]) -> torch.Tensor:
        """Scores [N] (float32, CPU) of token sequences, ``micro_batch_size`` at a time."""
        if any(len(s) == 0 for s in seqs):
            raise ValueError("cannot score an empty token sequence")
        scores = torch.empty(len(seqs), dtype=torch.float32)  # [N]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        for start in range(0, len(order), self.micro_batch_size):
            chunk = order[start : start + self.micro_batch_size]
            ids, mask = self._pad([seqs[i] for i in chunk])
            ids, mask = ids.to(self.device), mask.to(self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, T], 0 at the first real token
            hidden = self.backbone(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
            ).last_hidden_state  # [b, T, H]
            cols = torch.arange(ids.shape[1], device=self.device)
            last = (mask * cols).argmax(-1)  # [b] index of the last real token
            rows = torch.arange(len(chunk), device=self.device)
            out = self.head(hidden[rows, last]).squeeze(-1)  # [b]
            scores[chunk] = out.float().cpu()
        return self.scale * scores + self.bias

    def __call__(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        references: Sequence[str | None] | None = None,
        labels: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(
                f"prompts has {len(prompts)} entries but responses has {len(responses)}"
            )
        if not responses:
            return torch.empty(0, dtype=torch.float32)
        return self.score_ids(self.tokenize(prompts, responses))
