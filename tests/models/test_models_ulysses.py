"""Ulysses sequence parallelism (lightrft.models.ulysses) against one plain process: the
log-probs, the loss, the gradients after FSDP2's reduction and the updated weights are equal
(fp32, 1e-5) on 2 and 4 gloo processes, for padded and packed rows whose length N does not
divide, through both funnels (the fused log-probs a GRPO loss reads and the SFT cross entropy).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from lightrft.sections import StrategyConfig
from tests._dist import run_distributed

IGNORE = -100


def _tiny_qwen2(kv_heads: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).float()


def _batch(group: int, packed: bool):
    """One micro-batch of SP group ``group``: (input_ids, targets, attention_mask,
    position_ids, loss weights [B, T-1]); lengths 13 and 10 (N = 2, 4 divide neither 13 nor
    23, the packed row's length)."""
    g = torch.Generator().manual_seed(100 + group)
    lengths = [13, 10]
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    prompt = 4
    if packed:
        ids = torch.cat(seqs)[None]  # [1, 23]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        targets = torch.full((1, ids.shape[1] - 1), IGNORE)
        start = 0
        for s in seqs:
            cols = torch.arange(start + prompt - 1, start + len(s) - 1)
            targets[0, cols] = s[prompt:]
            start += len(s)
        mask = None
    else:
        t = max(lengths)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        mask = torch.zeros(len(seqs), t, dtype=torch.long)
        targets = torch.full((len(seqs), t - 1), IGNORE)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
            targets[i, prompt - 1 : len(s) - 1] = s[prompt:]
        pos = None
    weights = torch.randn(targets.shape, generator=g) * (targets != IGNORE)
    return ids, targets, mask, pos, weights


def _loss(model, batch, n_tokens: float, sp=None):
    """A GRPO-like term (weighted log-probs) plus the SFT cross entropy; each normalised by the
    step's token count. Under SP: this rank's share (the log-prob term is gathered whole)."""
    from lightrft.models.forward import causal_lm_cross_entropy, causal_lm_token_logprobs

    ids, targets, mask, pos, weights = batch
    kw = dict(targets=targets, attention_mask=mask, position_ids=pos, sequence_parallel=sp)
    lp = causal_lm_token_logprobs(model, ids, **kw)  # [B, T-1]
    ce = causal_lm_cross_entropy(model, ids, num_tokens=n_tokens, **kw)
    return lp, ce, -(lp * weights).sum() / n_tokens


def _body(
    rank: int, world: int, sp_size: int, packed: bool, kv_heads: int, compile: bool = False
) -> None:
    import torch.distributed as dist

    from lightrft.models.parallel import build_mesh, parallelize
    from lightrft.models.ulysses import Ulysses, check_model, enable, sp_groups

    groups = world // sp_size
    batches = [_batch(g, packed) for g in range(groups)]
    n_tokens = float(sum(int((b[1] != IGNORE).sum()) for b in batches))

    model = _tiny_qwen2(kv_heads)
    check_model(model.config, sp_size)
    ref = copy.deepcopy(model)
    ref_loss = 0.0
    for b in batches:  # the whole step in one plain process
        lp, ce, pg = _loss(ref, b, n_tokens)
        (ce + pg).backward()
        ref_loss += float(ce + pg)
    ref_lp = _loss(ref, batches[rank // sp_size], n_tokens)[0].detach()

    group, sp_rank = sp_groups(sp_size)
    sp = Ulysses(group, sp_size, sp_rank)
    enable(model)
    parallelize(model, mesh=build_mesh(None, None, "cpu"), compile=compile)
    mine = batches[rank // sp_size]  # every rank of an SP group gets the same micro-batch
    lp, ce, pg = _loss(model, mine, n_tokens / world, sp)
    if compile:  # the blocks ran compiled, each as whole graphs (the all-to-alls traced)
        from torch._dynamo.utils import counters

        assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    # FSDP2 averages gradients over the world: the gathered term, equal on every SP rank and
    # back-propagated through this rank's slice only, is scaled by the world too.
    (ce + pg).backward()
    if compile:
        assert not counters["graph_break"], dict(counters["graph_break"])
    share = torch.tensor(float(ce) / world + float(pg) / sp_size / world)
    dist.all_reduce(share)
    assert abs(float(share) - ref_loss) < 1e-5, (float(share), ref_loss)

    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()
        torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name], rtol=1e-5, atol=1e-5)


def _list_all_to_all(x, scatter_dim: int, gather_dim: int):
    """The reference: ``dist.all_to_all`` over lists of chunks."""
    import torch.distributed as dist

    ins = [c.contiguous() for c in x.chunk(dist.get_world_size(), dim=scatter_dim)]
    outs = [torch.empty_like(c) for c in ins]
    dist.all_to_all(outs, ins)
    return torch.cat(outs, dim=gather_dim)


def _all_to_all_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from lightrft.models.ulysses import all_to_all

    group = dist.group.WORLD
    torch.manual_seed(rank)
    compiled = torch.compile(all_to_all, fullgraph=True, dynamic=True)  # breaks: an error
    for fn in (all_to_all, compiled):
        for t in (5, 7):  # [B, H, T/N, D] -> [B, H/N, T, D] and back; two lengths (dynamic)
            x = torch.randn(2, 4 * world, t, 3, requires_grad=True)
            y = fn(x, group, world, 1, 2)
            assert torch.equal(y, _list_all_to_all(x.detach(), 1, 2))
            assert torch.equal(fn(y, group, world, 2, 1), x)
            grad = torch.randn_like(y)
            y.backward(grad)
            assert torch.equal(x.grad, _list_all_to_all(grad, 2, 1))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_equals_dist_all_to_all_eager_and_fullgraph(world):
    """``ulysses.all_to_all`` (a functional collective) moves the same values as
    ``dist.all_to_all`` over chunk lists, forward and backward, in eager and under
    ``torch.compile(fullgraph=True, dynamic=True)`` (which raises at a graph break) on gloo."""
    run_distributed(_all_to_all_body, world_size=world)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "sp_size", "kv_heads"),
    [(2, 2, 2), (4, 2, 2), (4, 4, 4)],
    ids=["world2-sp2-gqa", "world4-sp2-dp2", "world4-sp4"],
)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_ulysses_equals_one_process(world, sp_size, kv_heads, packed):
    run_distributed(_body, sp_size, packed, kv_heads, world_size=world)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_ulysses_compiled_blocks_equal_one_process(packed):
    """``model.compile`` with SP: each decoder block compiled (``torch.compile(dynamic=True)``,
    inductor) as whole graphs, the Ulysses all-to-alls (functional collectives over gloo)
    and the packed rows' per-sample attention (a one-token block: the SP padding) traced, no
    graph break in forward or backward; the log-probs, loss, reduced gradients and updated
    weights equal one plain eager process (SP 2 on 2 processes, padded and packed rows;
    inductor's CPU build takes 1.5 min per case)."""
    run_distributed(_body, 2, packed, 2, True, world_size=2)


