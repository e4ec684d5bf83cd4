"""Partial rollouts in the native engine: a token budget cuts rows ("partial"), a Resume
continues them by re-prefilling their tokens, token for token as in one go."""

import dataclasses

import pytest
import torch

from lightrft.engine import NativeEngine, Request, Resume, SamplingParams
from lightrft.models import load_causal_lm, load_tokenizer

TEXTS = ["hi", "What is 2 + 2?", "Tell me a story about a cat.", "x"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t)["input_ids"] for t in TEXTS]


def sampling(n: int) -> SamplingParams:
    # FIRE on: the first token's temperature must apply once per sample, not once per call.
    return SamplingParams(n=n, max_tokens=24, seed=7, first_token_temperature=1.5)


def finish_in_pieces(engine, prompts, params, first_budget, budget):
    """Generate under ``first_budget``, then continue every cut row under ``budget`` until none
    is left; the completions in the order of one call."""
    out = engine.generate([Request(p) for p in prompts], params, token_budget=first_budget)
    calls = 1
    while todo := [k for k, c in enumerate(out) if c.finish_reason == "partial"]:
        reqs = [
            Request(
                prompts[out[k].request_index],
                resume=Resume(out[k].sample_index, out[k].token_ids, out[k].logprobs),
            )
            for k in todo
        ]
        one = dataclasses.replace(params, n=1)
        more = engine.generate(reqs, one, token_budget=budget)
        for k, c in zip(todo, more, strict=True):
            assert c.sample_index == out[k].sample_index
            assert c.token_ids[: len(out[k].token_ids)] == out[k].token_ids
            c.request_index = out[k].request_index
            out[k] = c
        calls += 1
    return out, calls


def test_continued_rows_equal_rows_generated_in_one_go(tiny_model_dir, prompts):
    # 5 cache rows, 3 samples per request: requests queue, and the budget cuts some before
    # their first token.
    engine = NativeEngine(tiny_model_dir, max_model_len=256, max_num_seqs=5)
    whole = engine.generate([Request(p) for p in prompts], sampling(3))
    cut = engine.generate([Request(p) for p in prompts], sampling(3), token_budget=23)
    assert engine.stats.sampled_tokens == 24  # the step that spends the budget ends the call
    assert sum(len(c.token_ids) for c in cut) == 24
    assert {c.finish_reason for c in cut} == {"partial"}
    assert [len(c.token_ids) for c in cut][3:] == [0] * 9  # never admitted
    pieces, calls = finish_in_pieces(engine, prompts, sampling(3), 23, 40)
    assert calls > 3
    for a, b in zip(whole, pieces, strict=True):
        assert (a.request_index, a.sample_index) == (b.request_index, b.sample_index)
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        assert a.text == b.text
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs))


@torch.no_grad()
def teacher_forced(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_resumed_logprobs_come_from_the_policy_that_sampled_each_token(tiny_model_dir, prompts):
    old = load_causal_lm(tiny_model_dir).eval()
    engine = NativeEngine(old, max_model_len=256)
    params = SamplingParams(n=1, max_tokens=30, seed=3, ignore_eos=True)
    (cut,) = engine.generate([Request(prompts[1])], params, token_budget=12)
    assert cut.finish_reason == "partial" and len(cut.token_ids) == 12
    new = load_causal_lm(tiny_model_dir).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(new.state_dict().items())  # a weight update between the two steps
    resume = Resume(cut.sample_index, cut.token_ids, cut.logprobs)
    (done,) = engine.generate([Request(prompts[1], resume=resume)], params)
    assert done.finish_reason == "length" and len(done.token_ids) == 30
    assert done.token_ids[:12] == cut.token_ids
    lp = torch.tensor(done.logprobs)
    torch.testing.assert_close(lp[:12], teacher_forced(old, prompts[1], cut.token_ids))
    under_new = teacher_forced(new, prompts[1], done.token_ids)
    torch.testing.assert_close(lp[12:], under_new[12:], atol=1e-5, rtol=1e-5)
    # The first 12 were not sampled by the new policy: their log-probs differ under it.
    assert (lp[:12] - under_new[:12]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e, p: e.generate([Request(p)], sampling(1), token_budget=0), "token_budget"),
        (lambda e, p: e.generate([Request(p)], sampling(1), token_budget=2.5), "an integer"),
        (
            lambda e, p: e.generate(
                [Request(p)], sampling(1), continuation=lambda t: None, token_budget=5
            ),
            "continuation",
        ),
        (
            lambda e, p: e.generate([Request(p, resume=Resume(0, [5], [-1.0]))], sampling(2)),
            "one sample",
        ),
        (
            lambda e, p: e.generate([Request(p, resume=Resume(0, [5, 6], [-1.0]))], sampling(1)),
            "2 token ids but 1 logprobs",
        ),
        (
            lambda e, p: e.generate(
                [Request(p, resume=Resume(0, [5] * 24, [0.0] * 24))], sampling(1)
            ),
            "nothing is left",
        ),
        (
            lambda e, p: e.generate([Request(p, resume=Resume(0, [10**6], [0.0]))], sampling(1)),
            "resume.token_ids holds 1000000",
        ),
    ],
)
def test_bad_budgets_and_resumes_are_refused(tiny_model_dir, prompts, call, message):
    engine = NativeEngine(tiny_model_dir, max_model_len=256)
    with pytest.raises(ValueError, match=message):
        call(engine, prompts[0])


def test_a_resumed_row_hands_its_own_sample_index_to_the_continuation(tiny_model_dir, prompts):
    # A resumed request is one row, sample `Resume.sample_index` of its request: the turn the
    # continuation sees must say so (an environment keys its episode on it), not sample 0.
    engine = NativeEngine(tiny_model_dir, max_model_len=256, max_num_seqs=4)
    first = engine.generate([Request(prompts[1])], SamplingParams(n=3, max_tokens=4, seed=3))[2]
    seen = []

    def record(turn):
        seen.append((turn.request_index, turn.sample_index, turn.turn_index))
        return None

    every_token_stops = list(range(engine.vocab_size))
    params = SamplingParams(max_tokens=24, seed=3, stop_token_ids=every_token_stops)
    resume = Resume(first.sample_index, first.token_ids, first.logprobs)
    out = engine.generate(
        [Request(prompts[0]), Request(prompts[1], resume=resume)], params, continuation=record
    )
    assert [c.sample_index for c in out] == [0, 2]
    assert sorted(seen) == [(0, 0, 0), (1, 2, 0)]
