"""Test-time RL (TTRL; Zuo et al. 2025, arXiv:2504.16084): rewards for prompts without labels.

The majority answer of a prompt's group of samples is taken as its pseudo-label and each
sample is rewarded for agreeing with it. The recipe lays samples out as groups of ``rollout.n``
consecutive samples of one prompt; the reward reads the groups from that layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from lightrft.config import at_least
from lightrft.rewards.base import Prompt, Sample, instantiate_node, prompt_preview
from lightrft.rewards.math_answer import answer_key, majority_vote


def split_groups(prompts: Sequence[Prompt], group_size: int | None) -> list[range]:
    """Index ranges of the groups: ``group_size`` consecutive samples (which must share their
    prompt), or, with ``None``, each run of consecutive samples with the same prompt."""
    n = len(prompts)
    if group_size is None:  # runs of equal prompts (compared with ==: a chat is a list)
        runs = [list(run) for _, run in itertools.groupby(range(n), key=prompts.__getitem__)]
        return [range(run[0], run[-1] + 1) for run in runs]
    if group_size < 1 or n % group_size:
        raise ValueError(
            f"TTRLReward: {n} samples do not split into groups of group_size={group_size}; "
            "the reward must see whole groups of consecutive samples"
        )
    groups = [range(s, s + group_size) for s in range(0, n, group_size)]
    for g in groups:
        bad = [i for i in g if prompts[i] != prompts[g.start]]
        if bad:
            raise ValueError(
                f"TTRLReward: sample {bad[0]} (prompt {prompt_preview(prompts[bad[0]])}) is in "
                f"the group of sample {g.start} (prompt {prompt_preview(prompts[g.start])}); "
                f"groups must be {group_size} consecutive samples of one prompt"
            )
    return groups


class TTRLReward:
    """Agreement with the group's majority answer.

    Args:
        verifier: supplies ``extract(response)`` (the answer; ``extract_many(responses)`` is
            used instead where it has one) and, if it has one,
            ``equivalent_many(preds, refs)`` to judge agreement (else answers agree when their
            :func:`~lightrft.rewards.math_answer.answer_key` is equal). E.g. a
            :class:`~lightrft.rewards.MathVerifier` (a ``_component_`` mapping is instantiated).
        group_size: samples per prompt (``${rollout.n}`` in a GRPO config), checked strictly;
            ``None`` (the default, and what a GRPO config with an eval set needs, since eval has
            one sample per prompt) groups consecutive samples with the same prompt.
        min_vote_share: a group whose majority answer has fewer than this share of the group's
            votes (samples without an answer count in the denominator) gets ``incorrect`` for
            every sample: no confident pseudo-label, no signal.
        correct, incorrect: rewards for agreeing / not agreeing.

    References are not read (the prompts are unlabelled).
    """

    name = "ttrl"
    requires_reference = False

    def __init__(
        self,
        verifier: Any,
        group_size: int | None = None,
        min_vote_share: float = 0.0,
        correct: float = 1.0,
        incorrect: float = 0.0,
    ) -> None:
        if isinstance(verifier, Mapping):  # a nested {_component_: ...} from YAML
            verifier = instantiate_node(verifier)
        if not callable(getattr(verifier, "extract", None)):
            raise ValueError(
                f"verifier must have an extract(response) method, {type(verifier).__name__} has not"
            )
        at_least("group_size", group_size, 1)
        if not 0.0 <= min_vote_share <= 1.0:
            raise ValueError(f"min_vote_share must be in [0, 1], got {min_vote_share}")
        self.verifier = verifier
        self.group_size = group_size
        self.min_vote_share = float(min_vote_share)
        self.correct = float(correct)
        self.incorrect = float(incorrect)
        self.last_labels: list[str | None] = []  # pseudo-label of each group of the last call
        # Logged by CombinedReward as reward/ttrl/<key>: how often a group had a label and how
        # strongly its samples agreed (the majority's share of the group).
        self.last_metrics: dict[str, float] = {}

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        responses = [s.response for s in samples]
        extract_many = getattr(self.verifier, "extract_many", None)  # spreads over workers
        if callable(extract_many):
            answers = list(extract_many(responses))
        else:
            answers = [self.verifier.extract(r) for r in responses]
        rewards = [self.incorrect] * len(responses)
        self.last_labels = []
        shares = []
        groups = split_groups([s.prompt for s in samples], self.group_size)
        for g in groups:
            group = [answers[i] for i in g]
            label, votes = majority_vote(group)
            shares.append(votes / len(g))
            if votes < self.min_vote_share * len(g):
                label = None  # too small a share: no pseudo-label
            self.last_labels.append(label)
            if label is None:
                continue
            if hasattr(self.verifier, "equivalent_many"):
                agree = self.verifier.equivalent_many(group, [label] * len(group))
            else:
                key = answer_key(label)
                agree = [p is not None and answer_key(p) == key for p in group]
            for i, ok in zip(g, agree, strict=True):
                rewards[i] = self.correct if ok else self.incorrect
        labelled = sum(label is not None for label in self.last_labels)
        self.last_metrics = {
            "labelled_groups": labelled / max(len(groups), 1),
            "vote_share": sum(shares) / max(len(shares), 1),
        }
        return rewards
