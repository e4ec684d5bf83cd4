"""NativeEngine on tiny HF models: sampling semantics against the HF model, sleep / wake, errors."""

import pytest
import torch

from lightrft.engine import Completion, Engine, NativeEngine, Request, SamplingParams
from lightrft.models import load_causal_lm, load_tokenizer

TEXTS = ["hi", "What is 2 + 2?", "Tell me a story about a cat.", "x"]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return NativeEngine(tiny_model_dir, max_model_len=256)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t)["input_ids"] for t in TEXTS]


def requests_of(prompts):
    return [Request(list(p)) for p in prompts]


@torch.no_grad()
def hf_logits(model, ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()  # [L, V]


@torch.no_grad()
def hf_greedy(model, prompt, steps, stop_ids):
    ids, out = list(prompt), []
    for _ in range(steps):
        t = int(hf_logits(model, ids)[-1].argmax())
        out.append(t)
        ids.append(t)
        if t in stop_ids:
            break
    return out


def teacher_forced(model, prompt, response, temps):
    """Log-probs of ``response`` given ``prompt``; ``temps[i]`` scales the logits of token i."""
    logits = hf_logits(model, list(prompt) + list(response))[len(prompt) - 1 : -1]
    logits = logits / torch.tensor(temps)[:, None]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, Engine)


def test_greedy_equals_hf_argmax_decoding(engine, hf, prompts):
    outs = engine.generate(requests_of(prompts), SamplingParams(temperature=0, max_tokens=24))
    assert [(c.request_index, c.sample_index) for c in outs] == [(i, 0) for i in range(4)]
    for c, p in zip(outs, prompts, strict=True):
        assert c.prompt_token_ids == p
        assert c.token_ids == hf_greedy(hf, p, 24, set(engine.eos_token_ids))
        ref = teacher_forced(hf, p, c.token_ids, [1.0] * len(c.token_ids))
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5)
        assert c.finish_reason == ("stop" if c.token_ids[-1] in engine.eos_token_ids else "length")


def test_greedy_equals_hf_on_llama(tiny_llama_dir):
    hf = load_causal_lm(tiny_llama_dir).eval()
    eng = NativeEngine(tiny_llama_dir, max_model_len=128)
    prompt = load_tokenizer(tiny_llama_dir)("a llama prompt")["input_ids"]
    (c,) = eng.generate([Request(prompt)], SamplingParams(temperature=0, max_tokens=16))
    assert c.token_ids == hf_greedy(hf, prompt, 16, set(eng.eos_token_ids))


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_sampled_logprobs_equal_teacher_forced_hf(engine, hf, prompts, temp):
    sp = SamplingParams(n=3, temperature=temp, max_tokens=20, seed=11)
    outs = engine.generate(requests_of(prompts), sp)
    assert len(outs) == 12
    for c in outs:
        ref = teacher_forced(hf, c.prompt_token_ids, c.token_ids, [temp] * len(c.token_ids))
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5)


def test_top_k_top_p_logprobs_are_renormalised_over_the_kept_set(engine, hf, prompts):
    sp = SamplingParams(temperature=0.9, top_k=7, top_p=0.6, max_tokens=12, seed=3, n=2)
    for c in engine.generate(requests_of(prompts[:2]), sp):
        logits = hf_logits(hf, c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1 : -1]
        for pos, (t, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            row = logits[pos] / 0.9
            order = row.argsort(descending=True)[:7]
            probs = row[order].softmax(-1)
            before = probs.cumsum(-1) - probs
            kept = order[before < 0.6].tolist()
            assert t in kept  # never samples outside the top-k / nucleus set
            want = row[kept].log_softmax(-1)[kept.index(t)]
            assert abs(lp - float(want)) < 1e-5


def test_top_k_one_is_greedy(engine, prompts):
    greedy = engine.generate(requests_of(prompts), SamplingParams(temperature=0, max_tokens=10))
    top1 = engine.generate(
        requests_of(prompts), SamplingParams(temperature=1.3, top_k=1, max_tokens=10, seed=5)
    )
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]
    assert all(abs(x) < 1e-6 for c in top1 for x in c.logprobs)  # one kept token: prob 1


