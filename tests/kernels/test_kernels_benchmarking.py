"""The benchmark helpers: memory accounting on hand-made event lists, a tiny end-to-end probe."""

from __future__ import annotations

import pytest
import torch

from lightrft.kernels.benchmarking import (
    _probe_in_process,
    format_table,
    make_inputs,
    peak_allocated_mib,
    run_once,
    transient_peak_bytes,
)


def test_transient_peak_subtracts_only_live_returned_gradients():
    # (time, address, +alloc/-free bytes, allocated since start)
    events = [
        (0, 1, 100, 100),  # a temporary
        (1, 2, 100, 200),  # a second temporary: peak of temporaries is 200 here
        (2, 1, -100, 100),
        (3, 9, 50, 150),  # the returned gradient (address 9)
        (4, 3, 120, 270),  # a temporary while the gradient is alive: 270 - 50 = 220
        (5, 3, -120, 150),
        (6, 2, -100, 50),
    ]
    assert transient_peak_bytes(events, grad_ptrs={9}) == 220
    assert transient_peak_bytes(events, grad_ptrs=set()) == 270


def test_transient_peak_counts_a_reused_address_once():
    # Address 9 first holds a temporary, then the returned gradient: only the last one is it.
    events = [(0, 9, 80, 80), (1, 9, -80, 0), (2, 9, 50, 50), (3, 4, 10, 60)]
    assert transient_peak_bytes(events, grad_ptrs={9}) == 80


def test_probe_sees_the_naive_logits_and_not_the_kernel_ones():
    """In-process probe on a small shape: naive holds three [N, V] fp32 tensors at once in its
    backward; the kernel one [chunk, V] workspace."""
    n, vocab, hidden = 64, 4096, 32
    inp = make_inputs(n, vocab, hidden)
    nv = n * vocab * 4 / 2**20  # MiB of one [N, V] fp32 tensor
    naive = _probe_in_process("naive", "fwd+bwd", inp)["transient"]
    fused = _probe_in_process("lightrft", "fwd+bwd", inp)["transient"]
    assert naive == pytest.approx(3 * nv, rel=0.05)
    assert fused == pytest.approx(nv, rel=0.05)  # here the chunk holds all 64 rows


def test_peak_allocated_counts_frees_during_the_call():
    keep = []

    def fn():
        a = torch.empty(2**18)  # 1 MiB, freed before the next allocation
        del a
        keep.append(torch.empty(2**17))  # 0.5 MiB, still alive at the end
        b = torch.empty(2**17)  # 0.5 MiB on top: the peak is 1 MiB, not 2
        del b

    assert peak_allocated_mib(fn) == pytest.approx(1.0, abs=0.01)
    assert peak_allocated_mib(lambda: None) == 0


def test_run_once_and_table():
    inp = make_inputs(8, 64, 16)
    assert run_once("lightrft", "fwd+bwd", inp) > 0
    assert inp.weight.grad is not None
    with pytest.raises(ValueError, match="mode"):
        run_once("lightrft", "sideways", inp)
    table = format_table(
        {
            "naive": {"min_s": 2.0, "median_s": 2.0, "vs_naive": 1.0, "transient_mib": 100.0},
            "lightrft": {"min_s": 1.0, "median_s": 1.0, "vs_naive": 0.5, "transient_mib": 10.0},
        }
    )
    assert "| lightrft | 1.00 | 1.00 | 0.50 | - | 10 | 0.100 |" in table


def test_hint_provider_gives_the_same_gradients_without_recomputing(monkeypatch):
    """`lightrft-hint`: the benchmark's upstream gradient as a grad_hint; the backward only
    returns the gradients the forward computed."""
    import lightrft.kernels.logprobs as lp_mod

    inp = make_inputs(40, 300, 16)
    run_once("lightrft", "fwd+bwd", inp)
    ref = inp.hidden.grad.clone(), inp.weight.grad.clone()

    sweep = lp_mod.chunked_sweep

    def boom(*args, **kwargs):
        if kwargs.get("logp_out") is None:  # a forward writes its log-probs
            raise AssertionError("the recomputing backward ran")
        return sweep(*args, **kwargs)

    monkeypatch.setattr(lp_mod, "chunked_sweep", boom)
    run_once("lightrft-hint", "fwd+bwd", inp)
    torch.testing.assert_close(inp.hidden.grad, ref[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(inp.weight.grad, ref[1], atol=1e-6, rtol=1e-5)
