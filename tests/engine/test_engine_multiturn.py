"""Multi-turn generation on the native engine: a trajectory goes on after an observation.

The continuations here are deterministic stand-ins for an environment (fixed observation ids per
turn); the references regenerate every turn from scratch, re-prefilling prompt + response so far.
"""

import threading
import time
from dataclasses import replace

import pytest
import torch

from lightrft.engine import NativeEngine, Request, SamplingParams, Turn
from lightrft.models import load_causal_lm, load_tokenizer
from lightrft.models.forward import causal_lm_token_logprobs

TEXTS = ["hi", "What is 2 + 2?", "Tell me a story about a cat.", "x"]
STOPS = [42, 87, 12]  # ids the tiny model emits greedily within a few tokens
OBS = [[32, 83, 70], [5, 6, 7, 8, 9, 10, 11], [40]]


def observations(turn: Turn) -> list[int] | None:
    """Two observations per trajectory, of lengths that differ between requests."""
    if turn.turn_index >= 2:
        return None
    return OBS[(turn.request_index + turn.turn_index) % len(OBS)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return NativeEngine(tiny_model_dir, max_model_len=256)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


def from_scratch(engine, prompt, sp, request_index, continuation=observations):
    """The trajectory turn by turn, each turn a fresh single-turn call on prompt + response."""
    resp, lps, spans = [], [], []
    while True:
        (c,) = engine.generate(
            [Request(prompt + resp)], replace(sp, max_tokens=sp.max_tokens - len(resp))
        )
        spans.append((len(resp), len(resp) + len(c.token_ids)))
        resp, lps = resp + c.token_ids, lps + c.logprobs
        if c.finish_reason == "length" or len(spans) == sp.max_turns:
            return resp, lps, spans, c.finish_reason
        obs = continuation(Turn(request_index, 0, len(spans) - 1, c.token_ids, [], resp, 0))
        if obs is None:
            return resp, lps, spans, "stop"
        if len(resp) + len(obs) + 1 > sp.max_tokens:
            return resp, lps, spans, "length"  # the observation does not fit: dropped
        resp, lps = resp + obs, lps + [0.0] * len(obs)


def test_greedy_trajectories_equal_turn_by_turn_reprefill(engine, prompts):
    sp = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=STOPS)
    outs = engine.generate([Request(p) for p in prompts], sp, continuation=observations)
    assert [(c.request_index, c.sample_index) for c in outs] == [(i, 0) for i in range(4)]
    assert sum(c.num_turns for c in outs) >= 9  # the continuation really was exercised
    for c in outs:
        ids, lps, spans, reason = from_scratch(engine, c.prompt_token_ids, sp, c.request_index)
        assert c.token_ids == ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), atol=1e-5, rtol=0)
        assert c.turn_spans == spans and c.finish_reason == reason
        assert c.sampled_mask == [any(a <= k < b for a, b in spans) for k in range(len(ids))]
        for turn in range(1, len(spans)):  # the observation before each later turn
            b, a = spans[turn - 1][1], spans[turn][0]
            assert ids[b:a] == OBS[(c.request_index + turn - 1) % len(OBS)]
            assert c.logprobs[b:a] == [0.0] * (a - b)
            assert ids[b - 1] in STOPS  # a turn hands over only at a stop token


def test_sampled_logprobs_equal_the_trainer_path(tiny_model_dir, engine, prompts):
    model = load_causal_lm(tiny_model_dir).eval()
    sp = SamplingParams(n=3, temperature=0.7, max_tokens=48, stop_token_ids=STOPS, seed=5)
    outs = engine.generate([Request(p) for p in prompts], sp, continuation=observations)
    assert any(c.num_turns > 1 for c in outs)
    for c in outs:
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            ref = causal_lm_token_logprobs(model, ids, temperature=0.7)[0]
        ref = ref[len(c.prompt_token_ids) - 1 :]
        mask = torch.tensor(c.sampled_mask)
        torch.testing.assert_close(torch.tensor(c.logprobs)[mask], ref[mask], atol=1e-5, rtol=0)


