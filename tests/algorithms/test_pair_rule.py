"""Online DPO's pair rule (lightrft.algorithms.preference.best_worst_pairs): best against worst
per prompt, the margin, ties and identical answers."""

import torch

from lightrft.algorithms.preference import best_worst_pairs


def test_best_against_worst_of_each_prompt():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.2, 0.9, 0.1, 0.4, 0.4], dtype=torch.float64)
    groups = ["a", "a", "a", "b", "b", "b", "c", "c"]
    answers = [str(i) for i in range(8)]
    pairs, unpaired = best_worst_pairs(rewards, groups, answers)
    assert pairs == [(1, 0), (4, 5)]
    assert unpaired == 1  # prompt c: both answers scored 0.4


def test_a_gap_at_most_the_margin_gives_no_pair():
    rewards = torch.tensor([0.0, 0.5, 0.0, 1.0])
    groups = [(0, 0), (0, 0), (0, 1), (0, 1)]  # any hashable keys, consecutive
    pairs, unpaired = best_worst_pairs(rewards, groups, ["w", "x", "y", "z"], 0.5)
    assert (pairs, unpaired) == ([(3, 2)], 1)


def test_ties_take_the_first_and_identical_answers_give_no_pair():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    groups = [0, 0, 0, 0, 1, 1]
    answers = ["p", "q", "r", "s", "same", "same"]  # a noisy reward scored one answer twice
    pairs, unpaired = best_worst_pairs(rewards, groups, answers)
    assert (pairs, unpaired) == ([(0, 2)], 1)


def test_a_prompt_is_a_run_of_equal_keys_and_nothing_gives_nothing():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    pairs, unpaired = best_worst_pairs(rewards, [0, 0, 1, 1], ["a", "b", "a", "b"])
    assert (pairs, unpaired) == ([(0, 1), (2, 3)], 0)
    assert best_worst_pairs(torch.zeros(0), [], []) == ([], 0)
