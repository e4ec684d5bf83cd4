"""The vLLM adapter without vLLM running: pure helpers, and the CUDA-only paths (GPU tests,
FakeLLM for sleep mode). The real engine on CPU: test_engine_vllm_real.py, `-m vllm`."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from lightrft.engine import Request, SamplingParams
from lightrft.engine import vllm_adapter as va
from lightrft.engine.external import hf_weight_names

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_module_imports_without_vllm_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # make `import vllm` fail even if installed
    with pytest.raises(ImportError, match=r"pip install 'lightrft\[vllm\]'.*vllm==0\.32\.0"):
        va.import_vllm()
    with pytest.raises(ImportError, match=r"NativeEngine\) needs nothing extra"):
        va.VLLMEngine("/does/not/matter")


def test_tensor_parallel_groups_are_consecutive_ranks():
    assert va.tp_groups(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert va.tp_groups(4, 4) == [[0, 1, 2, 3]]
    assert va.tp_groups(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must be >= 1 and divide"):
        va.tp_groups(4, 3)


def _watch_of(pid: int) -> va.PeerWatch:
    """A PeerWatch of one peer, rank 1, process ``pid`` (built without a process group)."""
    watch = object.__new__(va.PeerWatch)
    watch.peers, watch.on_cpu = [(1, pid)], False
    return watch


def test_a_tensor_parallel_peer_is_dead_once_killed_also_before_it_is_reaped():
    p = subprocess.Popen(["sleep", "60"])
    try:
        assert va._pid_alive(p.pid) and _watch_of(p.pid).dead() == ""
        p.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
        assert not va._pid_alive(p.pid) and _watch_of(p.pid).dead() == "1"
    finally:
        p.kill()
        p.wait()
    assert not va._pid_alive(p.pid)


def test_a_collective_that_fails_with_a_peer_dead_is_named():
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(RuntimeError, match=r"^VLLMEngine: tensor-parallel peer rank 1 died during "
                       r"generate \(RuntimeError: Connection closed by peer"):  # fmt: skip
        with _watch_of(p.pid).during_generate():
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(ValueError, match="^bad request$"):  # not a collective's: unchanged
        with _watch_of(p.pid).during_generate():
            raise ValueError("bad request")
    with pytest.raises(RuntimeError, match="^other$"):  # every peer alive: unchanged
        with _watch_of(os.getpid()).during_generate():
            raise RuntimeError("other")


def test_a_rank_stuck_with_a_dead_peer_exits_naming_it_within_the_bound():
    """A call that cannot end (here a sleep; in vLLM, the CPU shared-memory all-reduce) with its
    peer dead: the process writes the peer and the cause and exits 1, PEER_POLL_S +
    PEER_GRACE_S after the watch starts."""
    code = (
        "import subprocess, time\n"
        "from lightrft.engine import vllm_adapter as va\n"
        "p = subprocess.Popen(['true']); p.wait()\n"
        "w = object.__new__(va.PeerWatch); w.peers, w.on_cpu = [(1, p.pid)], False\n"
        "print('watching', flush=True)\n"
        "with w.during_generate():\n"
        "    time.sleep(120)\n"
    )
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen([sys.executable, "-c", code], **pipes) as proc:
        assert proc.stdout.readline() == "watching\n"
        start = time.monotonic()
        rc = proc.wait(timeout=60)
        waited = time.monotonic() - start
        err = proc.stderr.read()
    assert rc == 1, err
    assert "tensor-parallel peer rank 1 died during generate: this rank is left in a vLLM" in err
    bound = va.PEER_POLL_S + va.PEER_GRACE_S
    assert bound - 0.1 < waited < bound + 20, waited  # not before the grace, and not much later


def test_sampling_params_map_to_vllm_names():
    p = SamplingParams(
        n=4,
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        max_tokens=32,
        stop_token_ids=[5],
        seed=3,
        first_token_temperature=2.0,
        prompt_logprobs=True,
    )
    kw = va.vllm_sampling_kwargs(p)
    assert kw == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "max_tokens": 32,
        "stop_token_ids": [5],
        "ignore_eos": False,
        "seed": 3,
        "logprobs": 0,
        "detokenize": True,
        "prompt_logprobs": 0,
    }
    first = va.vllm_sampling_kwargs(p, first_token=True)
    assert first["temperature"] == 2.0 and first["max_tokens"] == 1 and first["n"] == 4


def _logprob(x):
    return SimpleNamespace(logprob=x)


def test_completions_from_vllm_outputs():
    # Shaped like vllm.RequestOutput / CompletionOutput with logprobs=0 and prompt_logprobs=0.
    outs = [
        SimpleNamespace(
            prompt_logprobs=[None, {8: _logprob(-1.5)}, {9: _logprob(-0.5)}],
            outputs=[
                SimpleNamespace(
                    index=1,
                    token_ids=(4, 2),
                    logprobs=[{4: _logprob(-0.25)}, {2: _logprob(-3.0)}],
                    finish_reason="stop",
                    text="ab",
                ),
                SimpleNamespace(
                    index=0,
                    token_ids=[6],
                    logprobs=[{6: _logprob(-2.0), 1: _logprob(-0.1)}],
                    finish_reason="length",
                    text="",
                ),
            ],
        )
    ]
    got = va.completions_from_outputs(outs, [7], [[1, 8, 9]])
    assert [(c.request_index, c.sample_index) for c in got] == [(7, 1), (7, 0)]
    assert got[0].token_ids == [4, 2] and got[0].logprobs == [-0.25, -3.0]
    assert got[0].finish_reason == "stop" and got[0].text == "ab"
    assert got[1].logprobs == [-2.0] and got[1].text is None
    assert got[0].prompt_logprobs == [-1.5, -0.5] and got[0].prompt_token_ids == [1, 8, 9]
    outs[0].outputs[0].finish_reason = "abort"
    with pytest.raises(ValueError, match="reason 'abort'"):
        va.completions_from_outputs(outs, [7], [[1, 8, 9]])


def test_hf_weight_names_cover_tied_weights(tiny_model_dir):
    from transformers import AutoConfig

    accepted, required = hf_weight_names(AutoConfig.from_pretrained(tiny_model_dir))
    assert "lm_head.weight" in required and "model.layers.1.mlp.up_proj.weight" in required
    tied = AutoConfig.from_pretrained(tiny_model_dir)
    tied.tie_word_embeddings = True
    accepted, required = hf_weight_names(tied)
    assert "lm_head.weight" in accepted and "lm_head.weight" not in required


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_VLLM), reason="needs CUDA and vllm==0.32.0"
)
def test_vllm_engine_on_gpu(tmp_path):
    """Greedy equals HF, log-probs equal HF's temperature-scaled ones, sleep/sync round trip."""
    from lightrft.engine import sync_weights
    from lightrft.models import load_causal_lm, load_tokenizer
    from lightrft.tasks import make_tiny_model

    # head_dim 64: a size every vLLM attention backend supports.
    model_dir = make_tiny_model(tmp_path / "m", layers=2, hidden=256, heads=4, kv_heads=2)
    hf = load_causal_lm(model_dir, device="cuda").eval()
    tok = load_tokenizer(model_dir)
    engine = va.VLLMEngine(
        model_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, seed=0
    )
    prompts = [tok(t)["input_ids"] for t in ["hello there", "2 + 2 =", "a"]]
    reqs = [Request(p) for p in prompts]

    @torch.no_grad()
    def hf_logits(ids):
        return hf(torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float()

    greedy = engine.generate(reqs, SamplingParams(temperature=0, max_tokens=12))
    for c, p in zip(greedy, prompts, strict=True):
        ids = list(p)
        for t in c.token_ids:
            assert t == int(hf_logits(ids)[-1].argmax())
            ids.append(t)

    sampled = engine.generate(reqs, SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=1))
    for c in sampled:
        logits = hf_logits(c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1 : -1]
        ref = (
            (logits / 0.7)
            .log_softmax(-1)
            .gather(-1, torch.tensor(c.token_ids, device="cuda")[:, None])
        )
        assert torch.allclose(torch.tensor(c.logprobs), ref.squeeze(-1).cpu(), atol=1e-3)

    again = engine.generate(reqs, SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=1))
    assert [c.token_ids for c in again] == [c.token_ids for c in sampled]

    engine.sleep(2)
    with pytest.raises(ValueError, match="asleep"):
        engine.generate(reqs, SamplingParams())
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    with pytest.raises(ValueError, match="not loaded since the level-2 sleep"):
        engine.generate(reqs, SamplingParams())
    sync_weights(hf, engine)
    after = engine.generate(reqs, SamplingParams(temperature=0, max_tokens=12))
    assert [c.token_ids for c in after] == [c.token_ids for c in greedy]

    fire = engine.generate(
        reqs[:1], SamplingParams(n=4, temperature=0.5, first_token_temperature=3.0, seed=2)
    )
    for c in fire:
        logits = hf_logits(c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1 : -1]
        temps = torch.tensor([3.0] + [0.5] * (len(c.token_ids) - 1), device="cuda")[:, None]
        ref = (
            (logits / temps)
            .log_softmax(-1)
            .gather(-1, torch.tensor(c.token_ids, device="cuda")[:, None])
        )
        assert torch.allclose(torch.tensor(c.logprobs), ref.squeeze(-1).cpu(), atol=1e-3)