def test_same_seed_same_output_whatever_the_batch(engine, prompts):
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=1234)
    alone = engine.generate([Request(prompts[1])], sp)
    crowd = engine.generate(
        requests_of(prompts),
        [SamplingParams(n=3, max_tokens=30, seed=9), sp, SamplingParams(), SamplingParams(seed=2)],
    )
    again = [c for c in crowd if c.request_index == 1]
    assert [c.token_ids for c in alone] == [c.token_ids for c in again]
    for a, b in zip(alone, again, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)
    assert alone[0].token_ids != alone[1].token_ids  # the n samples use different streams
    other = engine.generate([Request(prompts[1])], SamplingParams(n=2, max_tokens=24, seed=99))
    assert [c.token_ids for c in other] != [c.token_ids for c in alone]


def test_unseeded_requests_follow_the_engine_seed(tiny_model_dir, prompts):
    sp = SamplingParams(n=2, max_tokens=16)
    a = NativeEngine(tiny_model_dir, seed=7).generate(requests_of(prompts), sp)
    b = NativeEngine(tiny_model_dir, seed=7).generate(requests_of(prompts), sp)
    c = NativeEngine(tiny_model_dir, seed=8).generate(requests_of(prompts), sp)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_waves_give_the_same_samples(tiny_model_dir, engine, prompts):
    sp = SamplingParams(n=2, max_tokens=16, seed=21)
    want = [c.token_ids for c in engine.generate(requests_of(prompts), sp)]
    few_rows = NativeEngine(tiny_model_dir, max_model_len=256, max_num_seqs=3)
    assert [c.token_ids for c in few_rows.generate(requests_of(prompts), sp)] == want
    budget = 2 * (len(prompts[2]) + 16)  # room for one request (2 rows) per wave
    small_kv = NativeEngine(tiny_model_dir, max_model_len=256, max_kv_tokens=budget)
    assert [c.token_ids for c in small_kv.generate(requests_of(prompts), sp)] == want
    per_slot = small_kv.num_layers * 2 * small_kv.kv_heads * small_kv.head_dim
    assert small_kv._kv_pool.numel() <= budget * per_slot


def test_continuous_batching_equals_each_request_alone(tiny_model_dir, engine, prompts):
    """Long-tailed lengths through 5 cache rows: requests enter the rows that finished samples
    free while others still decode, and every sample equals its request generated alone."""
    budgets = [40, 3, 6, 2, 28, 4, 9, 3, 2, 17]
    widths = [2, 1, 3, 2, 1, 2, 3, 1, 2, 2]
    reqs = [Request(prompts[k % 4]) for k in range(len(budgets))]
    sps = [
        SamplingParams(
            n=n,
            temperature=0.8 + 0.1 * (k % 3),
            max_tokens=m,
            seed=100 + k,
            ignore_eos=k % 2 == 0,
            first_token_temperature=2.0 if k % 4 == 1 else None,
            prompt_logprobs=k in (3, 6),
            top_k=5 if k == 7 else 0,
        )
        for k, (m, n) in enumerate(zip(budgets, widths, strict=True))
    ]
    narrow = NativeEngine(tiny_model_dir, max_model_len=256, max_num_seqs=5)
    assert narrow.generate([], SamplingParams()) == []
    outs = narrow.generate(reqs, sps)
    # Admission really happened mid-batch (not one wave after another).
    assert narrow.stats.admitted_while_decoding >= 5
    assert narrow.stats.max_active_rows == 5
    assert [(c.request_index, c.sample_index) for c in outs] == [
        (k, j) for k, n in enumerate(widths) for j in range(n)
    ]
    for k, (req, sp) in enumerate(zip(reqs, sps, strict=True)):
        alone = engine.generate([req], [sp])
        mine = [c for c in outs if c.request_index == k]
        assert [c.token_ids for c in mine] == [c.token_ids for c in alone]
        assert [c.finish_reason for c in mine] == [c.finish_reason for c in alone]
        for a, b in zip(mine, alone, strict=True):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
            )
            if sp.prompt_logprobs:
                torch.testing.assert_close(
                    torch.tensor(a.prompt_logprobs),
                    torch.tensor(b.prompt_logprobs),
                    atol=1e-5,
                    rtol=0,
                )
            else:
                assert a.prompt_logprobs is None