def test_a_slow_continuation_does_not_hold_up_the_wave(engine, prompts):
    # Request 1's first turn ends at once (its second token); its continuation returns only
    # after another row has finished a later turn (or fails after 10 s): were the engine waiting
    # on it, no other row could get there.
    slow_started, progressed = threading.Event(), threading.Event()

    def continuation(turn):
        if (turn.request_index, turn.turn_index) == (1, 0):
            slow_started.set()
            assert progressed.wait(timeout=10), "the wave stopped while row 1 waited"
        elif slow_started.is_set() and turn.turn_index >= 1:
            progressed.set()
        return observations(turn)

    sp = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=STOPS)
    outs = engine.generate([Request(p) for p in prompts], sp, continuation=continuation)
    assert progressed.is_set() and outs[1].num_turns == 3
    # Timing changed nothing: the same trajectories as with instant continuations.
    want = engine.generate([Request(p) for p in prompts], sp, continuation=observations)
    assert [c.token_ids for c in outs] == [c.token_ids for c in want]


def test_max_tokens_bounds_the_whole_response(engine, prompts):
    calls = []

    def always(turn):
        calls.append(turn)
        return [5, 6, 7, 8, 9]

    sp = SamplingParams(n=2, temperature=1, max_tokens=30, stop_token_ids=STOPS, seed=2)
    outs = engine.generate([Request(p) for p in prompts], sp, continuation=always)
    assert all(len(c.token_ids) <= 30 and c.finish_reason == "length" for c in outs)
    assert all(c.sampled_mask[-1] for c in outs)  # an observation never ends a response
    for t in calls:
        assert t.max_observation_tokens == 30 - len(t.response_token_ids) - 1
    # A turn that ends at a stop token with too little room left: its observation is dropped.
    dropped = [c for c in outs if c.token_ids[-1] in STOPS and len(c.token_ids) > 25]
    assert dropped and all(c.finish_reason == "length" for c in dropped)


def test_max_turns_ends_the_trajectory(engine, prompts):
    calls = []

    def always(turn):
        calls.append((turn.request_index, turn.sample_index, turn.turn_index))
        return [5, 6]

    sp = SamplingParams(
        n=2, temperature=0, max_tokens=80, stop_token_ids=STOPS, max_turns=2, seed=1
    )
    outs = engine.generate([Request(p) for p in prompts], sp, continuation=always)
    assert all(c.num_turns <= 2 for c in outs)
    two = [c for c in outs if c.num_turns == 2 and c.token_ids[-1] in STOPS]
    assert two and all(c.finish_reason == "stop" for c in two)
    assert all(t == 0 for _, _, t in calls)  # never asked after the last allowed turn
    with pytest.raises(ValueError, match=r"SamplingParams\.max_turns must be an integer >= 1"):
        engine.generate([Request(prompts[0])], replace(sp, max_turns=0), continuation=always)


def test_max_model_len_bounds_prompt_and_response(tiny_model_dir, prompts):
    eng = NativeEngine(tiny_model_dir, max_model_len=40)
    sp = SamplingParams(temperature=0, max_tokens=100, stop_token_ids=STOPS)
    (c,) = eng.generate([Request(prompts[1])], sp, continuation=lambda t: [5, 6, 7])
    assert len(c.prompt_token_ids) + len(c.token_ids) == 40
    assert c.finish_reason == "length" and c.num_turns >= 2


def test_without_observations_single_and_multi_turn_agree(engine, prompts):
    sp = SamplingParams(n=3, temperature=0.9, max_tokens=40, stop_token_ids=STOPS, seed=4)
    reqs = [Request(p) for p in prompts]
    single = engine.generate(reqs, sp)
    multi = engine.generate(reqs, sp, continuation=lambda t: None)
    for a, b in zip(single, multi, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bitwise
        assert a.finish_reason == b.finish_reason
        assert a.sampled_mask is None and a.turn_spans is None and a.num_turns == 1
        assert b.sampled_mask == [True] * len(b.token_ids)
        assert b.turn_spans == [(0, len(b.token_ids))]


def test_seeded_trajectories_do_not_depend_on_the_batch(tiny_model_dir, engine, prompts):
    def same_for_all(turn):
        return OBS[turn.turn_index] if turn.turn_index < 2 else None

    sp = SamplingParams(n=2, temperature=1.0, max_tokens=50, stop_token_ids=STOPS, seed=7)
    alone = engine.generate([Request(prompts[1])], sp, continuation=same_for_all)
    crowd_params = [SamplingParams(n=3, max_tokens=30, seed=9), sp, SamplingParams(seed=2), sp]
    reqs = [Request(p) for p in prompts]
    crowd = engine.generate(reqs, crowd_params, continuation=same_for_all)
    narrow = NativeEngine(tiny_model_dir, max_model_len=256, max_num_seqs=2)
    waves = narrow.generate(reqs, crowd_params, continuation=same_for_all)
    for other in (crowd, waves):
        again = [c for c in other if c.request_index == 1]
        assert [c.token_ids for c in again] == [c.token_ids for c in alone]
        assert [c.turn_spans for c in again] == [c.turn_spans for c in alone]
        for a, b in zip(alone, again, strict=True):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0
            )
    assert any(c.num_turns > 1 for c in alone)


