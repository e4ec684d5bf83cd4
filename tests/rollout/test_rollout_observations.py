"""Observation tokens of a multi-turn trajectory: in the forward pass's inputs, out of the loss,
the KL, the entropy, the advantages and every normalising count. Hand-derived numbers over a
two-row batch: row 0 is a two-turn trajectory (assistant 5 6, observation 7 8, assistant 9),
row 1 a one-turn one (5 6); rewards 1 and 0, one group of two."""

from __future__ import annotations

import math
import runpy
from pathlib import Path
from types import SimpleNamespace

import torch

from lightrft.algorithms.config import AlgorithmConfig
from lightrft.engine import Completion, SamplingParams
from lightrft.rollout import RolloutBatch
from lightrft.rollout.batch import Precomputed
from lightrft.rollout.micro import Counts, LossInputs, build_micro_batch

GRPO = runpy.run_path(str(Path(__file__).parents[2] / "recipes" / "grpo.py"), run_name="grpo_t")
SAMPLED = [True, True, False, False, True]


def _completion(index: int, ids: list[int], sampled: list[bool] | None, logprobs: list[float]):
    return Completion(
        request_index=index,
        sample_index=0,
        prompt_token_ids=[1, 2],
        token_ids=ids,
        logprobs=logprobs,
        finish_reason="stop",
        text="t",
        sampled_mask=sampled,
    )


def _batch() -> RolloutBatch:
    completions = [
        _completion(0, [5, 6, 7, 8, 9], SAMPLED, [-1.0, -2.0, 0.0, 0.0, -3.0]),
        _completion(0, [5, 6], [True, True], [-1.0, -2.0]),
    ]
    prompts = {k: ["p"] for k in ("prompt", "reference", "label", "where")}
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    return RolloutBatch.from_completions(
        completions,
        prompts,
        groups=[("g",), ("g",)],
        reward_raw=rewards,
        rewards=rewards,
        reward_parts={},
        reward_applied={},
    )


def _algorithm(**over) -> AlgorithmConfig:
    node = {"advantage": {"estimator": "dr_grpo"}, **over}
    return AlgorithmConfig.read(node, "algorithm.").for_rollout(SamplingParams(n=2, max_tokens=8))


def test_lengths_count_observations_and_the_mask_only_sampled_tokens():
    b = _batch()
    assert b.response_lens.tolist() == [5, 2]
    assert b.response_mask.tolist() == [SAMPLED, [True, True, False, False, False]]
    assert b.response(0) == [5, 6, 7, 8, 9]  # the forward pass sees the observation
    # A single-turn completion (sampled_mask None) masks its whole response, as before.
    single = RolloutBatch.from_completions(
        [_completion(0, [5, 6, 7], None, [-1.0] * 3)],
        {k: ["p"] for k in ("prompt", "reference", "label", "where")},
        groups=[("g",)],
        reward_raw=torch.zeros(1, dtype=torch.float64),
        rewards=torch.zeros(1, dtype=torch.float64),
        reward_parts={},
        reward_applied={},
    )
    assert single.response_mask.tolist() == [[True] * 3] and single.response_lens.tolist() == [3]
    s = b.select([1, 0])
    assert s.response_lens.tolist() == [2, 5] and s.response_mask[1].tolist() == SAMPLED


def test_micro_batch_inputs_hold_observations_and_the_mask_does_not():
    b = _batch()
    for packing in (True, False):
        mb = build_micro_batch(b, [0, 1], 0, packing=packing)
        assert mb.tokens == (2 + 5) + (2 + 2)
        assert mb.mask.tolist() == [SAMPLED, [True, True, False, False, False]], packing
        # The next-token targets at the sampled positions are the sampled ids; the gather
        # zeroes observation positions as the engine's log-probs are 0 there.
        assert mb.gather(mb.targets).tolist() == [[5, 6, 0, 0, 9], [5, 6, 0, 0, 0]]


def test_counts_advantages_and_loss_see_assistant_tokens_only():
    b = _batch()
    alg = _algorithm(kl={"coef": 0.1, "estimator": "k3"}, entropy={"coef": 0.01})
    me = SimpleNamespace(
        opts=SimpleNamespace(algorithm=alg, rollout=SimpleNamespace(n=2), distillation=None),
        dist=SimpleNamespace(world_size=1),
        normalizer=None,
        kl_ctl=SimpleNamespace(coef=0.1),
    )
    counts = Counts.of(b, [0, 1], me.dist.world_size, None)
    assert counts.loss == {"num_tokens": 5.0, "num_seqs": 2.0}  # 3 + 2 sampled, not 7
    assert counts.response == {"num_tokens": 5.0, "num_seqs": 2.0}

    adv, metrics = GRPO["GRPORecipe"].advantages(me, b, Precomputed())
    # dr_grpo: reward - group mean = +0.5 / -0.5 on sampled tokens, 0 on observations.
    assert adv.advantages.tolist() == [[0.5, 0.5, 0.0, 0.0, 0.5], [-0.5, -0.5, 0.0, 0.0, 0.0]]
    assert math.isclose(metrics["train/advantage/mean"], (3 * 0.5 - 2 * 0.5) / 5, rel_tol=1e-6)

    mb = build_micro_batch(b, [0, 1], 0, packing=True)
    big = 100.0  # what an observation position holds, if anything counted it
    logprobs = torch.tensor([[-1.0, -2.0, big, big, -3.0], [-1.0, -2.0, big, big, big]])
    ref = torch.tensor([[-2.0, -2.0, -big, -big, -3.0], [-1.0, -2.0, -big, -big, -big]])
    entropy = torch.tensor([[1.0, 1.0, big, big, 1.0], [1.0, 1.0, big, big, big]])
    inputs = LossInputs(
        logprobs=logprobs.requires_grad_(),
        entropy=entropy,
        mask=mb.mask,
        loss_mask=mb.mask,
        advantages=adv.advantages,
        old_logprobs=None,
        rollout_logprobs=None,
        ref_logprobs=ref,
        values=None,
        old_values=None,
        returns=None,
    )
    loss, m = GRPO["GRPORecipe"].loss(me, inputs, counts)
    # On-policy ppo, token_mean: -(sum of sampled advantages) / 5 sampled tokens.
    policy = -(3 * 0.5 - 2 * 0.5) / 5
    # k3 at the one sampled token where they differ: exp(-1) + 1 - 1; token_mean over 5.
    kl_token = math.exp(-1.0)
    expected = policy - 0.01 * (5 * 1.0) / 5 + 0.1 * kl_token / 5
    assert math.isclose(float(loss.detach()), expected, rel_tol=1e-6)
    assert math.isclose(float(m["policy_loss"]), policy, rel_tol=1e-6)
    assert float(m["entropy"]) == 1.0  # the observations' 100s are not in the mean
    # kl metric: per sequence mean then mean: (e^-1 / 3 + 0) / 2
    assert math.isclose(float(m["kl"]), kl_token / 3 / 2, rel_tol=1e-6)
    loss.backward()
    grad = inputs.logprobs.grad
    assert grad[0, 2:4].abs().sum() == 0 and grad[1, 2:].abs().sum() == 0