def test_stop_token_ids_end_the_response(engine, prompts):
    (free,) = engine.generate(
        [Request(prompts[2])], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    (c,) = engine.generate(
        [Request(prompts[2])],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop]),
    )
    assert c.token_ids == free.token_ids[: first + 1]  # the stop token is kept
    assert c.finish_reason == "stop"
    assert len(free.token_ids) == 20 and free.finish_reason == "length"


def test_eos_stops_unless_ignored(engine, prompts):
    eos = engine.eos_token_ids[0]
    outs = engine.generate(requests_of(prompts), SamplingParams(n=8, max_tokens=64, seed=0))
    stopped = [c for c in outs if c.finish_reason == "stop"]
    assert stopped, "a near-uniform tiny model should emit EOS within 64 tokens"
    for c in outs:
        assert (eos in c.token_ids) == (c.finish_reason == "stop")
        if c.finish_reason == "stop":
            assert c.token_ids.index(eos) == len(c.token_ids) - 1
        else:
            assert len(c.token_ids) == 64
    ignored = engine.generate(
        requests_of(prompts), SamplingParams(n=8, max_tokens=64, seed=0, ignore_eos=True)
    )
    assert all(len(c.token_ids) == 64 and c.finish_reason == "length" for c in ignored)


def test_fire_first_token_temperature(engine, hf, prompts):
    sp = SamplingParams(n=4, temperature=0.6, first_token_temperature=3.0, max_tokens=10, seed=4)
    for c in engine.generate(requests_of(prompts[:2]), sp):
        temps = [3.0] + [0.6] * (len(c.token_ids) - 1)
        ref = teacher_forced(hf, c.prompt_token_ids, c.token_ids, temps)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5)
    # A hot first token, then greedy: the tail is the greedy continuation of prompt + first token.
    hot = SamplingParams(n=4, temperature=0, first_token_temperature=5.0, max_tokens=8, seed=8)
    outs = engine.generate([Request(prompts[1])], hot)
    assert len({c.token_ids[0] for c in outs}) > 1
    for c in outs:
        tail = hf_greedy(hf, c.prompt_token_ids + c.token_ids[:1], 7, set(engine.eos_token_ids))
        assert c.token_ids[1:] == tail[: len(c.token_ids) - 1]


def test_prompt_logprobs_equal_teacher_forced(engine, hf, prompts):
    p = prompts[2]
    (c,) = engine.generate(
        [Request(p)], SamplingParams(temperature=0.8, max_tokens=1, prompt_logprobs=True)
    )
    ref = teacher_forced(hf, p[:1], p[1:], [0.8] * (len(p) - 1))
    assert len(c.prompt_logprobs) == len(p) - 1
    assert torch.allclose(torch.tensor(c.prompt_logprobs), ref, atol=1e-5)


def test_text_is_detokenised(engine, tok, prompts):
    (c,) = engine.generate([Request(prompts[0])], SamplingParams(max_tokens=8, seed=1))
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    (c,) = engine.generate([Request(prompts[0])], SamplingParams(max_tokens=8, detokenize=False))
    assert c.text is None


