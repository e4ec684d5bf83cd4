"""On-policy distillation: the student samples, a frozen teacher grades every sampled token.

The per-token advantage is the negative reverse-KL estimate ``log p_teacher(y_t) -
log p_student(y_t)`` on the student's own samples (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes" (GKD); Lu and Thinking Machines Lab 2025,
"On-Policy Distillation"; the ``distillation`` estimators of verl and slime), optionally plus the
task advantage at a weight. A policy-gradient step on it lowers the reverse KL to the teacher.
It needs no group (``rollout.n: 1`` works) and grades only sampled tokens: observation tokens of a
multi-turn episode are outside the response mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightrft.config import Section, option, section


@section
class DistillationConfig(Section):
    """``distillation:``: the teacher (the section switches on-policy distillation on)."""

    # Optional in the schema (the section itself is), required when the section is given.
    path: str | None = option(None, doc="the teacher: a causal LM with the student's tokenizer")
    reward_weight: float = option(0.0, ge=0, doc="+ this x the task advantage (0: teacher only)")

    def resolve(self, at: str) -> DistillationConfig:
        if not self.path:
            raise ValueError(f"{at}path: the distillation section needs the teacher's path")
        return self


def check_same_tokenizer(student: Any, teacher: Any, key: str = "distillation.path") -> None:
    """Refuse a teacher whose tokenizer differs from the student's: the same vocabulary (token ->
    id) and the same special tokens (EOS, padding, BOS and the rest), so that a token id means the
    same text to both. ``ValueError`` naming ``key`` and the first difference."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only = sorted(set(sv.items()) ^ set(tv.items()), key=str)[:3]
        raise ValueError(
            f"{key}: the teacher's vocabulary differs from the student's ({len(tv)} vs "
            f"{len(sv)} tokens; e.g. {only}); distillation needs the same tokenizer"
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            raise ValueError(
                f"{key}: the teacher's {name} is {getattr(teacher, name, None)}, the student's "
                f"{getattr(student, name, None)}; distillation needs the same special tokens"
            )
    if sorted(map(str, student.all_special_tokens)) != sorted(map(str, teacher.all_special_tokens)):
        raise ValueError(f"{key}: the teacher's special tokens differ from the student's")


def distillation_advantages(
    student: Tensor,
    teacher: Tensor,
    mask: Tensor,
    task_advantages: Tensor | None = None,
    reward_weight: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token advantages ``[B, R]``: ``teacher - student`` on sampled tokens (0 elsewhere),
    plus ``reward_weight * task_advantages``; and ``reverse_kl``, the mean of ``student -
    teacher`` over the sampled tokens (the k1 estimate of KL(student || teacher) per token).

    ``student``, ``teacher``: log-probs of the sampled tokens ``[B, R]``; ``mask``: bool
    ``[B, R]``, True on sampled tokens."""
    valid = mask.bool()
    adv = torch.where(valid, teacher.float() - student.float(), 0.0)  # [B, R]
    kl = -adv.sum() / valid.sum().clamp(min=1)
    if task_advantages is not None and reward_weight:
        adv = adv + reward_weight * torch.where(valid, task_advantages.float(), 0.0)
    return adv, {"reverse_kl": kl.detach()}