class FakeLLM:
    """Stands in for ``vllm.LLM`` where the real one cannot show the behaviour: vLLM's sleep mode
    (weights offloaded by a level-1 sleep) exists on CUDA only, and vLLM's CPU platform has
    none. It answers token-id prompts through the native engine with vLLM-shaped outputs.
    Everything else runs against the real vLLM: test_engine_vllm_real.py (``-m vllm``)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params, use_tqdm=False):
        outs = []
        for prompt, sp in zip(prompts, params, strict=True):
            self.calls.append((prompt["prompt_token_ids"], sp))
            ours = SamplingParams(
                n=sp.n,
                temperature=sp.temperature,
                max_tokens=sp.max_tokens,
                stop_token_ids=sp.stop_token_ids,
                seed=sp.seed,
            )
            cs = self.engine.generate([Request(prompt["prompt_token_ids"])], ours)
            outs.append(
                SimpleNamespace(
                    prompt_logprobs=None,
                    outputs=[
                        SimpleNamespace(
                            index=c.sample_index,
                            token_ids=c.token_ids,
                            logprobs=[
                                {t: _logprob(x)}
                                for t, x in zip(c.token_ids, c.logprobs, strict=True)
                            ],
                            finish_reason=c.finish_reason,
                            text=c.text,
                        )
                        for c in cs
                    ],
                )
            )
        return outs

    def get_tokenizer(self):
        return self.engine.tokenizer


def fake_vllm_engine(native):
    """A VLLMEngine over :class:`FakeLLM` (built without starting vLLM)."""
    eng = object.__new__(va.VLLMEngine)
    eng.llm, eng._vllm = FakeLLM(native), SimpleNamespace(SamplingParams=SimpleNamespace)
    eng.tokenizer = native.tokenizer
    eng.tp_group, eng._peers, eng.tp_size = None, None, 1
    eng.image_token_id = eng.audio_token_id = eng.video_token_id = None
    eng.suppress_token_ids = []
    eng.vocab_size, eng.max_model_len = native.vocab_size, native.max_model_len
    eng._asleep, eng._unloaded = set(), set()
    eng.on_cpu, eng.enable_sleep_mode, eng._pending, eng._tied = False, True, [], False
    return eng


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_VLLM), reason="needs CUDA and vllm==0.32.0"
)
def test_vllm_multi_turn_on_gpu(tmp_path):
    """Real vLLM: greedy multi-turn trajectories equal the native engine's on the same GPU."""
    from lightrft.engine import NativeEngine
    from lightrft.models import load_tokenizer
    from lightrft.tasks import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", layers=2, hidden=256, heads=4, kv_heads=2)
    tok = load_tokenizer(model_dir)
    engine = va.VLLMEngine(
        model_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, seed=0
    )
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


