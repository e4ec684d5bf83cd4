"""LoRA (PEFT) on tiny HF models: options, targets, reference = adapters off, and the whole
train -> sync -> checkpoint -> export path on 1 process and FSDP2 over 2 gloo processes."""

from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from _serial import each
from omegaconf import OmegaConf

pytest.importorskip("peft")

from lightrft.engine.sync import iter_weight_buckets  # noqa: E402
from lightrft.models import load_causal_lm, load_tokenizer, parallelize  # noqa: E402
from lightrft.models.forward import causal_lm_cross_entropy  # noqa: E402
from lightrft.models.lora import (  # noqa: E402
    adapters_disabled,
    apply_lora,
    export_adapter,
    resolve_targets,
)
from lightrft.sections import LoraConfig, StrategyConfig  # noqa: E402
from lightrft.training import Checkpointer  # noqa: E402
from lightrft.training.export import export_merged  # noqa: E402

DECODER_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_options_defaults_and_null_section():
    assert StrategyConfig.read({"lora": None}).lora is None
    o = LoraConfig.read(OmegaConf.create({"rank": 4, "alpha": None}))
    assert o == LoraConfig(rank=4, alpha=8.0)
    o = LoraConfig.read(OmegaConf.create({"rank": 2, "target_modules": ["q_proj"]}))
    assert o.targets == ("q_proj",)


@pytest.mark.parametrize(
    "node,match",
    [
        ({"alpha": 8}, "lora.rank: set the adapter rank"),
        ({"rank": 0}, "lora.rank must be >= 1"),
        ({"rank": 4, "dropout": 1.0}, r"lora.dropout must be in \[0, 1\)"),
        ({"rank": 4, "target_modules": "all"}, "lora.target_modules must be 'auto'"),
        ({"rank": 4, "target_modules": []}, "lora.target_modules is empty"),
    ],
)
def test_options_errors_name_the_key(node, match):
    with pytest.raises(ValueError, match=match):
        LoraConfig.read(OmegaConf.create(node), "lora.")


