"""Warmup + cosine LR schedule and FSDP2-aware gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_distributed

from lightrft.models import load_causal_lm
from lightrft.models.parallel import parallelize
from lightrft.training.optim import clip_grad_norm, warmup_cosine_lr_ratio, warmup_cosine_scheduler


def test_warmup_cosine_values():
    f = lambda s: warmup_cosine_lr_ratio(s, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0  # decay starts from the peak
    assert f(8) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 8 decay steps
    assert f(12) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    vals = [f(s) for s in range(4, 13)]
    assert all(a > b for a, b in zip(vals, vals[1:], strict=False))
    # No warmup: starts at 1; warmup == total: stays at the peak then drops to the floor.
    assert warmup_cosine_lr_ratio(0, warmup_steps=0, total_steps=10) == 1.0
    assert warmup_cosine_lr_ratio(5, warmup_steps=0, total_steps=10) == pytest.approx(0.5)
    assert warmup_cosine_lr_ratio(3, warmup_steps=4, total_steps=4) == 1.0
    assert warmup_cosine_lr_ratio(4, warmup_steps=4, total_steps=4, min_lr_ratio=0.2) == 0.2


def test_scheduler_drives_optimizer_and_resumes_exactly():
    def make():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        return opt, warmup_cosine_scheduler(opt, warmup_steps=2, total_steps=6, min_lr_ratio=0.0)

    opt, sched = make()
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [2.0 * warmup_cosine_lr_ratio(s, warmup_steps=2, total_steps=6) for s in range(7)]
    assert lrs == pytest.approx(want) and lrs[0] == 1.0 and lrs[6] == pytest.approx(0.0)

    opt, sched = make()
    for _ in range(3):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    # As the Checkpointer does: the optimizer's param groups carry the current LR, the
    # scheduler its step count; both together continue the schedule exactly.
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == lrs[3]
    for s in range(3, 7):
        assert opt2.param_groups[0]["lr"] == pytest.approx(lrs[s])
        opt2.step()
        sched2.step()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"warmup_steps": 1, "total_steps": 0}, "total_steps"),
        ({"warmup_steps": 11, "total_steps": 10}, "warmup_steps"),
        ({"warmup_steps": -1, "total_steps": 10}, "warmup_steps"),
        ({"warmup_steps": 1, "total_steps": 10, "min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_scheduler_rejects_bad_arguments(kwargs, field):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=field):
        warmup_cosine_scheduler(opt, **kwargs)


def test_clip_grad_norm_plain():
    p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    p1.grad = torch.tensor([3.0, 0.0, 0.0])
    p2.grad = torch.tensor([0.0, 4.0])
    no_grad = torch.nn.Parameter(torch.zeros(1))
    assert clip_grad_norm([p1, p2, no_grad], None) == 5.0  # measure only
    assert torch.equal(p1.grad, torch.tensor([3.0, 0.0, 0.0]))
    assert clip_grad_norm([p1, p2], 1.0) == 5.0  # returns the norm before clipping
    total = math.sqrt(float(p1.grad.square().sum() + p2.grad.square().sum()))
    assert total == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm([no_grad], 1.0) == 0.0


def _loss(model) -> torch.Tensor:
    x = torch.randint(3, 99, (2, 12), generator=torch.Generator().manual_seed(0))  # [B, T]
    return model(input_ids=x, labels=x, use_cache=False).loss


def _clip_worker(rank: int, world_size: int, model_dir: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    model = parallelize(load_causal_lm(model_dir))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    _loss(model).backward()  # same batch on both ranks: averaged grads equal the 1-process ones
    norm = clip_grad_norm(model, 0.5)
    after = clip_grad_norm(model, None)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"norm": norm, "after": after, "grads": grads}, out)


def test_clip_grad_norm_fsdp2_matches_single_process(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir)
    _loss(model).backward()
    norm = clip_grad_norm(model, 0.5)
    assert norm > 0.5  # so clipping really happens
    out = tmp_path / "fsdp.pt"
    run_distributed(_clip_worker, str(tiny_model_dir), str(out))
    got = torch.load(out)
    assert got["norm"] == pytest.approx(norm, rel=1e-5)
    assert got["after"] == pytest.approx(0.5, rel=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-4, atol=1e-7)


def test_cpu_offload_optimizer_names_a_bad_inner_optimizer():
    from lightrft.training import cpu_offload_optimizer

    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="torch.optim.AdamWW"):
        cpu_offload_optimizer([p], optimizer="torch.optim.AdamWW", lr=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchao CPU offload needs CUDA")
def test_cpu_offload_optimizer_steps_cuda_params():
    from lightrft.training import cpu_offload_optimizer

    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    opt = cpu_offload_optimizer([p], optimizer="torch.optim.AdamW", lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.all(p < 1)
