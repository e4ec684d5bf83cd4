"""Ulysses sequence parallelism for a vision-language model (tiny Qwen2-VL, M-RoPE): each rank
merges the images into the whole row's embeddings and computes the whole row's 3-D positions,
then keeps its slice at the decoder's entry. On 2 gloo processes (SP 2) the log-probs, the loss,
the FSDP2-reduced gradients (vision tower included) and the updated weights equal one plain
process (fp32, 1e-5), padded and packed."""

from __future__ import annotations

import copy

import pytest
import torch
from _dist import run_distributed
from _vision_helpers import square

IGNORE = -100


def _batch(proc, packing: bool) -> dict:
    from lightrft.data import SFTDataset, pack_or_pad_collator

    recs = [
        {"prompt": "<image>What colour?", "completion": "red", "images": [square((255, 0, 0))]},
        {
            "prompt": "<image> then <image>: same?",
            "completion": "no, they differ.",
            "images": [square((0, 255, 0), (84, 56)), square((0, 0, 255), (40, 70))],
        },
        {"prompt": "No image here.", "completion": "ok!"},
    ]
    ds = SFTDataset(proc, records=recs)
    return pack_or_pad_collator(proc.tokenizer, packing)([ds[i] for i in range(len(ds))])


def _loss(model, batch, n_tokens: float, sp=None):
    from lightrft.models.forward import causal_lm_cross_entropy, causal_lm_token_logprobs

    targets = batch["labels"][:, 1:]
    kw = dict(
        targets=targets,
        attention_mask=batch.get("attention_mask"),
        position_ids=batch["position_ids"],
        media=batch["media"],
        sequence_parallel=sp,
    )
    lp = causal_lm_token_logprobs(model, batch["input_ids"], **kw)  # [B, T-1]
    ce = causal_lm_cross_entropy(model, batch["input_ids"], num_tokens=n_tokens, **kw)
    weights = torch.linspace(-1.0, 1.0, targets.numel()).view(targets.shape)
    return lp, ce, -(lp * weights * (targets != IGNORE)).sum() / n_tokens


def _body(rank: int, world: int, path: str, packing: bool) -> None:
    import torch.distributed as dist

    from lightrft.models.multimodal import load_processor, load_vision_model, set_vision_trainable
    from lightrft.models.parallel import build_mesh, parallelize
    from lightrft.models.ulysses import Ulysses, check_model, sp_groups

    proc, model = load_processor(path), load_vision_model(path)
    set_vision_trainable(model, True)
    check_model(model.config, world)
    batch = _batch(proc, packing)
    n_tokens = float((batch["labels"][:, 1:] != IGNORE).sum())
    assert batch["input_ids"].shape[1] % world, "a length SP does not divide"
    ref = copy.deepcopy(model)
    lp_ref, ce, pg = _loss(ref, batch, n_tokens)
    (ce + pg).backward()
    ref_loss = float(ce + pg)

    group, sp_rank = sp_groups(world)
    sp = Ulysses(group, world, sp_rank)
    parallelize(model, mesh=build_mesh(None, None, "cpu"), param_dtype=torch.float32)
    lp, ce, pg = _loss(model, batch, n_tokens / world, sp)
    torch.testing.assert_close(lp, lp_ref.detach(), rtol=1e-5, atol=1e-5)
    (ce + pg).backward()
    share = torch.tensor(float(ce) / world + float(pg) / world / world)
    dist.all_reduce(share)
    assert abs(float(share) - ref_loss) < 1e-5, (float(share), ref_loss)
    ref_params = dict(ref.named_parameters())
    grads = 0
    for name, p in model.named_parameters():
        if p.grad is None:
            assert ref_params[name].grad is None, name
            continue
        grads += name.startswith("model.visual.")
        want = ref_params[name].grad
        torch.testing.assert_close(p.grad.full_tensor(), want, rtol=1e-5, atol=1e-5, msg=name)
    assert grads > 0, "the vision tower got no gradient"
    for m in (model, ref):
        torch.optim.SGD([p for p in m.parameters() if p.grad is not None], lr=0.5).step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_ulysses_vlm_equals_one_process(tiny_vlm, packing):
    run_distributed(_body, str(tiny_vlm("qwen2_vl")), packing, world_size=2)
