"""fused_linear_logprobs against a naive reference that builds the full logits."""

from __future__ import annotations

import time

import pytest
import torch

from lightrft.kernels import default_chunk_size, fused_linear_logprobs, select_backend

IGNORE = -100


def naive_logprobs(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=IGNORE):
    """Reference: the [N, V] logits, their log-softmax in the compute dtype, gather, mask."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logp_all = torch.log_softmax(logits.to(acc) / temperature, dim=-1)  # [N, V]
    valid = targets != ignore_index  # [N]
    logp = logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def make(n, h, v, dtype=torch.float32, bias=False, seed=0, ignore_every=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    # A trained LM head's logits span several units: scale so softmax is far from uniform.
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = IGNORE
    grads = torch.randn(2, n, generator=g, dtype=torch.float64)
    return hidden, weight, b, targets, grads


def run(fn, hidden, weight, bias, grads, entropy_grad=True):
    """Outputs and the gradients of sum(g1 * logp + g2 * entropy) w.r.t. all inputs."""
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    logp, ent = fn()
    loss = (logp * grads[0].to(logp.dtype)).sum()
    if entropy_grad:
        loss = loss + (ent * grads[1].to(ent.dtype)).sum()
    loss.backward()
    out = {"logp": logp.detach(), "entropy": ent.detach(), "hidden": hidden.grad}
    out["weight"] = weight.grad
    if bias is not None:
        out["bias"] = bias.grad
    return out


def assert_close_all(got, ref, atol, rtol):
    for k in ref:
        torch.testing.assert_close(
            got[k].double(), ref[k].double(), atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}"
        )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 8])
def test_odd_shape_matches_naive(temperature, bias, chunk_size):
    hidden, weight, b, targets, grads = make(37, 24, 1003, bias=bias, ignore_every=5)
    ref = run(
        lambda: naive_logprobs(hidden, weight, targets, b, temperature), hidden, weight, b, grads
    )
    got = run(
        lambda: fused_linear_logprobs(
            hidden,
            weight,
            targets,
            bias=b,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=True,
        ),
        hidden,
        weight,
        b,
        grads,
    )
    assert_close_all(got, ref, atol=2e-5, rtol=1e-5)
    ignored = targets == IGNORE
    assert torch.all(got["logp"][ignored] == 0) and torch.all(got["entropy"][ignored] == 0)
    assert torch.all(got["hidden"][ignored] == 0)


def test_float64_gradcheck_including_entropy():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, IGNORE, 10, 5, 5, 1])

    def f(h, w, b):
        return fused_linear_logprobs(
            h, w, targets, bias=b, temperature=1.3, chunk_size=3, return_entropy=True
        )

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_logprob_only_and_entropy_only_gradients():
    hidden, weight, _, targets, grads = make(29, 16, 301, ignore_every=4)
    for which in ("logp", "entropy"):
        refs = []
        for fn in (
            lambda: naive_logprobs(hidden, weight, targets),
            lambda: fused_linear_logprobs(
                hidden, weight, targets, chunk_size=7, return_entropy=True
            ),
        ):
            hidden.grad = weight.grad = None
            logp, ent = fn()
            (logp if which == "logp" else ent).mul(grads[0].float()).sum().backward()
            refs.append((hidden.grad.clone(), weight.grad.clone()))
        for got, ref in zip(refs[1], refs[0], strict=True):
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_frozen_weight_and_frozen_hidden():
    hidden, weight, _, targets, grads = make(20, 12, 97)
    weight.requires_grad_(False)
    fused_linear_logprobs(hidden, weight, targets).mul(grads[0].float()).sum().backward()
    ref_h = hidden.grad.clone()
    hidden.grad = None
    naive_logprobs(hidden, weight, targets)[0].mul(grads[0].float()).sum().backward()
    torch.testing.assert_close(ref_h, hidden.grad, atol=2e-5, rtol=1e-5)

    hidden2 = hidden.detach()
    weight.requires_grad_(True)
    fused_linear_logprobs(hidden2, weight, targets).mul(grads[0].float()).sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_calls_between_a_forward_and_its_backward_leave_it_intact(entropy_grad):
    """Each call's CPU scratch buffers are reused by the next call on the thread; the workspace a
    forward keeps for its backward is its own. Two grad forwards and a no-grad one (reference
    log-probs) before one backward must give the naive gradients."""
    hidden, weight, _, targets, grads = make(40, 16, 257, ignore_every=6)
    other, _, _, targets2, _ = make(24, 16, 257, seed=3)

    def two_forwards(fn):
        a = fn(hidden, targets)
        b = fn(other.detach(), targets2)
        with torch.no_grad():
            fn(other.detach().flip(0), targets2)  # overwrites every scratch buffer
        return a[0] + 0 * b[0].sum(), a[1] + 0 * b[1].sum()

    ref = run(
        lambda: two_forwards(lambda h, t: naive_logprobs(h, weight, t)),
        hidden,
        weight,
        None,
        grads,
        entropy_grad,
    )
    got = run(
        lambda: two_forwards(
            lambda h, t: fused_linear_logprobs(h, weight, t, chunk_size=16, return_entropy=True)
        ),
        hidden,
        weight,
        None,
        grads,
        entropy_grad,
    )
    assert_close_all(got, ref, atol=2e-5, rtol=1e-5)


def test_scratch_first_made_under_inference_mode_serves_training_calls():
    """A reward model or an eval scores under inference_mode before the policy trains: the
    thread's kept buffers must be ordinary tensors that a training call may write."""
    import threading

    hidden, weight, _, targets, grads = make(30, 16, 129, seed=5)
    out = {}

    def fresh_thread():  # a thread of its own: no scratch made by the tests before
        with torch.inference_mode():
            fused_linear_logprobs(hidden.detach(), weight.detach(), targets, return_entropy=True)
        out["got"] = run(
            lambda: fused_linear_logprobs(hidden, weight, targets, return_entropy=True),
            hidden,
            weight,
            None,
            grads,
        )

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    ref = run(lambda: naive_logprobs(hidden, weight, targets), hidden, weight, None, grads)
    assert_close_all(out["got"], ref, atol=2e-5, rtol=1e-5)


