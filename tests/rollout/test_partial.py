"""PartialRollouts over the native engine: groups in flight across steps, whole groups out,
per-token policy versions, and continued samples equal to samples generated in one go."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightrft.engine import NativeEngine, Request, SamplingParams
from lightrft.models import load_causal_lm, load_tokenizer
from lightrft.rollout.engine import ColocatedEngine
from lightrft.rollout.partial import PartialRollouts

TEXTS = ["hi", "What is 2 + 2?", "Tell me a story about a cat.", "x", "1 + 1 ="]
SAMPLING = SamplingParams(n=4, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    return [{"prompt_ids": tok(t)["input_ids"], "prompt": t} for t in TEXTS]


def colocated(model) -> ColocatedEngine:
    # One group of 4 fits the 6 cache rows at a time: the budget cuts the next one.
    return ColocatedEngine(NativeEngine(model, max_model_len=128, max_num_seqs=6), None, 0)


def test_continued_groups_equal_groups_generated_in_one_go(tiny_model_dir, prompts):
    engine = colocated(tiny_model_dir)
    partial = PartialRollouts(token_budget=14)
    done, steps, carried, queue = [], 0, 0, list(enumerate(prompts))
    while queue or partial.groups:
        while queue and len(partial.groups) < 2:
            i, item = queue.pop(0)
            partial.add(item, dataclasses.replace(SAMPLING, seed=100 + i), key=(steps, i))
        finished, stats = partial.step(engine, version=0)
        assert stats["rollout/trained_groups"] == len(finished) >= 1
        done += finished
        steps += 1
        carried += stats["rollout/carried_tokens"]
    assert carried > 0 and [g.key[1] for g in done] == [0, 1, 2, 3, 4]
    whole = engine.engine.generate(
        [Request(p["prompt_ids"]) for p in prompts],
        [dataclasses.replace(SAMPLING, seed=100 + i) for i in range(len(prompts))],
    )
    _, completions, keys = PartialRollouts.completions(done)
    assert keys == [g.key for g in done for _ in range(4)]
    for a, b in zip(whole, completions, strict=True):
        assert (a.request_index, a.sample_index) == (b.request_index, b.sample_index)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs))


def test_stale_tokens_keep_the_version_and_logprobs_of_the_policy_that_sampled_them(
    tiny_model_dir, prompts
):
    engine = colocated(tiny_model_dir)
    partial = PartialRollouts(token_budget=10)
    sampling = dataclasses.replace(SAMPLING, max_tokens=4)
    partial.add(prompts[0], dataclasses.replace(sampling, seed=1), key=(1, 0))
    partial.add(prompts[1], dataclasses.replace(sampling, seed=2), key=(1, 1))
    done, stats = partial.step(engine, version=0)
    # The first group ran alone (6 rows hold one group), the second got 2 tokens per sample.
    assert [g.key for g in done] == [(1, 0)] and stats["rollout/unfinished_samples"] == 4
    (waiting,) = partial.groups
    assert [s.versions for s in waiting.samples] == [[0, 0]] * 4
    before = [list(s.logprobs) for s in waiting.samples]
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.engine.load_weights(model.state_dict().items())  # the step's update
    done, stats = partial.step(engine, version=1)
    assert [g.key for g in done] == [(1, 1)]
    for s, lp in zip(done[0].samples, before, strict=True):
        assert s.versions == [0, 0, 1, 1] and s.logprobs[:2] == lp
    assert (stats["rollout/carried_tokens"], stats["rollout/carried_samples"]) == (8, 4)
    assert (stats["rollout/max_policy_versions"], stats["rollout/max_version_lag"]) == (2, 1)
