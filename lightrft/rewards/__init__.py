"""Rewards: rule-based verifiers, in-process reward models, remote reward servers, and their
weighted per-label combination. Each reward function takes a list of :class:`Sample` s and
returns one float per sample."""

from lightrft.rewards.base import (
    CombinedReward,
    RewardError,
    RewardOutput,
    Sample,
    build_reward,
    check_reward_output,
    reward_names,
)
from lightrft.rewards.code import CodeVerifier
from lightrft.rewards.generative import GenerativeReward
from lightrft.rewards.math_answer import answers_match
from lightrft.rewards.remote import RemoteReward, RemoteRewardError
from lightrft.rewards.reward_model import RewardModel
from lightrft.rewards.ttrl import TTRLReward
from lightrft.rewards.verifiers import (
    ChoiceVerifier,
    ExactMatch,
    GSM8KVerifier,
    MathVerifier,
    ThinkFormatReward,
)

__all__ = [
    "ChoiceVerifier",
    "CodeVerifier",
    "CombinedReward",
    "ExactMatch",
    "GSM8KVerifier",
    "GenerativeReward",
    "MathVerifier",
    "RemoteReward",
    "RemoteRewardError",
    "RewardError",
    "RewardModel",
    "RewardOutput",
    "Sample",
    "TTRLReward",
    "ThinkFormatReward",
    "answers_match",
    "build_reward",
    "check_reward_output",
    "reward_names",
]