def test_cpu_scratch_is_reused_and_kept_workspaces_are_not():
    from lightrft.kernels.logprobs import logit_workspaces

    like = torch.zeros(2, 4)
    a = logit_workspaces(8, 100, like, entropy=True, scratch=True)
    b = logit_workspaces(4, 100, like, entropy=True, scratch=True)  # smaller: a view of the same
    assert a[0].data_ptr() == b[0].data_ptr() and a[1].data_ptr() == b[1].data_ptr()
    assert a[0].data_ptr() != a[1].data_ptr()
    c = logit_workspaces(8, 100, like, entropy=True)
    assert c[0].data_ptr() not in (a[0].data_ptr(), a[1].data_ptr())


def test_all_targets_ignored_gives_zeros_and_zero_grads():
    hidden, weight, _, targets, _ = make(6, 8, 50)
    targets[:] = IGNORE
    logp, ent = fused_linear_logprobs(hidden, weight, targets, return_entropy=True)
    assert torch.all(logp == 0) and torch.all(ent == 0)
    (logp.sum() + ent.sum()).backward()
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_no_grad_forward_and_output_dtype():
    hidden, weight, _, targets, _ = make(10, 8, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        logp = fused_linear_logprobs(hidden, weight, targets)
    assert logp.dtype == torch.float32 and not logp.requires_grad
    assert torch.all(logp <= 0)


def test_bf16_within_tolerance_of_fp32_truth():
    """bf16 inputs: compared with the fp32 computation on the same (bf16-rounded) values."""
    hidden, weight, b, targets, grads = make(45, 64, 2003, dtype=torch.bfloat16, bias=True)
    truth_inputs = [t.detach().float().requires_grad_() for t in (hidden, weight, b)]
    h32, w32, b32 = truth_inputs
    ref = run(lambda: naive_logprobs(h32, w32, targets, b32, 0.9), h32, w32, b32, grads)
    got = run(
        lambda: fused_linear_logprobs(
            hidden, weight, targets, bias=b, temperature=0.9, chunk_size=16, return_entropy=True
        ),
        hidden,
        weight,
        b,
        grads,
    )
    for k in ("hidden", "weight", "bias"):
        assert got[k].dtype == torch.bfloat16
    # Logits rounded to bf16 (8 bits of mantissa) at |logit| ~ 10: errors of a few 1e-2.
    torch.testing.assert_close(got["logp"], ref["logp"], atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(got["entropy"], ref["entropy"], atol=6e-2, rtol=2e-2)
    for k in ("hidden", "weight", "bias"):
        scale = ref[k].abs().max()
        err = (got[k].float() - ref[k]).abs().max()
        assert err <= 2e-2 * scale, f"{k}: max error {err} vs scale {scale}"


def test_default_chunk_size():
    assert default_chunk_size(4096, 151936) == 448  # 64 Mi elements / V, multiple of 64
    assert default_chunk_size(4096, 128256) == 512
    assert default_chunk_size(37, 1003) == 37  # never more than N
    assert default_chunk_size(10**6, 10**8) == 64  # at least one row block


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden": torch.zeros(2, 3, 4)}, "hidden must be"),
        ({"weight": torch.zeros(5, 3)}, "weight must be"),
        ({"targets": torch.zeros(3, dtype=torch.long)}, "targets must be"),
        ({"targets": torch.zeros(2)}, "integer"),
        ({"targets": torch.tensor([0, 5])}, r"targets must lie in \[0, 5\)"),
        ({"bias": torch.zeros(4)}, "bias must be"),
        ({"temperature": 0.0}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"backend": "triton"}, "backend must be one of"),
        ({"weight": torch.zeros(5, 4, dtype=torch.float64)}, "share one floating dtype"),
    ],
)
def test_input_errors(kwargs, match):
    args = {
        "hidden": torch.zeros(2, 4),
        "weight": torch.zeros(5, 4),
        "targets": torch.tensor([0, 4]),
    }
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k not in args}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_linear_logprobs(args["hidden"], args["weight"], args["targets"], **opts)


