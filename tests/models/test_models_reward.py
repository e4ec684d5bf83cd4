"""RewardNet pooling: by hand, left = right padding = packing, probe layer, attention pooling."""

import pytest
import torch

from lightrft.data.preference import PreferenceCollator, pad_sequences
from lightrft.models.reward import build_reward_net, pool_hidden


def test_pool_hidden_by_hand():
    # Two rows of 4 tokens, hidden size 1: row 0 holds sequence 0 (3 tokens) and a pad,
    # row 1 sequences 1 (1 token) and 2 (2 tokens) packed, then a pad.
    hidden = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 9.0]])[..., None]  # [2, 4, 1]
    seg = torch.tensor([[0, 0, 0, -1], [1, 2, 2, -1]])
    assert pool_hidden(hidden, seg, 3, "last").squeeze(-1).tolist() == [3.0, 4.0, 6.0]
    assert pool_hidden(hidden, seg, 3, "mean").squeeze(-1).tolist() == [2.0, 4.0, 5.5]
    # Attention: token logits 0 except log(3) on the token of value 2: weights 1/5, 3/5, 1/5.
    logits = torch.zeros(2, 4)
    logits[0, 1] = torch.log(torch.tensor(3.0))
    att = pool_hidden(hidden, seg, 3, "attention", logits).squeeze(-1)
    assert torch.allclose(att, torch.tensor([(1 + 6 + 3) / 5, 4.0, 5.5]))
    with pytest.raises(ValueError, match="pooling must be one of"):
        pool_hidden(hidden, seg, 3, "max")


@pytest.mark.parametrize("pooling", ["mean", "attention"])
def test_pool_hidden_in_bf16_matches_fp32_over_long_sequences(pooling):
    # A bf16 running count stops at 256 and a bf16 running sum loses the small terms: one
    # 300-token sequence of 256 zeros then 44 ones has mean 44 / 300, not 44 / 256.
    hidden = torch.cat([torch.zeros(256), torch.ones(44)])[None, :, None]  # [1, 300, 1]
    seg = torch.zeros(1, 300, dtype=torch.long)
    logits = torch.zeros(1, 300)
    want = pool_hidden(hidden, seg, 1, pooling, logits)
    got = pool_hidden(hidden.bfloat16(), seg, 1, pooling, logits)
    assert got.dtype == torch.bfloat16
    assert want.item() == pytest.approx(44 / 300)
    assert got.float().item() == pytest.approx(44 / 300, rel=1e-2)


SEQS = [[5, 17, 9, 23, 11, 30, 12], [7, 8], [40, 41, 42, 43], [3]]


@pytest.mark.parametrize(
    "pooling,probe", [("last", None), ("mean", None), ("attention", None), ("last", 1)]
)
def test_padding_side_and_packing_agree(tiny_model_dir, pooling, probe):
    torch.manual_seed(0)
    net = build_reward_net(tiny_model_dir, heads=["a", "b"], pooling=pooling, probe_layer=probe)
    net.eval()
    with torch.no_grad():
        net.head.weight.normal_()  # visible scores
        right = net(num_sequences=4, **pad_sequences([torch.tensor(s) for s in SEQS], 0, "right"))
        left = net(num_sequences=4, **pad_sequences([torch.tensor(s) for s in SEQS], 0, "left"))
        items = [
            {
                "sequences": [torch.tensor(s) for s in SEQS],
                "margin": 0.0,
                "head": None,
                "safe": [0] * 4,
                "starts": [1] * 4,
            }
        ]
        batch = PreferenceCollator(0, ["a", "b"], packing=True)(items)
        packed = net(
            batch["input_ids"], batch["position_ids"], batch["segment_ids"], num_sequences=4
        )
        alone = torch.cat(
            [net(num_sequences=1, **pad_sequences([torch.tensor(s)], 0)) for s in SEQS]
        )
    assert right.shape == (4, 2)
    assert torch.allclose(left, right, atol=1e-5), (left - right).abs().max()
    assert torch.allclose(packed, right, atol=1e-5), (packed - right).abs().max()
    assert torch.allclose(alone, right, atol=1e-5)


