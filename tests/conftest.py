import os

import pytest

# Tests run on 2 cores: keep intra-op threads modest so two gloo ranks do not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, hidden-64 qwen2 model with a char-level tokenizer, saved as an HF directory."""
    from lightrft.tasks.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", layers=2, hidden=64)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from lightrft.tasks.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama", arch="llama", layers=2, hidden=64
    )


def _vllm_missing() -> str | None:
    """Why the real vLLM cannot run here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        from lightrft.engine.vllm_adapter import CPU_INSTALL

        return f"vllm not installed (on CPU: {CPU_INSTALL})"
    return None


def pytest_collection_modifyitems(config, items):
    """`slow`, `benchmark_suite`, `deepspeed` and `vllm` tests run only when selected with `-m`
    (documented opt-in); selected `vllm` tests skip, saying so, where vLLM is not installed."""
    markexpr = config.getoption("markexpr") or ""
    if "vllm" in markexpr and (why := _vllm_missing()):
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if item.get_closest_marker("vllm"):
                item.add_marker(skip)
    for marker in ("slow", "benchmark_suite", "deepspeed", "vllm"):
        if marker in markexpr:
            continue
        skip = pytest.mark.skip(reason=f"opt-in: select with -m {marker}")
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """``tiny_vlm(arch)``: a tiny vision-language model dir (``qwen2_vl``, ``qwen2_5_vl``,
    ``llava``) with its processor, made once per session per arch."""
    from lightrft.tasks.tiny import make_tiny_model

    made = {}

    def get(arch: str = "qwen2_vl"):
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp("tiny") / arch, arch=arch)
        return made[arch]

    return get