def test_backend_selection_on_cpu():
    h = torch.zeros(2, 4)
    assert select_backend(h) == "torch"
    assert select_backend(h, backend="torch") == "torch"
    with pytest.raises(ValueError, match="backend='liger' cannot run here"):
        select_backend(h, backend="liger")
    with pytest.raises(ValueError, match="return_entropy"):
        select_backend(h, return_entropy=True, backend="liger")


def assert_grads_close_to_scale(got, ref, rel):
    """Long fp32 sums in a different order: compare against the tensor's own magnitude."""
    for k in ("hidden", "weight", "bias"):
        if k in ref:
            err = (got[k] - ref[k]).abs().max()
            assert err <= rel * ref[k].abs().max(), f"{k}: max error {err:.3g}"


def check_real_lm_head(n, chunk_size):
    """Qwen2.5-0.5B's LM head (V=151936, H=896), fp32, several chunks, ignored rows."""
    hidden, weight, _, targets, grads = make(n, 896, 151936, seed=3, ignore_every=7)
    # Reference and kernel in sequence; each one's [N, V] temporaries die before the next.
    ref = run(lambda: naive_logprobs(hidden, weight, targets), hidden, weight, None, grads)
    got = run(
        lambda: fused_linear_logprobs(
            hidden, weight, targets, chunk_size=chunk_size, return_entropy=True
        ),
        hidden,
        weight,
        None,
        grads,
    )
    torch.testing.assert_close(got["logp"], ref["logp"], atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(got["entropy"], ref["entropy"], atol=5e-5, rtol=1e-5)
    # Over V=151936 terms both fp32 paths are off a float64 reference by about 5e-5 of the
    # gradient's largest entry (measured: naive 4.3e-5 / 5.7e-5, fused 5.5e-5 / 7.1e-5 for
    # hidden / weight at N=256), so they can differ by about that much from each other.
    assert_grads_close_to_scale(got, ref, rel=1e-4)


@pytest.mark.slow  # 11 s on 2 cores; the odd shapes above check the same code in the default suite
def test_real_vocab_small_batch():
    """The real vocabulary and hidden size at 256 tokens (3 chunks of 96)."""
    check_real_lm_head(256, chunk_size=96)


@pytest.mark.slow
def test_realistic_shape_matches_naive():
    """N=2048 with the default chunk size (about a minute on a shared 2-core machine)."""
    start = time.perf_counter()
    check_real_lm_head(2048, chunk_size=None)
    print(f"realistic shape: {time.perf_counter() - start:.1f} s")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_matches_torch_on_cuda(dtype):
    pytest.importorskip("triton")
    hidden, weight, b, targets, grads = make(300, 128, 5003, dtype=dtype, bias=True, ignore_every=3)
    hidden, weight, b = (t.detach().cuda().requires_grad_() for t in (hidden, weight, b))
    targets, grads = targets.cuda(), grads.cuda()
    assert select_backend(hidden) == "liger"
    assert select_backend(hidden, return_entropy=True) == "torch"
    outs = []
    for backend in ("torch", "liger"):
        outs.append(
            run(
                lambda backend=backend: (
                    fused_linear_logprobs(
                        hidden, weight, targets, bias=b, temperature=0.8, backend=backend
                    ),
                    torch.zeros(300, device="cuda"),
                ),
                hidden,
                weight,
                b,
                grads,
                entropy_grad=False,
            )
        )
    if dtype == torch.float32:
        assert_close_all(outs[1], outs[0], atol=2e-4, rtol=1e-4)
        return
    # bf16: the two backends round the partial sums of the weight and bias gradients (sums
    # over the 300 rows) at different points, so a few of their 640k entries differ by several
    # bf16 ulps (measured on an H100: 2 entries, 0.125 at 2.8). Per entry for the other
    # outputs; the sums by their relative error as a whole and a looser bound per entry.
    sums = ("weight", "bias")
    assert_close_all(
        {k: v for k, v in outs[1].items() if k not in sums},
        {k: v for k, v in outs[0].items() if k not in sums},
        atol=5e-2,
        rtol=2e-2,
    )
    for k in sums:
        got, ref = outs[1][k].double(), outs[0][k].double()
        assert (got - ref).norm() / ref.norm() < 1e-2, k
        torch.testing.assert_close(got, ref, atol=0.25, rtol=0.05, msg=lambda m, k=k: f"{k}: {m}")