def test_probe_layer_reads_a_middle_block(tiny_model_dir):
    torch.manual_seed(0)
    net = build_reward_net(tiny_model_dir, probe_layer=1).eval()
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        hs = net.base(input_ids=ids, output_hidden_states=True).hidden_states
        want = net.head(hs[1][:, -1])  # [1, 1]
        got = net(num_sequences=1, **pad_sequences([ids[0]], 0))
    assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="probe_layer"):
        build_reward_net(tiny_model_dir, probe_layer=3)  # the tiny model has 2 blocks


def _mean_logprob_by_hand(lm, seq: list[int], start: int, end: int | None) -> torch.Tensor:
    """log p(seq[start:] (+ end) | seq[:start]) / its token count, from the LM's full logits."""
    ids = torch.tensor([seq + ([end] if end is not None and seq[-1] != end else [])])
    logp = lm(ids).logits[0, :-1].log_softmax(-1)  # [T-1, V]
    targets = ids[0, 1:]
    return logp[start - 1 :].gather(-1, targets[start - 1 :, None]).mean()


@pytest.mark.parametrize("end", [None, 2])
def test_likelihood_pooling_is_the_mean_response_logprob_on_any_layout(tiny_model_dir, end):
    from transformers import AutoModelForCausalLM

    net = build_reward_net(tiny_model_dir, pooling="likelihood", end_token_id=end).eval()
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    seqs = [[5, 17, 9, 23, 11, 30, 12], [7, 8], [40, 41, 42, 2], [3, 4, 5]]
    starts = [3, 1, 2, 2]  # the last sequence already ends in the end token 2
    tensors = [torch.tensor(s) for s in seqs]
    with torch.no_grad():
        want = torch.stack(
            [_mean_logprob_by_hand(lm, s, k, end) for s, k in zip(seqs, starts, strict=True)]
        )
        right = net(num_sequences=4, **pad_sequences(tensors, 0, "right", starts))
        left = net(num_sequences=4, **pad_sequences(tensors, 0, "left", starts))
        item = {"sequences": tensors, "starts": starts, "margin": 0.0, "head": None}
        batch = PreferenceCollator(0, packing=True)([dict(item, safe=[0] * 4)])
        packed = net(
            batch["input_ids"],
            batch["position_ids"],
            batch["segment_ids"],
            4,
            scored=batch["scored"],
        )
    assert right.shape == (4, 1)
    torch.testing.assert_close(right[:, 0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed, right, atol=1e-5, rtol=1e-5)
    # Gradients reach the backbone and the LM head through the fused kernel.
    net.train()
    net(num_sequences=4, **pad_sequences(tensors, 0, "right", starts)).sum().backward()
    assert net.head.weight.grad is not None and net.head.weight.grad.abs().sum() > 0


def test_likelihood_pooling_refuses_what_it_cannot_score(tiny_model_dir):
    with pytest.raises(ValueError, match="one head only"):
        build_reward_net(tiny_model_dir, heads=["a", "b"], pooling="likelihood")
    with pytest.raises(ValueError, match="no probe_layer"):
        build_reward_net(tiny_model_dir, pooling="likelihood", probe_layer=1)
    with pytest.raises(ValueError, match="end_token_id applies to pooling='likelihood'"):
        build_reward_net(tiny_model_dir, end_token_id=2)
    net = build_reward_net(tiny_model_dir, pooling="likelihood")
    with pytest.raises(ValueError, match="needs the scored-token mask"):
        net(num_sequences=1, **pad_sequences([torch.tensor([5, 6, 7])], 0))


def test_sharded_likelihood_build_keeps_a_tied_lm_head(tmp_path):
    """Built on meta for sharding, a likelihood reward model's tied LM head (in no safetensors
    file) stays the input embedding's weight, on meta, to be sharded with it; it is not taken
    for a missing head and replaced by a fresh, random one."""
    from lightrft.models.reward import load_reward_net_parallel
    from lightrft.tasks import make_tiny_model

    path = make_tiny_model(tmp_path / "tied", layers=1, hidden=32, tie_embeddings=True)

    class Seen(Exception):  # stop before sharding: this process has no group
        pass

    def check(net):
        head = net.get_output_embeddings()
        assert head.weight is net.base.get_input_embeddings().weight and head.weight.is_meta
        raise Seen

    with pytest.raises(Seen):
        load_reward_net_parallel(path, pooling="likelihood", shard=True, prepare=check)
