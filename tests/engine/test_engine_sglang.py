"""The SGLang adapter. SGLang cannot run on a CPU, so the CPU tests drive ``SGLangEngine`` over
:class:`FakeSGLang`, a stand-in for ``sglang.Engine`` whose interface and refusals follow
sglang 0.5.21's source (paths in its docstring); the model underneath is the native engine.
What the fake cannot show (SGLang's real sampler, log-prob quantity, memory release, IPC weight
transfer) is checked by the GPU tests at the bottom, which need CUDA and sglang==0.5.21."""

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from lightrft.engine import Request, Resume, SamplingParams
from lightrft.engine import sglang_adapter as sa
from lightrft.engine.config import EngineConfig
from lightrft.engine.external import turn_seed

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_SGLANG), reason="needs CUDA and sglang==0.5.21"
)


class FakeSGLang:
    """Stands in for ``sglang.Engine`` (0.5.21) on CPU; answers through a native engine.

    Follows the real one where the adapter depends on it:
    - ``generate(input_ids=[[...]], sampling_params=[{...}], image_data=..., return_logprob=True)``
      returns one dict per request: ``output_ids`` (stop token kept), ``meta_info`` with
      ``finish_reason`` ``{"type": "stop" | "length" | "abort", ...}``, ``prompt_tokens`` and
      ``output_token_logprobs`` as ``(logprob, token_id, None)`` (managers/tokenizer_manager.py);
    - a prompt plus ``max_new_tokens`` beyond the context is refused (``_validate_one_request``),
      and ``n`` must be equal across a batch (managers/io_struct.py);
    - ``sampling_seed`` is used only with deterministic inference (sampling_batch_info.py);
    - ``update_weights_from_tensor`` outside ``begin/end_weight_update`` answers
      ``(False, message)``; resuming a tag that is not released raises
      (managers/scheduler_components/weight_updater.py).
    Not modelled: SGLang's log-probs are taken before top-k / top-p (the native engine's after).
    """

    def __init__(self, native, *, context_len: int, deterministic: bool = False):
        self.native, self.deterministic = native, deterministic
        self.tokenizer_manager = SimpleNamespace(context_len=context_len)
        self.calls: list[tuple[list[int], dict]] = []
        self.offloaded: set[str] = set()
        self.session = False
        self.log: list[tuple] = []

    def generate(self, input_ids, sampling_params, image_data=None, return_logprob=False):
        assert return_logprob and image_data is None
        assert len({d.get("n", 1) for d in sampling_params}) == 1
        assert not self.offloaded, "generate while memory is released"
        outs = []
        for ids, d in zip(input_ids, sampling_params, strict=True):
            self.calls.append((list(ids), dict(d)))
            if len(ids) + d["max_new_tokens"] > self.tokenizer_manager.context_len:
                raise ValueError("Requested token count exceeds the model's maximum context")
            seed = d.get("sampling_seed") if self.deterministic else None
            p = SamplingParams(
                temperature=d["temperature"],
                top_p=d["top_p"],
                top_k=max(d["top_k"], 0),
                max_tokens=d["max_new_tokens"],
                stop_token_ids=d.get("stop_token_ids", []),
                ignore_eos=d["ignore_eos"],
                seed=seed,
            )
            (c,) = self.native.generate([Request(list(ids))], p)
            reason = (
                {"type": "stop", "matched": c.token_ids[-1]}
                if c.finish_reason == "stop"
                else {"type": "length", "length": len(c.token_ids)}
            )
            lps = [(lp, t, None) for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            meta = {"finish_reason": reason, "prompt_tokens": len(ids)}
            meta["output_token_logprobs"] = lps
            outs.append({"text": c.text, "output_ids": c.token_ids, "meta_info": meta})
        return outs

    def release_memory_occupation(self, tags=None):
        self.log.append(("release", list(tags)))
        self.offloaded |= set(tags)

    def resume_memory_occupation(self, tags=None):
        self.log.append(("resume", list(tags)))
        for tag in tags:
            self.offloaded.remove(tag)  # KeyError for a tag that is not released, as in SGLang

    def begin_weight_update(self):
        self.log.append(("begin",))
        if self.session:
            return False, "a weight-update session is already open"
        self.session = True
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.log.append(("update", [n for n, _ in named_tensors], flush_cache))
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update()..."
        self.native.load_weights(named_tensors)
        return True, "Success"

    def end_weight_update(self):
        self.log.append(("end",))
        if not self.session:
            return False, "no weight-update session is open"
        self.session = False
        return True, "Success"

    def flush_cache(self):
        self.log.append(("flush",))
        return SimpleNamespace(success=True)


def fake_sglang_engine(native, *, max_model_len=256, deterministic=False):
    """An SGLangEngine over :class:`FakeSGLang`, built without starting SGLang."""
    from transformers import AutoConfig

    eng = object.__new__(sa.SGLangEngine)
    eng.llm = FakeSGLang(native, context_len=max_model_len, deterministic=deterministic)
    eng.dtype, eng.deterministic = torch.float32, deterministic
    eng.enable_sleep_mode, eng._weights_backup = True, False
    eng.tokenizer, eng.image_token_id = native.tokenizer, None
    eng._setup(AutoConfig.from_pretrained(native.path), max_model_len, seed=0)
    return eng


@pytest.fixture(scope="module")
def native(tiny_model_dir):
    from lightrft.engine import NativeEngine

    eng = NativeEngine(tiny_model_dir, max_model_len=256)
    eng.path = tiny_model_dir
    return eng


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from lightrft.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    return [tok(t)["input_ids"] for t in ["hi", "What is 2 + 2?", "a cat."]]


def test_module_imports_without_sglang_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # make `import sglang` fail if installed
    with pytest.raises(ImportError, match=r"pip install 'lightrft\[sglang\]'.*sglang==0\.5\.21"):
        sa.import_sglang()
    with pytest.raises(ImportError, match=r"NativeEngine\) needs nothing extra"):
        sa.SGLangEngine("/does/not/matter")


def test_sampling_params_map_to_sglang_names():
    p = SamplingParams(
        n=4, temperature=0.7, top_p=0.9, top_k=0, max_tokens=32, stop_token_ids=[5], seed=3
    )
    assert sa.sglang_sampling_params(p, max_new_tokens=20, seed=11) == {
        "max_new_tokens": 20,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # SGLang's "whole vocabulary"; 0 is refused there
        "ignore_eos": False,
        "stop_token_ids": [5],
        "sampling_seed": 11,
    }
    fire = SamplingParams(temperature=0.5, top_k=7, first_token_temperature=2.0, ignore_eos=True)
    d = sa.sglang_sampling_params(
        fire, max_new_tokens=9, seed=None, first_token=True, suppress_token_ids=[8, 9]
    )
    assert d == {
        "max_new_tokens": 1,
        "temperature": 2.0,
        "top_p": 1.0,
        "top_k": 7,
        "ignore_eos": True,
        "logit_bias": {"8": -100.0, "9": -100.0},
    }


def _out(ids, lps, reason, prompt_tokens=3):
    steps = [(lp, t, None) for lp, t in zip(lps, ids, strict=True)]
    meta = {"finish_reason": reason, "prompt_tokens": prompt_tokens}
    return {"output_ids": ids, "meta_info": {**meta, "output_token_logprobs": steps}}


def test_outputs_map_to_ids_logprobs_and_finish_reasons():
    got = sa.sample_from_output(_out([4, 2], [-0.25, -3.0], {"type": "stop", "matched": 2}), 0, 1)
    assert got == ([4, 2], [-0.25, -3.0], "stop", 3)
    got = sa.sample_from_output(_out([6], [-2.0], {"type": "length", "length": 1}), 0, 0)
    assert got[2] == "length"
    with pytest.raises(RuntimeError, match="SGLang aborted request 2 sample 0: oom"):
        sa.sample_from_output(_out([6], [-2.0], {"type": "abort", "message": "oom"}), 2, 0)
    with pytest.raises(ValueError, match="do not follow its tokens"):
        out = _out([6, 7], [-2.0, -1.0], {"type": "length"})
        out["meta_info"]["output_token_logprobs"][1] = (-1.0, 9, None)
        sa.sample_from_output(out, 0, 0)
    out = _out([6], [-2.0], {"type": "stop"})
    del out["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="no log-probs"):
        sa.sample_from_output(out, 0, 0)


def test_images_go_as_image_data_with_collapsed_placeholders():
    from lightrft.data.audio import AudioInputs
    from lightrft.data.media import Media
    from lightrft.data.vision import ImageInputs

    image = ImageInputs(["img0", "img1"], torch.zeros(5, 4), None, [3, 2], {})
    ids, images = sa.sglang_prompt([1, 9, 9, 9, 5, 9, 9, 4], Media(image=image), 9)
    assert ids == [1, 9, 5, 9, 4] and images == ["img0", "img1"]
    assert sa.sglang_prompt([1, 2], None, None) == ([1, 2], None)
    with pytest.raises(ValueError, match="not vision-language"):
        sa.sglang_prompt([1, 9], Media(image=image), None)
    audio = AudioInputs([], torch.zeros(1), torch.zeros(1), [1], 16000)
    with pytest.raises(ValueError, match="images only"):
        sa.sglang_prompt([1], Media(audio=audio), 9)

    sent = {}

    def generate(**kwargs):
        sent.update(kwargs)
        return [None] * len(kwargs["input_ids"])

    engine = object.__new__(sa.SGLangEngine)
    engine.llm = SimpleNamespace(generate=generate)
    engine._run([([1, 2], None), (ids, images)], [{}, {}])
    # A list per request, [] for a text-only one (SGLang reads the layout off the first entry).
    assert sent["image_data"] == [[], ["img0", "img1"]] and sent["input_ids"][1] == ids
    engine._run([([1, 2], None)], [{}])
    assert sent["image_data"] is None


def test_greedy_generation_matches_the_native_engine(native, prompts):
    engine = fake_sglang_engine(native)
    reqs = [Request(p) for p in prompts]
    sp = SamplingParams(n=2, temperature=0, max_tokens=12, stop_token_ids=[42])
    got, want = engine.generate(reqs, sp), native.generate(reqs, sp)
    assert [(c.request_index, c.sample_index) for c in got] == [
        (i, j) for i in range(3) for j in (0, 1)
    ]
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        assert a.prompt_token_ids == b.prompt_token_ids and a.turn_spans is None
    # One SGLang request per sample, no `n`, no seed (deterministic inference is off).
    assert len(engine.llm.calls) == 6
    assert all("n" not in d and "sampling_seed" not in d for _, d in engine.llm.calls)


def test_max_new_tokens_is_capped_by_the_context(native, prompts):
    engine = fake_sglang_engine(native, max_model_len=len(prompts[1]) + 5)
    (c,) = engine.generate([Request(prompts[1])], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    with pytest.raises(ValueError, match="leaves no room to generate under max_model_len"):
        engine.generate([Request(prompts[1] * 2)], SamplingParams())


def test_seeds_need_deterministic_inference(native, prompts):
    reqs = [Request(p) for p in prompts[:2]]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5)
    loose = fake_sglang_engine(native)
    with pytest.warns(UserWarning, match="ignores SamplingParams.seed unless built with"):
        loose.generate(reqs, sp)
    assert all("sampling_seed" not in d for _, d in loose.llm.calls)

    strict = fake_sglang_engine(native, deterministic=True)
    first = strict.generate(reqs, sp)
    sent = [d["sampling_seed"] for _, d in strict.llm.calls]
    # Every sample its own stream (SGLang's seeded draw hashes (seed, position) only).
    assert sent == [turn_seed(5, j, 0) for _ in reqs for j in range(3)]
    assert [c.token_ids for c in strict.generate(reqs, sp)] == [c.token_ids for c in first]
    assert len({tuple(c.token_ids) for c in first}) > 2

    strict.llm.calls.clear()
    strict.generate(reqs, SamplingParams(temperature=1.0, max_tokens=4))  # unseeded
    drawn = [d["sampling_seed"] for _, d in strict.llm.calls]
    assert len(set(drawn)) == 2  # drawn from the engine's generator, not SGLang's fixed 42


def test_fire_samples_the_first_token_hot_then_the_rest(native, prompts):
    engine = fake_sglang_engine(native, deterministic=True)
    sp = SamplingParams(
        n=2, temperature=0.5, first_token_temperature=3.0, max_tokens=6, seed=1, ignore_eos=True
    )
    got = engine.generate([Request(prompts[0])], sp)
    calls = engine.llm.calls
    assert [d["max_new_tokens"] for _, d in calls] == [1, 1, 5, 5]
    assert [d["temperature"] for _, d in calls] == [3.0, 3.0, 0.5, 0.5]
    for c, (ids, _) in zip(got, calls[2:], strict=True):
        assert ids == prompts[0] + c.token_ids[:1]  # the rest continues after the hot token
        assert len(c.token_ids) == len(c.logprobs) == 6 and c.finish_reason == "length"


def test_multi_turn_loop_matches_the_native_engine(native, prompts):
    stops, obs = [42, 87, 12], [[32, 83, 70], [5, 6, 7, 8, 9, 10, 11], [40]]

    def continuation(turn):
        return obs[(turn.request_index + turn.turn_index) % 3] if turn.turn_index < 2 else None

    engine = fake_sglang_engine(native)
    reqs = [Request(p) for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=stops)
    got = engine.generate(reqs, sp, continuation=continuation)
    want = native.generate(reqs, sp, continuation=continuation)
    assert sum(c.num_turns for c in got) >= 5
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.turn_spans, a.sampled_mask) == (
            b.token_ids,
            b.turn_spans,
            b.sampled_mask,
        )
        assert a.finish_reason == b.finish_reason and a.text == b.text
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    for ids, d in engine.llm.calls[len(reqs) :]:  # later turns: prompt + response so far
        c = next(c for c in got if ids[: len(c.prompt_token_ids)] == c.prompt_token_ids)
        response = ids[len(c.prompt_token_ids) :]
        assert c.token_ids[: len(response)] == response
        assert d["max_new_tokens"] == 60 - len(response)


def test_sleep_and_wake_release_and_resume_only_what_is_released(native, prompts):
    engine = fake_sglang_engine(native)
    log = engine.llm.log
    engine.sleep(1)
    assert log == [("release", ["kv_cache", "cuda_graph"])]
    with pytest.raises(ValueError, match="asleep"):
        engine.generate([Request(prompts[0])], SamplingParams())
    engine.wake_up()  # both tags asked, only the KV cache was released
    engine.wake_up()
    assert log[1:] == [("resume", ["kv_cache", "cuda_graph"])]
    engine.generate([Request(prompts[0])], SamplingParams(max_tokens=2))

    log.clear()
    engine.sleep(2)
    assert log == [("release", ["weights", "kv_cache", "cuda_graph"])]
    with pytest.raises(ValueError, match="before load_weights"):
        engine.load_weights([("lm_head.weight", torch.zeros(1))])
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    with pytest.raises(ValueError, match="not loaded since the level-2 sleep"):
        engine.generate([Request(prompts[0])], SamplingParams())
    with pytest.raises(ValueError, match="sleep level must be 1"):
        engine.sleep(3)


def test_weight_sync_goes_in_buckets_inside_one_update_session(native, prompts, tiny_model_dir):
    from lightrft.engine import sync_weights
    from lightrft.models import load_causal_lm

    hf = load_causal_lm(tiny_model_dir).eval()
    engine = fake_sglang_engine(native)
    reqs = [Request(p) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    before = [c.token_ids for c in engine.generate(reqs, greedy)]
    engine.sleep(2)
    engine.wake_up(["weights"])
    log = engine.llm.log
    log.clear()
    with torch.no_grad():
        hf.lm_head.weight.mul_(-1.0)  # a policy that prefers other tokens
    stats = sync_weights(hf, engine, bucket_bytes=64 * 1024)
    updates = [e for e in log if e[0] == "update"]
    assert stats.buckets == len(updates) > 1
    assert log[0] == ("begin",) and log[-1] == ("end",)  # KV asleep: nothing to flush
    assert all(flush is False for _, _, flush in updates)
    assert {n for _, names, _ in updates for n in names} == engine._required
    engine.wake_up(["kv_cache"])
    assert [c.token_ids for c in engine.generate(reqs, greedy)] != before

    log.clear()
    with torch.no_grad():
        hf.lm_head.weight.mul_(-1.0)
    sync_weights(hf, engine)  # awake: the session closes, then the radix cache is flushed
    assert log[0] == ("begin",) and log[-2:] == [("end",), ("flush",)]
    assert [c.token_ids for c in engine.generate(reqs, greedy)] == before

    engine.load_weights([("lm_head.weight", hf.lm_head.weight)])  # no reset_prefix_cache...
    engine.generate(reqs[:1], greedy)  # ...so generate closes the session first
    assert log[-2:] == [("end",), ("flush",)] and not engine.llm.session
    with pytest.raises(ValueError, match="unknown parameter name"):
        engine.load_weights([("lm_head.weights", hf.lm_head.weight)])
    engine.llm.session = True  # SGLang answering (False, message) must not pass silently
    with pytest.raises(RuntimeError, match="begin_weight_update failed: .*already open"):
        engine.load_weights([("lm_head.weight", hf.lm_head.weight)])


def test_prompt_logprobs_and_a_differently_expanded_prompt_are_refused(native, prompts):
    engine = fake_sglang_engine(native)
    with pytest.raises(ValueError, match="does not return prompt_logprobs"):
        engine.generate([Request(prompts[0])], SamplingParams(prompt_logprobs=True))
    resumed = Request(prompts[0], resume=Resume(0, [5], [-1.0]))
    with pytest.raises(ValueError, match="does not continue a Request.resume"):
        engine.generate([resumed], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="expanded request 0's prompt to 7 tokens, the dataset"):
        engine._check_prompt_len(Request([1, 2, 3]), 7, 0)


def test_engine_config_chooses_and_checks_sglang(monkeypatch):
    cfg = EngineConfig(backend="sglang", gpu_memory_utilization=0.4, deterministic=True)
    assert cfg.resolve("engine").kwargs() == {"gpu_memory_utilization": 0.4, "deterministic": True}
    for key, value in (("tensor_parallel_size", 2), ("max_kv_tokens", 64)):
        with pytest.raises(ValueError, match=f"engine.{key} does not apply to engine.backend=sg"):
            EngineConfig(backend="sglang", **{key: value}).resolve("engine")
    with pytest.raises(ValueError, match="engine.deterministic does not apply to engine.backend=v"):
        EngineConfig(backend="vllm", deterministic=True).resolve("engine")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="engine.tensor_parallel_size=3 must be >= 1 and divide"):
        EngineConfig(backend="vllm", tensor_parallel_size=3).resolve("engine")
    with pytest.raises(ValueError, match="engine.backend=sglang runs on CUDA GPUs only"):
        cfg.check_device("cpu")
    EngineConfig().check_device("cpu")


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@GPU
def test_sglang_engine_on_gpu(tmp_path):
    """Greedy equals HF, log-probs equal HF's temperature-scaled ones (top-k / top-p off),
    seeded samples repeat, sleep frees GPU memory, weight sync changes and restores outputs."""
    from lightrft.engine import sync_weights
    from lightrft.models import load_causal_lm, load_tokenizer
    from lightrft.tasks import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", layers=2, hidden=256, heads=4, kv_heads=2)
    hf = load_causal_lm(model_dir, device="cuda").eval()
    tok = load_tokenizer(model_dir)
    engine = sa.SGLangEngine(
        model_dir, dtype="float32", gpu_memory_utilization=0.2, deterministic=True, seed=0
    )
    prompts = [tok(t)["input_ids"] for t in ["hello there", "2 + 2 =", "a"]]
    reqs = [Request(p) for p in prompts]

    @torch.no_grad()
    def hf_logits(ids):
        return hf(torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float()

    def ref_logprobs(c, temps):
        logits = hf_logits(c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1 : -1]
        ids = torch.tensor(c.token_ids, device="cuda")[:, None]
        return (logits / temps).log_softmax(-1).gather(-1, ids).squeeze(-1).cpu()

    greedy = engine.generate(reqs, SamplingParams(temperature=0, max_tokens=12))
    for c, p in zip(greedy, prompts, strict=True):
        ids = list(p)
        for t in c.token_ids:
            assert t == int(hf_logits(ids)[-1].argmax())
            ids.append(t)

    sp = SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=1)
    sampled = engine.generate(reqs, sp)
    for c in sampled:
        assert torch.allclose(torch.tensor(c.logprobs), ref_logprobs(c, 0.7), atol=1e-3)
    assert [c.token_ids for c in engine.generate(reqs, sp)] == [c.token_ids for c in sampled]

    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(2)
    assert torch.cuda.mem_get_info()[0] > free_awake  # the subprocess released its memory
    with pytest.raises(ValueError, match="asleep"):
        engine.generate(reqs, SamplingParams())
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    with pytest.raises(ValueError, match="not loaded since the level-2 sleep"):
        engine.generate(reqs, SamplingParams())
    sync_weights(hf, engine)
    greedy_args = SamplingParams(temperature=0, max_tokens=12)
    assert [c.token_ids for c in engine.generate(reqs, greedy_args)] == [
        c.token_ids for c in greedy
    ]
    with torch.no_grad():
        hf.lm_head.weight.mul_(-1.0)
    sync_weights(hf, engine)
    assert [c.token_ids for c in engine.generate(reqs, greedy_args)] != [
        c.token_ids for c in greedy
    ]

    fire = engine.generate(
        reqs[:1], SamplingParams(n=4, temperature=0.5, first_token_temperature=3.0, seed=2)
    )
    for c in fire:
        temps = torch.tensor([3.0] + [0.5] * (len(c.token_ids) - 1), device="cuda")[:, None]
        assert torch.allclose(torch.tensor(c.logprobs), ref_logprobs(c, temps), atol=1e-3)
    engine.llm.shutdown()


@pytest.mark.gpu
@GPU
def test_sglang_multi_turn_on_gpu(tmp_path):
    """Real SGLang: greedy multi-turn trajectories equal the native engine's on the same GPU."""
    from lightrft.engine import NativeEngine
    from lightrft.models import load_tokenizer
    from lightrft.tasks import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", layers=2, hidden=256, heads=4, kv_heads=2)
    tok = load_tokenizer(model_dir)
    engine = sa.SGLangEngine(model_dir, dtype="float32", gpu_memory_utilization=0.2, seed=0)
    native = NativeEngine(model_dir, dtype="float32", device="cuda", max_model_len=1024)
    reqs = [Request(tok(t)["input_ids"]) for t in ["hello there", "2 + 2 =", "a"]]
    free = native.generate(reqs, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stops = sorted({c.token_ids[3] for c in free})  # ids greedy decoding reaches early

    def continuation(turn):
        return [5, 6, 7][: turn.turn_index + 1] if turn.turn_index < 2 else None

    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stops)
    got = engine.generate(reqs, sp, continuation=continuation)
    want = native.generate(reqs, sp, continuation=continuation)
    assert any(c.num_turns > 1 for c in want)
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.turn_spans) == (b.token_ids, b.turn_spans)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-3)
    engine.llm.shutdown()
