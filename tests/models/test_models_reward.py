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
