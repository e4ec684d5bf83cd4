"""Batched sampling primitives: counter-based uniforms, top-k / top-p masks, inverse-CDF draws."""

import math

import pytest
import torch

from lightrft.engine import sampling as smp


def test_uniforms_are_deterministic_in_range_and_vary():
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62 - 1])
    a, b = smp.uniforms(seeds, 3), smp.uniforms(seeds, 3)
    assert torch.equal(a, b)
    assert bool(((a > 0) & (a < 1)).all())
    assert len(set(a.tolist())) == 4  # different seeds, different draws
    assert not torch.equal(a, smp.uniforms(seeds, 4))  # different steps, different draws


def test_uniforms_look_uniform():
    u = smp.uniforms(smp.row_seeds(torch.arange(20000), torch.zeros(20000, dtype=torch.long)), 5)
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    # Each bin expects 2000 with sd ~42; 5 sd is a loose bound that a broken hash would break.
    assert (counts - 2000).abs().max() < 5 * math.sqrt(2000 * 0.9)
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_row_seeds_separate_samples_of_one_request():
    s = smp.row_seeds(torch.full((8,), 42), torch.arange(8))
    assert len(set(s.tolist())) == 8
    assert bool((s >= 0).all())


def test_top_k_keeps_the_k_largest_per_row():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5, 3.0], [1.0, 0.0, 2.0, -3.0, 0.5]])
    out = smp.process_logits(
        logits, torch.ones(2), torch.tensor([2, 0]), torch.ones(2)
    )  # row 0: top-2, row 1: off
    assert torch.isfinite(out[0]).tolist() == [False, True, False, False, True]
    assert torch.isfinite(out[1]).all()
    assert torch.equal(out[0, [1, 4]], logits[0, [1, 4]])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(3, 1)
    top_p = torch.tensor([0.8, 0.81, 0.4])
    out = smp.process_logits(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), top_p)
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept == [2, 3, 1]  # 0.5+0.3 reaches 0.8; 0.81 needs the third; 0.5 alone covers 0.4


def test_temperature_scales_before_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    # At T=0.25 the top token has ~98% of the mass, so top_p=0.9 keeps only it.
    cold = smp.process_logits(
        logits, torch.tensor([0.25]), torch.zeros(1, dtype=torch.long), torch.tensor([0.9])
    )
    hot = smp.process_logits(
        logits, torch.tensor([4.0]), torch.zeros(1, dtype=torch.long), torch.tensor([0.9])
    )
    assert torch.isfinite(cold).sum() == 1
    assert torch.isfinite(hot).sum() == 3
    assert torch.allclose(hot, logits / 4.0)


def test_greedy_rows_take_argmax_and_report_temperature_one_logprob():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    tok, lp = smp.sample(
        logits,
        torch.zeros(4),
        torch.zeros(4, dtype=torch.long),
        torch.ones(4),
        torch.rand(4).double(),
    )
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1))


def test_draws_follow_the_processed_distribution():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, -4.0])
    rows = 40000
    temp = torch.full((rows,), 0.8)
    top_k = torch.full((rows,), 4, dtype=torch.long)  # token 4 is masked away
    u = smp.uniforms(smp.row_seeds(torch.arange(rows), torch.zeros(rows, dtype=torch.long)), 0)
    tok, lp = smp.sample(logits.expand(rows, -1), temp, top_k, torch.ones(rows), u)
    want = torch.softmax(torch.tensor([1.0, 0.0, -0.5, 2.0]) / 0.8, -1)
    freq = torch.bincount(tok, minlength=5).double() / rows
    assert freq[4] == 0
    assert torch.allclose(freq[:4], want.double(), atol=0.01)
    assert torch.allclose(lp, want.log()[tok], atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.9)])
def test_token_logprobs_match_a_naive_reference(top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 17, generator=g)
    targets = logits.argsort(-1, descending=True)[:, 0]  # always inside the kept set
    got = smp.token_logprobs(logits, targets, 0.7, top_k, top_p)
    ref = []
    for row, t in zip(logits / 0.7, targets.tolist(), strict=True):
        order = row.argsort(descending=True).tolist()
        keep = order[:top_k] if top_k else order
        probs = torch.softmax(row[keep], -1)
        cut, mass = [], 0.0
        for idx, pr in zip(keep, probs.tolist(), strict=True):
            if top_p < 1 and mass >= top_p:
                break
            cut.append(idx)
            mass += pr
        ref.append(float(torch.log_softmax(row[cut], -1)[cut.index(t)]))
    assert torch.allclose(got, torch.tensor(ref), atol=1e-6)


def _reference_sample(logits, temperature, top_k, top_p, u, suppress=None):
    """The plain form of the draw: fresh tensors, the argmax always taken, the temperature
    always divided. ``smp.sample`` skips and fuses passes; its tokens must stay these."""
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]
    masked = smp.process_logits(scaled, torch.ones_like(temp), top_k, top_p)
    logp = masked.log_softmax(dim=-1)
    draw_from, pick_from = logp, logits
    if suppress is not None:
        draw_from = logp.index_fill(-1, suppress, float("-inf"))
        pick_from = logits.index_fill(-1, suppress, float("-inf"))
    cdf = draw_from.double().exp().cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    drawn = drawn.clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, pick_from.argmax(dim=-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("temps", ["ones", "mixed", "greedy_rows"])
@pytest.mark.parametrize("suppress", [None, [3, 17, 250]])
def test_sample_gives_the_plain_forms_tokens_bit_for_bit(temps, suppress):
    g = torch.Generator().manual_seed(7)
    a, v = 64, 1000
    logits = torch.randn(a, v, generator=g) * 3
    temperature = {
        "ones": torch.ones(a),
        "mixed": torch.rand(a, generator=g) + 0.3,
        "greedy_rows": torch.where(torch.arange(a) % 3 == 0, 0.0, 1.0),
    }[temps]
    top_k = torch.where(torch.arange(a) % 4 == 1, 20, 0)
    top_p = torch.where(torch.arange(a) % 5 == 2, 0.9, 1.0)
    u = torch.rand(a, generator=g, dtype=torch.float64)
    sup = None if suppress is None else torch.tensor(suppress)
    tok, lp = smp.sample(logits, temperature, top_k, top_p, u, sup)
    ref_tok, ref_lp = _reference_sample(logits, temperature, top_k, top_p, u, sup)
    assert torch.equal(tok, ref_tok)
    assert torch.equal(lp, ref_lp)
    if sup is not None:
        assert not bool(torch.isin(tok, sup).any())