def test_max_model_len_bounds_prompt_and_response(tiny_model_dir, prompts):
    eng = NativeEngine(tiny_model_dir, max_model_len=20)
    long_prompt = list(prompts[2])  # 28 tokens
    with pytest.raises(ValueError, match=r"requests\[0\] has 28 prompt tokens.*max_model_len"):
        eng.generate([Request(long_prompt)], SamplingParams(max_tokens=4))
    (c,) = eng.generate([Request(long_prompt[:15])], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    trunc = NativeEngine(tiny_model_dir, max_model_len=20, truncate_prompts=True)
    (c,) = trunc.generate(
        [Request(long_prompt)], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    )
    assert c.prompt_token_ids == long_prompt[-16:]
    assert len(c.token_ids) == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n": 0}, "n must be an integer >= 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"first_token_temperature": float("nan")}, "first_token_temperature"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(engine, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([Request(prompts[0])], SamplingParams(**kwargs))


def test_bad_requests(engine, prompts):
    with pytest.raises(ValueError, match=r"requests\[0\] is a list; wrap"):
        engine.generate([prompts[0]], SamplingParams())
    with pytest.raises(ValueError, match=r"requests\[1\]\.prompt_token_ids holds 5000"):
        engine.generate([Request(prompts[0]), Request([1, 5000])], SamplingParams())
    with pytest.raises(ValueError, match="is empty"):
        engine.generate([Request([])], SamplingParams())
    with pytest.raises(ValueError, match=r"requests\[0\]\.media is a dict; pass the Media"):
        engine.generate([Request(prompts[0], {"image": [0]})], SamplingParams())
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 requests"):
        engine.generate(requests_of(prompts[:2]), [SamplingParams()])


def test_sleep_level_1_frees_the_kv_cache(tiny_model_dir, prompts):
    eng = NativeEngine(tiny_model_dir)
    sp = SamplingParams(n=2, max_tokens=12, seed=3)
    before = eng.generate(requests_of(prompts), sp)
    assert eng._kv_pool is not None
    eng.sleep(1)
    assert eng._kv_pool is None and eng._asleep == {"kv_cache"}
    with pytest.raises(ValueError, match=r"asleep \(kv_cache released\); call wake_up"):
        eng.generate(requests_of(prompts), sp)
    eng.wake_up(["kv_cache"])
    assert [c.token_ids for c in eng.generate(requests_of(prompts), sp)] == [
        c.token_ids for c in before
    ]


def test_sleep_level_2_needs_every_weight_back(tiny_model_dir, hf, prompts):
    eng = NativeEngine(tiny_model_dir)
    sp = SamplingParams(max_tokens=12, seed=3)
    before = eng.generate(requests_of(prompts), sp)
    eng.sleep(2)
    assert all(p.numel() == 0 for p in eng.model.parameters())
    with pytest.raises(ValueError, match=r"weights, kv_cache released"):
        eng.generate(requests_of(prompts), sp)
    with pytest.raises(ValueError, match=r"wake_up\(\['weights'\]\) before load_weights"):
        eng.load_weights(hf.state_dict().items())
    eng.wake_up(["weights"])
    eng.wake_up(["kv_cache"])
    state = hf.state_dict()
    eng.load_weights([(n, t) for n, t in state.items() if "layers.1." not in n])
    with pytest.raises(ValueError, match=r"not loaded since the level-2 sleep.*model\.layers\.1\."):
        eng.generate(requests_of(prompts), sp)
    eng.load_weights([(n, t) for n, t in state.items() if "layers.1." in n])
    after = eng.generate(requests_of(prompts), sp)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


def test_load_weights_errors_name_the_problem(engine, hf):
    w = hf.state_dict()["model.norm.weight"]
    with pytest.raises(ValueError, match=r"unknown parameter name 'model.norms.weight'.*did you"):
        engine.load_weights([("model.norms.weight", w)])
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\)"):
        engine.load_weights([("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="sleep level must be 1"):
        engine.sleep(3)
    with pytest.raises(ValueError, match=r"unknown wake_up tag\(s\) \['kv'\]"):
        engine.wake_up(["kv"])


def test_load_weights_copies_and_casts(tiny_model_dir, hf, prompts):
    eng = NativeEngine(hf, load_tokenizer(tiny_model_dir), dtype="bfloat16")
    assert eng.model is not hf and eng.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters())
    new = torch.randn_like(hf.model.norm.weight)
    eng.load_weights([("model.norm.weight", new)])
    assert torch.equal(eng.model.model.norm.weight, new.to(torch.bfloat16))
    assert not torch.equal(hf.model.norm.weight, new)  # the source model is untouched
    (c,) = eng.generate([Request(prompts[0])], SamplingParams(max_tokens=4, seed=0))
    assert isinstance(c, Completion) and len(c.token_ids) >= 1


def test_rejects_unsupported_architectures():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="supports model types.*got 'gpt2'"):
        NativeEngine(model)


@pytest.mark.slow
def test_compiled_engine_matches_eager(tiny_model_dir, engine, prompts):
    compiled = NativeEngine(tiny_model_dir, max_model_len=256, compile=True)
    sp = SamplingParams(temperature=0, max_tokens=12)
    got = compiled.generate(requests_of(prompts), sp)
    want = engine.generate(requests_of(prompts), sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