def test_admission_beside_rows_waiting_on_their_tools(tiny_model_dir, engine, prompts):
    """Through 4 cache rows, rows waiting on a slow continuation keep their cache rows while
    requests are admitted into the rows finished samples free: every trajectory equals its
    request generated alone."""

    def slow(turn):  # depends on the trajectory only, not on its index in the call
        time.sleep(0.002 * (len(turn.token_ids) % 3))
        if turn.turn_index >= 2:
            return None
        return OBS[(len(turn.token_ids) + turn.turn_index) % len(OBS)]

    budgets = [50, 8, 30, 5, 12, 40]
    reqs = [Request(prompts[k % 4]) for k in range(len(budgets))]
    sps = [
        SamplingParams(
            n=1 + k % 2, temperature=1.0, max_tokens=m, stop_token_ids=STOPS, seed=30 + k
        )
        for k, m in enumerate(budgets)
    ]
    narrow = NativeEngine(tiny_model_dir, max_model_len=256, max_num_seqs=4)
    outs = narrow.generate(reqs, sps, continuation=slow)
    assert narrow.stats.admitted_while_decoding >= 2
    assert sum(c.num_turns > 1 for c in outs) >= 3
    for k, (req, sp) in enumerate(zip(reqs, sps, strict=True)):
        alone = engine.generate([req], [sp], continuation=slow)
        mine = [c for c in outs if c.request_index == k]
        assert [c.token_ids for c in mine] == [c.token_ids for c in alone]
        assert [c.turn_spans for c in mine] == [c.turn_spans for c in alone]
        for a, b in zip(mine, alone, strict=True):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
            )


def test_bad_observations_are_refused(engine, prompts):
    sp = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=STOPS)
    reqs = [Request(prompts[1])]
    with pytest.raises(ValueError, match=r"request 0 sample 0 is a str; return a list"):
        engine.generate(reqs, sp, continuation=lambda t: "42")
    with pytest.raises(ValueError, match=r"holds 5000, not a token id"):
        engine.generate(reqs, sp, continuation=lambda t: [1, 5000])
    with pytest.raises(RuntimeError, match="tool broke"):
        engine.generate(
            reqs, sp, continuation=lambda t: (_ for _ in ()).throw(RuntimeError("tool broke"))
        )


def test_an_empty_observation_lets_the_row_go_on(engine, prompts):
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=STOPS, max_turns=3)
    (c,) = engine.generate([Request(prompts[1])], sp, continuation=lambda t: [])
    ids, lps, spans, reason = from_scratch(engine, prompts[1], sp, 1, continuation=lambda t: [])
    assert c.num_turns == 3 and c.turn_spans == spans and c.token_ids == ids
    assert all(b == a for (_, b), (a, _) in zip(spans, spans[1:], strict=False))
    assert c.sampled_mask == [True] * len(ids)


def test_each_token_is_fed_to_the_model_once(engine, prompts):
    """No re-prefill: the prompt, every observation and every sampled token but the last go
    through the model exactly once."""
    fed = []
    hook = engine.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _o: fed.append(args[0].numel())
    )
    try:
        sp = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=STOPS)
        (c,) = engine.generate([Request(prompts[3])], sp, continuation=observations)
    finally:
        hook.remove()
    assert c.num_turns >= 2
    assert sum(fed) == len(c.prompt_token_ids) + len(c.token_ids) - 1
