"""Weight sync: name mapping, LoRA merging, buckets, and FSDP2 over 2 gloo processes."""

import pytest
import torch
from _dist import run_distributed
from torch import nn

from lightrft.engine import NativeEngine, Request, SamplingParams, sync_weights
from lightrft.engine.sync import plan_weights
from lightrft.models import load_causal_lm, load_tokenizer
from lightrft.models.names import hf_name
from lightrft.tasks import make_tiny_model


@pytest.mark.parametrize(
    "name,want",
    [
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        (
            "model.layers.3._checkpoint_wrapped_module.self_attn.q_proj.weight",
            "model.layers.3.self_attn.q_proj.weight",
        ),
        (
            "model.layers.1._orig_mod.input_layernorm.weight",
            "model.layers.1.input_layernorm.weight",
        ),
        (
            "base_model.model.model.layers.0.self_attn.v_proj.base_layer.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ),
        ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
        (
            "base_model.model.model.layers.2._checkpoint_wrapped_module._orig_mod.mlp.down_proj"
            ".base_layer.bias",
            "model.layers.2.mlp.down_proj.bias",
        ),
    ],
)
def test_hf_name_strips_wrappers(name, want):
    assert hf_name(name) == want


class LoraLinear(nn.Module):
    """The attribute layout of a PEFT LoRA ``Linear`` (PEFT is not a dependency)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        with torch.no_grad():
            self.lora_A["default"].weight.copy_(torch.randn(r, base.in_features, generator=g))
            self.lora_B["default"].weight.copy_(torch.randn(base.out_features, r, generator=g))
        self.scaling = {"default": alpha / r}
        self.active_adapters = ["default"]
        self.merged = False

    def forward(self, x):
        a, b = self.lora_A["default"], self.lora_B["default"]
        return self.base_layer(x) + b(a(x)) * self.scaling["default"]


class PeftLike(nn.Module):
    """``base_model.model.<hf model>``, as PEFT nests the wrapped model."""

    def __init__(self, model):
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = model

    def forward(self, *args, **kwargs):
        return self.base_model.model(*args, **kwargs)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).eval()


def test_sync_from_a_plain_model_is_bit_exact(tiny_model_dir, hf):
    engine = NativeEngine(tiny_model_dir)
    trained = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    stats = sync_weights(trained, engine, bucket_bytes=1)  # one tensor per bucket
    assert stats.buckets == stats.tensors == len(list(trained.parameters()))
    for (name, p), (ename, e) in zip(
        trained.named_parameters(), engine.model.named_parameters(), strict=True
    ):
        assert name == ename and torch.equal(p, e), name
    assert stats.bytes == sum(p.numel() * 4 for p in trained.parameters())


def test_sync_casts_to_the_engine_dtype(tiny_model_dir, hf):
    engine = NativeEngine(tiny_model_dir, dtype="bfloat16")
    sync_weights(hf, engine)
    for p, e in zip(hf.parameters(), engine.model.parameters(), strict=True):
        assert e.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), e)


def test_lora_adapters_are_merged_under_hf_names(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir).eval()
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj = LoraLinear(layer.self_attn.q_proj, seed=i)
    peft = PeftLike(model)
    names = [item.name for item in plan_weights(peft)]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("lora" in n or "base_layer" in n for n in names)

    engine = NativeEngine(tiny_model_dir)
    sync_weights(peft, engine)
    lora = model.model.layers[1].self_attn.q_proj
    a, b = lora.lora_A["default"].weight, lora.lora_B["default"].weight
    want = lora.base_layer.weight + (b @ a) * lora.scaling["default"]
    got = engine.model.model.layers[1].self_attn.q_proj.weight
    assert torch.allclose(got, want, atol=1e-6)
    # The engine now computes what the adapted model computes.
    seq = load_tokenizer(tiny_model_dir)("merge me, please")["input_ids"]
    (c,) = engine.generate([Request(seq)], SamplingParams(max_tokens=1, prompt_logprobs=True))
    with torch.no_grad():
        logits = peft(torch.tensor([seq]), use_cache=False).logits[0]
    ref = logits[:-1].log_softmax(-1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(c.prompt_logprobs), ref, atol=1e-5)


def test_unsupported_adapters_are_refused(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    lora = LoraLinear(model.model.layers[0].self_attn.q_proj)
    lora.use_dora = {"default": True}
    model.model.layers[0].self_attn.q_proj = lora
    with pytest.raises(ValueError, match="uses DoRA"):
        plan_weights(model)
    lora.use_dora = {"default": False}
    lora.lora_magnitude_vector = nn.ParameterDict({"default": nn.Parameter(torch.ones(3))})
    with pytest.raises(ValueError, match="lora_magnitude_vector.*merge the adapter"):
        plan_weights(model)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        sync_weights(load_causal_lm(tiny_model_dir), None, bucket_bytes=0)


def _fsdp_sync(rank: int, world_size: int, model_dir: str) -> None:
    from lightrft.models import parallelize

    torch.manual_seed(0)
    model = parallelize(load_causal_lm(model_dir), activation_checkpointing=True)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    engine = NativeEngine(model_dir)
    engine_bf16 = NativeEngine(model_dir, dtype="bfloat16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(3, 99, (2, 24), generator=g)
        model(ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()

    stats = sync_weights(model, engine, bucket_bytes=64 * 1024)  # several buckets
    assert stats.buckets > 1
    full = {hf_name(n): p.full_tensor() for n, p in model.named_parameters()}
    engine_params = dict(engine.model.named_parameters())
    assert set(engine_params) == set(full)
    for name, p in engine_params.items():
        assert torch.equal(p, full[name]), name  # bit for bit, uneven shards included

    sync_weights(model, engine_bf16)
    for name, p in engine_bf16.model.named_parameters():
        assert torch.equal(p, full[name].to(torch.bfloat16)), name

    seq = list(range(3, 45))
    (c,) = engine.generate(
        [Request(seq)], SamplingParams(max_tokens=1, temperature=0.7, prompt_logprobs=True)
    )
    with torch.no_grad():
        logits = model(torch.tensor([seq]), use_cache=False).logits[0].float()
    ref = (logits[:-1] / 0.7).log_softmax(-1).gather(-1, torch.tensor(seq[1:])[:, None])
    assert torch.allclose(torch.tensor(c.prompt_logprobs), ref.squeeze(-1), atol=1e-5)

    # In place: the engine's own tensors are written, nothing goes through load_weights, and
    # the plan is cached: after another optimizer step the cached plan carries the new values.
    # (Each sync follows a backward: a no-grad forward, as above, leaves the blocks FSDP2 does
    # not reshard after forward unsharded, and such plain tensors go through load_weights.)
    from lightrft.engine import sync as sync_mod

    def train_step():
        model(ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()

    loads = []
    engine.load_weights = lambda pairs: loads.append(list(pairs))
    storage = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    train_step()
    sync_weights(model, engine)
    plan = sync_mod._PLANS[model][id(engine)]
    train_step()
    sync_weights(model, engine)
    assert sync_mod._PLANS[model][id(engine)] is plan and not loads
    full = {hf_name(n): p.full_tensor() for n, p in model.named_parameters()}
    for name, p in engine.model.named_parameters():
        assert p.data_ptr() == storage[name] and torch.equal(p, full[name]), name
    # A level-2 sleep replaces the engine's storage: the plan is rebuilt, every weight arrives.
    engine.sleep(2)
    engine.wake_up()
    sync_weights(model, engine)
    assert sync_mod._PLANS[model][id(engine)] is not plan and not loads
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, full[name]), name
    engine.generate([Request(seq)], SamplingParams(max_tokens=1))  # nothing left unloaded
    del engine.load_weights

    # A rank without an engine still takes part in the gathers, in the same order.
    sync_weights(model, engine if rank == 0 else None)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, full[name]), name
    with pytest.raises(ValueError, match="is a DTensor"):
        NativeEngine(model)


def test_fsdp2_sync_over_two_processes(tmp_path):
    # intermediate=99: gate/up projections have 99 rows, so the two shards are uneven (50 + 49).
    model_dir = make_tiny_model(tmp_path / "odd", layers=2, hidden=64, intermediate=99)
    run_distributed(_fsdp_sync, str(model_dir))