def test_auto_targets_every_decoder_linear_not_the_head(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    assert resolve_targets(model, LoraConfig.read({"rank": 2, "alpha": 4})) == DECODER_LINEARS
    peft_model = apply_lora(model, LoraConfig.read({"rank": 2, "alpha": 4}))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(".lora_A." in n for n in trainable) == 7 * model.config.num_hidden_layers


def test_a_target_that_matches_nothing_fails_before_training(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    with pytest.raises(ValueError, match=r"lora.target_modules: 'qkv_proj' matches no linear"):
        apply_lora(
            model,
            LoraConfig.read({"rank": 2, "alpha": 4, "target_modules": ["q_proj", "qkv_proj"]}),
        )
    with pytest.raises(ValueError, match="lora.target_modules: 'lm_head' matches no linear"):
        apply_lora(model, LoraConfig.read({"rank": 2, "alpha": 4, "target_modules": ["lm_head"]}))
    with pytest.raises(ValueError, match=r"lora.trained_modules: \['head'\]"):
        apply_lora(model, LoraConfig.read({"rank": 2, "alpha": 4, "trained_modules": ["head"]}))


# ------------------------------------------------------------------ the whole path, 1 and 2 ranks

OPTS = LoraConfig.read({"rank": 4, "alpha": 8.0, "trained_modules": ["lm_head"]})


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 90, (2, 12), generator=g)  # [B, T]


def _train(model, steps):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = causal_lm_cross_entropy(model, _batch(), num_tokens=22.0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _lora_model(path):
    torch.manual_seed(0)  # PEFT draws lora_A from the global generator
    return apply_lora(load_causal_lm(path), OPTS)


def _whole_path(rank, world, path, out):
    import torch.distributed as dist
    from peft import PeftModel
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    sharded = world > 1
    # Reference: the same training, plain and unsharded, in this process.
    ref = _lora_model(path)
    _train(ref, 2)
    base = load_causal_lm(path).eval()

    model = parallelize(_lora_model(path))
    params = list(model.parameters())
    # Mixed Tensor/DTensor is what breaks FSDP2 + PEFT: every parameter must be one kind.
    assert all(isinstance(p, DTensor) == sharded for p in params)
    opt = _train(model, 2)
    for (n, p), (n_ref, p_ref) in zip(
        model.named_parameters(), ref.named_parameters(), strict=True
    ):
        assert n == n_ref
        full = p.full_tensor() if sharded else p
        torch.testing.assert_close(full, p_ref, rtol=1e-4, atol=1e-6, msg=n)

    ids = _batch()
    model.eval()
    # Reference policy = adapters off: the base model's logits exactly (no second model).
    with adapters_disabled(model):
        torch.testing.assert_close(_logits(model, ids), _logits(base, ids), rtol=0, atol=1e-5)
    # PEFT's disable_adapter() would leave sharded adapters frozen under FSDP2: ours must not.
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in params]
    trained = _logits(model, ids)
    assert (trained - _logits(base, ids)).abs().max() > 1e-3  # the adapters did move
    torch.testing.assert_close(trained, _logits(ref, ids), rtol=1e-4, atol=1e-4)

    # Weight sync: HF names, adapters merged; equal to PEFT's own merge of the reference.
    synced = {n: t.clone() for b in iter_weight_buckets(model) for n, t in b}
    want = ref.merge_and_unload().state_dict()
    assert set(synced) == {n for n, _ in base.named_parameters()}
    for n, t in synced.items():
        torch.testing.assert_close(t, want[n], rtol=1e-4, atol=1e-5, msg=n)

    # Checkpoint: trainable parameters + optimizer only; a fresh model resumes bitwise.
    ckpt = Checkpointer(out / f"run{world}")
    saved = ckpt.save(1, models=model, optimizers=opt)
    fresh = parallelize(_lora_model(path))
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    ckpt.load(saved, models=fresh, optimizers=fresh_opt)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        a, b = (p.full_tensor(), q.full_tensor()) if sharded else (p, q)
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for k in s1:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = s1[k][key], s2[k][key]
            a, b = (a.full_tensor(), b.full_tensor()) if isinstance(a, DTensor) else (a, b)
            assert torch.equal(a, b), (k, key)
    if rank == 0:
        import torch.distributed.checkpoint as dcp

        keys = dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata.keys()
        model_keys = [k for k in keys if k.startswith("model.model.model.")]
        assert model_keys and all(".lora_" in k or "modules_to_save" in k for k in model_keys)

    # Export: the adapter directory and the merged model, each loadable with the same logits.
    tok = load_tokenizer(path)
    export_adapter(model, tok, out / f"adapter{world}")
    export_merged(model, tok, out / f"merged{world}")
    if rank == 0:
        loaded = PeftModel.from_pretrained(load_causal_lm(path), out / f"adapter{world}").eval()
        torch.testing.assert_close(_logits(loaded, ids), trained, rtol=1e-4, atol=1e-4)
        merged = AutoModelForCausalLM.from_pretrained(out / f"merged{world}").eval()
        torch.testing.assert_close(_logits(merged, ids), trained, rtol=1e-4, atol=1e-4)
    if sharded:
        dist.barrier()


def test_lora_whole_path_single_process(tiny_model_dir, tmp_path):
    _whole_path(0, 1, tiny_model_dir, tmp_path)


def test_lora_whole_path_fsdp2_two_processes(two_rank_lora):
    # _whole_path ran its checks in both ranks in the fixture's spawn.
    assert (two_rank_lora["whole"] / "merged2").is_dir()


# ------------------------------------------------------------------ resharding across world sizes


def _full_state(model, opt):
    """Every trainable parameter and its AdamW state as full tensors (collective)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.clone()

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = {n: full(p) for n, p in params}
    for n, p in params:
        for key, v in opt.state[p].items():
            out[f"{n}/{key}"] = full(v)
    return out


def _assert_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _fresh(path):
    model = parallelize(_lora_model(path))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _reshard_worker(rank, world, path, out):
    # 1 -> 2: the single-process checkpoint loads into 2 shards, bitwise.
    model, opt = _fresh(path)
    Checkpointer(out / "one").load_latest(models=model, optimizers=opt, restore_rng=False)
    _assert_equal(_full_state(model, opt), torch.load(out / "one.pt"))
    # 2 -> 1: train on, save with 2 processes, and leave the full state for the parent.
    _train(model, 1)
    Checkpointer(out / "two").save(1, models=model, optimizers=opt)
    state = _full_state(model, opt)
    if rank == 0:
        torch.save(state, out / "two.pt")


@pytest.fixture(scope="module")
def two_rank_lora(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """One spawn of 2 gloo ranks for the 2-rank bodies of this module: :func:`_whole_path`
    (in ``whole``) and :func:`_reshard_worker` (in ``reshard``, from the one-process checkpoint
    made here first)."""
    dirs = {
        "whole": tmp_path_factory.mktemp("lora_whole"),
        "reshard": tmp_path_factory.mktemp("lora_reshard"),
    }
    model, opt = _fresh(tiny_model_dir)
    _train(model, 2)
    Checkpointer(dirs["reshard"] / "one").save(2, models=model, optimizers=opt)
    torch.save(_full_state(model, opt), dirs["reshard"] / "one.pt")
    run_distributed(
        each,
        [
            (_whole_path, (tiny_model_dir, dirs["whole"])),
            (_reshard_worker, (tiny_model_dir, dirs["reshard"])),
        ],
        world_size=2,
    )
    return dirs


def test_lora_checkpoint_reshards_between_1_and_2_processes(tiny_model_dir, two_rank_lora):
    # 1 -> 2 was checked in both ranks by the fixture's spawn; 2 -> 1 here.
    out = two_rank_lora["reshard"]
    model, opt = _fresh(tiny_model_dir)
    Checkpointer(out / "two").load_latest(models=model, optimizers=opt, restore_rng=False)
    _assert_equal(_full_state(model, opt), torch.load(out / "two.pt"))
