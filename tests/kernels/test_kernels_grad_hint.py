"""fused_linear_logprobs with a grad_hint: the gradients computed in the forward equal the naive
path's, the backward recomputes nothing when the hint is right, and exactly when it is not."""

from __future__ import annotations

import warnings

import pytest
import torch

import lightrft.kernels.logprobs as lp_mod
from lightrft.kernels import fused_linear_logprobs

IGNORE = -100


def naive(hidden, weight, targets, bias=None, temperature=1.0):
    """The [N, V] logits, their log-softmax, gather; entropy; 0 at ignored rows."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logp_all = torch.log_softmax(logits.to(acc) / temperature, dim=-1)  # [N, V]
    valid = targets != IGNORE
    logp = logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(valid, logp, zero), torch.where(valid, ent, zero)


def make(n=37, h=24, v=1003, dtype=torch.float32, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dtype).requires_grad_()
    bias = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = IGNORE
    w_lp, w_ent = torch.randn(2, n, generator=g)
    return hidden, weight, bias, targets, w_lp, w_ent


def grads(fn, params, w_lp, w_ent, entropy_grad):
    """Outputs and gradients of ``sum(w_lp * logp) + sum(w_ent * entropy)``."""
    for p in params:
        p.grad = None
    logp, ent = fn()
    loss = (logp * w_lp).sum()
    if entropy_grad:
        loss = loss + (ent * w_ent).sum()
    loss.backward()
    return [logp.detach(), ent.detach()] + [p.grad.clone() for p in params]


def linear_hint(w_lp, w_ent, entropy_grad):
    """The exact gradient of that loss: the weights of the rows asked for."""

    def hint(rows, logp, ent):
        return w_lp[rows], (w_ent[rows] if entropy_grad else None)

    return hint


@pytest.fixture
def no_recompute(monkeypatch):
    """Fail if the recomputing backward runs (the hint path must not need it)."""

    sweep = lp_mod.chunked_sweep

    def boom(*args, **kwargs):
        if kwargs.get("logp_out") is None:  # a forward writes its log-probs
            raise AssertionError("the recomputing backward ran")
        return sweep(*args, **kwargs)

    monkeypatch.setattr(lp_mod, "chunked_sweep", boom)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_computed_in_forward_match_naive(
    no_recompute, entropy_grad, chunk_size, temperature
):
    hidden, weight, bias, targets, w_lp, w_ent = make()
    params = (hidden, weight, bias)
    ref = grads(
        lambda: naive(hidden, weight, targets, bias, temperature), params, w_lp, w_ent, entropy_grad
    )

    def fused():
        return fused_linear_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=True,
            grad_hint=linear_hint(w_lp, w_ent, entropy_grad),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads(fused, params, w_lp, w_ent, entropy_grad)
    for name, g, r in zip(("logp", "entropy", "hidden", "weight", "bias"), got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.all(got[2][targets == IGNORE] == 0)


def test_log_probs_only_without_entropy_output(no_recompute):
    hidden, weight, _, targets, w_lp, _ = make(ignore_every=0)
    for p in (hidden, weight):
        p.grad = None
    (naive(hidden, weight, targets)[0] * w_lp).sum().backward()
    ref = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    calls = []

    def hint(rows, logp, ent):
        calls.append((rows.clone(), ent))
        return w_lp[rows], None

    out = fused_linear_logprobs(hidden, weight, targets, chunk_size=10, grad_hint=hint)
    (out * w_lp).sum().backward()
    torch.testing.assert_close(hidden.grad, ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref[1], atol=2e-5, rtol=1e-5)
    # One call per chunk, in order, with the kernel's own row indices and no entropy.
    assert [c[0].tolist() for c in calls] == [
        list(range(s, min(s + 10, 37))) for s in (0, 10, 20, 30)
    ]
    assert all(c[1] is None for c in calls)


def test_a_wrong_hint_is_noticed_and_the_backward_recomputes_exactly():
    hidden, weight, bias, targets, w_lp, w_ent = make()
    params = (hidden, weight, bias)
    ref = grads(lambda: naive(hidden, weight, targets, bias), params, w_lp, w_ent, True)

    def wrong(rows, logp, ent):  # right for the log-probs, silent about the entropy
        return w_lp[rows], None

    def fused():
        return fused_linear_logprobs(
            hidden, weight, targets, bias=bias, return_entropy=True, grad_hint=wrong
        )

    with pytest.warns(UserWarning, match="differs from the one grad_hint gave"):
        got = grads(fused, params, w_lp, w_ent, True)
    for g, r in zip(got[2:], ref[2:], strict=True):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-5)


def test_retain_graph_second_backward_recomputes():
    hidden, weight, _, targets, w_lp, _ = make()
    out = fused_linear_logprobs(hidden, weight, targets, grad_hint=linear_hint(w_lp, None, False))
    loss = (out * w_lp).sum()
    loss.backward(retain_graph=True)
    first = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss.backward()
    torch.testing.assert_close(hidden.grad, first[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad, first[1], atol=1e-6, rtol=1e-5)


def test_no_grad_and_frozen_inputs_do_not_ask_the_hint():
    hidden, weight, _, targets, _, _ = make()

    def never(rows, logp, ent):
        raise AssertionError("hint called")

    with torch.no_grad():
        got = fused_linear_logprobs(hidden, weight, targets, grad_hint=never)
    torch.testing.assert_close(got, naive(hidden, weight, targets)[0], atol=1e-5, rtol=1e-5)
    frozen = fused_linear_logprobs(hidden.detach(), weight.detach(), targets, grad_hint=never)
    assert not frozen.requires_grad


def test_frozen_weight_gets_only_the_hidden_gradient(no_recompute):
    hidden, weight, _, targets, w_lp, _ = make()
    (naive(hidden, weight.detach(), targets)[0] * w_lp).sum().backward()
    ref = hidden.grad.clone()
    hidden.grad = None
    out = fused_linear_logprobs(
        hidden, weight.detach(), targets, grad_hint=linear_hint(w_lp, None, False)
    )
    (out * w_lp).sum().backward()
    torch.testing.assert_close(hidden.grad, ref, atol=2e-5, rtol=1e-5)


def test_all_targets_ignored(no_recompute):
    hidden, weight, _, targets, w_lp, _ = make()
    targets = torch.full_like(targets, IGNORE)
    out = fused_linear_logprobs(hidden, weight, targets, grad_hint=linear_hint(w_lp, None, False))
    (out * w_lp).sum().backward()
    assert torch.all(out == 0) and torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_bf16_within_tolerance_of_fp32_truth(no_recompute):
    hidden, weight, _, targets, w_lp, _ = make(n=64, h=32, v=2001)
    h32, w32 = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    (naive(h32, w32, targets)[0] * w_lp).sum().backward()
    hb = hidden.detach().bfloat16().requires_grad_()
    wb = weight.detach().bfloat16().requires_grad_()
    out = fused_linear_logprobs(hb, wb, targets, grad_hint=linear_hint(w_lp, None, False))
    (out * w_lp).sum().backward()
    assert out.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    for got, ref in ((hb.grad, h32.grad), (wb.grad, w32.grad)):
        assert (got.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda rows, lp, e: lp, "must return a pair"),
        (lambda rows, lp, e: (lp[:-1], None), r"d loss / d logprobs must be a tensor of shape"),
        (lambda rows, lp, e: (lp, lp), "return_entropy is False"),
        (lambda rows, lp, e: ([0.0], None), "d loss / d logprobs must be a tensor"),
    ],
)
def test_bad_hints_fail_clearly(bad, match):
    hidden, weight, _, targets, _, _ = make()
    with pytest.raises(ValueError, match=match):
        fused_linear_logprobs(hidden, weight, targets, grad_hint=bad)


def test_hint_must_be_callable_and_forces_the_torch_backend():
    hidden, weight, _, targets, _, _ = make()
    with pytest.raises(ValueError, match="grad_hint must be callable"):
        fused_linear_logprobs(hidden, weight, targets, grad_hint=3)
    with pytest.raises(ValueError, match="backend='liger' cannot run here"):
        fused_linear_logprobs(
            hidden, weight, targets, backend="liger", grad_hint=lambda r, lp, e: (lp, None)
        )
    assert lp_mod.select_backend(hidden, grad_hint=True) == "torch"
