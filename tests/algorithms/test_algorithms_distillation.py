"""On-policy distillation's advantages and tokenizer check, with hand-derivable numbers."""

from __future__ import annotations

import pytest
import torch

from lightrft.algorithms.distillation import check_same_tokenizer, distillation_advantages


def test_advantage_is_teacher_minus_student_on_sampled_tokens_only():
    student = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, 0.0], [-0.5, -1.5, 7.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])  # an observation / padding
    adv, m = distillation_advantages(student, teacher, mask)
    assert adv.tolist() == [[0.5, -1.0, 0.0], [0.0, -1.0, 0.0]]
    # reverse KL (k1): mean of student - teacher over the 4 sampled tokens = (-0.5 + 1 + 0 + 1) / 4
    assert m["reverse_kl"].item() == pytest.approx(0.375)
    task = torch.full_like(student, 2.0)
    mixed, _ = distillation_advantages(student, teacher, mask, task, reward_weight=0.5)
    assert mixed.tolist() == [[1.5, 0.0, 0.0], [1.0, 0.0, 0.0]]
    same, m = distillation_advantages(student, student, mask)
    assert same.abs().sum() == 0 and m["reverse_kl"].item() == 0.0


class _Tok:
    def __init__(self, vocab, eos=1, specials=("<eos>",)):
        self.vocab, self.eos_token_id, self.all_special_tokens = vocab, eos, list(specials)
        self.pad_token_id = self.bos_token_id = self.unk_token_id = None

    def get_vocab(self):
        return dict(self.vocab)


def test_a_teacher_with_another_tokenizer_is_refused_by_name():
    v = {"a": 0, "<eos>": 1, "b": 2}
    check_same_tokenizer(_Tok(v), _Tok(dict(v)))
    with pytest.raises(ValueError, match="distillation.path: the teacher's vocabulary differs"):
        check_same_tokenizer(_Tok(v), _Tok({**v, "c": 3}))
    with pytest.raises(ValueError, match="distillation.path: the teacher's eos_token_id is 2"):
        check_same_tokenizer(_Tok(v), _Tok(v, eos=2))
    with pytest.raises(ValueError, match="special tokens differ"):
        check_same_tokenizer(_Tok(v), _Tok(v, specials=("<eos>", "b")))