def test_a_sync_after_a_level_1_sleep_wakes_the_offloaded_weights(tiny_model_dir):
    """vLLM's level-1 sleep offloads the weights to host memory (the native engine keeps them):
    the colocated engine's sync after an update must wake them before loading, and send only
    what training changes since the frozen ones are still there. Against FakeLLM (CPU)."""
    from transformers import AutoConfig

    from lightrft.engine import NativeEngine, sync_weights
    from lightrft.engine.external import hf_weight_names
    from lightrft.models import load_causal_lm
    from lightrft.rollout.engine import ColocatedEngine

    native = NativeEngine(tiny_model_dir)
    eng = fake_vllm_engine(native)
    eng.enable_sleep_mode, eng.dtype = True, torch.float32
    eng._names, eng._required = hf_weight_names(AutoConfig.from_pretrained(tiny_model_dir))
    loaded, events = [], []
    eng.llm.sleep = lambda level: events.append(("sleep", level))
    eng.llm.wake_up = lambda tags: events.append(("wake_up", tuple(tags)))
    eng.llm.reset_prefix_cache = lambda: True
    model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=loaded.extend))
    executor = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=model_runner))
    eng.llm.llm_engine = SimpleNamespace(model_executor=executor)
    model = load_causal_lm(tiny_model_dir)
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen part stays in the engine
    strategy = SimpleNamespace(
        sync_weights=lambda engine, skip_frozen: sync_weights(
            model, engine, skip_frozen=skip_frozen
        )
    )
    colocated = ColocatedEngine(eng, strategy, sleep_level=1)
    colocated.sleep()
    colocated.sync()
    assert events == [("sleep", 1), ("wake_up", ("weights",))]
    names = {name for name, _ in loaded}
    assert "model.embed_tokens.weight" not in names and "model.norm.weight" in names
    assert eng._asleep == {"kv_cache"}  # generate wakes the rest