def test_sequence_parallel_refusals(monkeypatch):
    from lightrft.models.ulysses import check_model

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert StrategyConfig.read({"sequence_parallel": 2}).sequence_parallel == 2
    bad = {
        "does not divide the world size 4": {"sequence_parallel": 3},
        "not supported with lora": {"sequence_parallel": 2, "lora": {"rank": 4}},
        "HSDP": {"sequence_parallel": 2, "shard_size": 2},
        "offload=params": {"sequence_parallel": 2, "offload": "params"},
    }
    for message, node in bad.items():
        with pytest.raises(ValueError, match=message):
            StrategyConfig.read(node)
    config = SimpleNamespace(model_type="qwen2", num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ValueError, match="num_attention_heads=8 and num_key_value_heads=2"):
        check_model(config, 4)
    check_model(config, 2)
    for kind in ("gpt2", "llava"):
        config.model_type = kind
        with pytest.raises(ValueError, match=f"does not support model type '{kind}'"):
            check_model(config, 2)


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_validate_reads_the_head_counts_from_the_checkpoint(tmp_path, monkeypatch, capsys, recipe):
    """``lightrft validate`` (and the launcher's check before torchrun starts the workers)
    refuses an SP degree the checkpoint's heads cannot split, from its config.json alone."""
    import json

    from lightrft import cli

    model = tmp_path / "model"
    model.mkdir()
    heads = {"model_type": "qwen2", "num_attention_heads": 8, "num_key_value_heads": 2}
    (model / "config.json").write_text(json.dumps(heads))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = f"tiny/add_{recipe}"
    assert cli.main(["validate", config, f"model.path={model}", "sequence_parallel=2"]) == 0
    assert cli.main(["validate", config, f"model.path={model}", "sequence_parallel=4"]) == 2
    assert "num_attention_heads=8 and num_key_value_heads=2" in capsys.readouterr().err
    vlm = {"model_type": "qwen2_vl", "text_config": {**heads, "model_type": "qwen2_vl_text"}}
    (model / "config.json").write_text(json.dumps(vlm))
    assert cli.main(["validate", config, f"model.path={model}", "sequence_parallel=4"]) == 2
    assert "num_attention_heads=8 and num_key_value_heads=2" in capsys.readouterr().err
