"""Vision-language reward models: preference pairs with images, the likelihood pooling through
the VLM forward, the reward-model recipe on a tiny Qwen2-VL, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from lightrft.data import DataError, Media, PromptDataset, conversation
from lightrft.data.preference import PreferenceCollator, PreferenceDataset
from lightrft.models.multimodal import load_processor
from lightrft.rewards import Sample


def _pairs(image_files, n: int = 12, rejected: str | None = None) -> list[dict]:
    """The colour of the image: the right name preferred over another colour's (or over
    ``rejected``)."""
    names = ["red", "green", "blue"]
    out = []
    for k in range(n):
        i = k % 3
        out.append(
            {
                "prompt": "Which colour is the picture? <image>",
                "images": [image_files[i].name],
                "chosen": names[i],
                "rejected": rejected or names[(i + 1 + k // 3 % 2) % 3],
            }
        )
    return out


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_pairs_with_images_show_every_candidate_the_images(tiny_vlm, image_files, tmp_path):
    proc = load_processor(tiny_vlm("qwen2_vl"))
    ds = PreferenceDataset(proc, _write(tmp_path / "p.jsonl", _pairs(image_files, 3)))
    item = ds[0]
    chosen, rejected = (s.tolist() for s in item["sequences"])
    image_token = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    n_image = sum(item["media"].image.num_tokens)
    assert chosen.count(image_token) == rejected.count(image_token) == n_image > 1
    # The response starts after the expanded image tokens, at the assistant turn.
    tok = proc.tokenizer
    assert tok.decode(chosen[item["starts"][0] :]).startswith("red<|im_end|>")
    assert tok.decode(rejected[item["starts"][1] :]).startswith("green<|im_end|>")
    # The collator gives each sequence (chosen and rejected) the item's images, in order.
    batch = PreferenceCollator(tok.pad_token_id)([ds[0], ds[1]])
    pixels = ds[0]["media"].image.pixel_values.shape[0] + ds[1]["media"].image.pixel_values.shape[0]
    assert batch["media"].image.pixel_values.shape[0] == 2 * pixels
    assert len(batch["media"].image.num_tokens) == 4  # 2 items x (chosen, rejected), 1 image each
    packed = PreferenceCollator(tok.pad_token_id, packing=True)([ds[0], ds[1]])
    assert packed["media"].image.num_tokens == batch["media"].image.num_tokens


def test_a_multi_turn_prompt_scores_the_final_reply_only(tiny_vlm, image_files, tmp_path):
    """A prompt with an assistant turn of its own: the response starts at the final reply, not
    at the first labelled token (the earlier answer)."""
    proc = load_processor(tiny_vlm("qwen2_vl"))
    chat = [
        {"role": "user", "content": "Which colour is the picture? <image>"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "Look again."},
    ]
    record = {"prompt": chat, "images": [image_files[0].name], "chosen": "red", "rejected": "green"}
    item = PreferenceDataset(proc, _write(tmp_path / "p.jsonl", [record]))[0]
    tok = proc.tokenizer
    for seq, start, answer in zip(item["sequences"], item["starts"], ["red", "green"], strict=True):
        assert tok.decode(seq[start:].tolist()) == f"{answer}<|im_end|>"
        assert "blue<|im_end|>" in tok.decode(seq[:start].tolist())


def test_images_need_a_vlm_processor_and_the_chat_template(tiny_vlm, image_files, tmp_path):
    from lightrft.models import load_tokenizer

    path = _write(tmp_path / "p.jsonl", _pairs(image_files, 2))
    with pytest.raises(
        DataError, match=r"p.jsonl line 1: the record has images.*'images'.*processor"
    ):
        PreferenceDataset(load_tokenizer(tiny_vlm("qwen2_vl")), path)
    with pytest.raises(DataError, match=r"line 1: .*apply_chat_template=true"):
        PreferenceDataset(load_processor(tiny_vlm("qwen2_vl")), path, apply_chat_template=False)


def test_pairs_with_images_truncate_in_the_responses_and_keep_every_image_token(
    tiny_vlm, image_files, tmp_path
):
    """max_length cuts inside the responses: the pair is kept (it still differs) with all its
    image tokens; a cut into the image drops it (the candidates would be identical)."""
    proc = load_processor(tiny_vlm("qwen2_vl"))
    record = {**_pairs(image_files, 1)[0], "chosen": "red, surely", "rejected": "green, surely"}
    path = _write(tmp_path / "p.jsonl", [record])
    full = PreferenceDataset(proc, path)[0]
    n = len(full["sequences"][0])
    cut = PreferenceDataset(proc, path, max_length=n - 2)
    assert cut.stats["truncated"] == 2 and len(cut) == 1
    image_token = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for seq in cut[0]["sequences"]:
        assert seq.tolist().count(image_token) == sum(full["media"].image.num_tokens)
    with pytest.raises(DataError, match="1 too long with max_length"):
        PreferenceDataset(proc, path, max_length=full["starts"][0] - 3)


_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "segment_ids", "scored", "media")


def _score(net, batch) -> torch.Tensor:
    """The net's scores of a collated batch (its candidates' sequences, in order)."""
    n = int(batch["candidates"].max()) + 1
    return net(num_sequences=n, **{k: batch[k] for k in _FORWARD_KEYS if k in batch})


def test_likelihood_pooling_with_images_is_the_vlm_mean_logprob(tiny_vlm, image_files, tmp_path):
    """The score equals the mean log-prob of the response tokens under the VLM's own forward
    (pixel inputs, M-RoPE positions), padded or packed."""
    from lightrft.models.forward import media_forward_kwargs
    from lightrft.models.loading import load_model
    from lightrft.models.reward import build_reward_net

    path = tiny_vlm("qwen2_vl")
    proc = load_processor(path)
    ds = PreferenceDataset(proc, _write(tmp_path / "p.jsonl", _pairs(image_files, 2)))
    net = build_reward_net(path, pooling="likelihood").eval()
    vlm = load_model(path).eval()
    items = [ds[0], ds[1]]
    pad = proc.tokenizer.pad_token_id
    want = []
    with torch.no_grad():
        for it in items:
            for seq, start in zip(it["sequences"], it["starts"], strict=True):
                ids = seq[None]
                kw = media_forward_kwargs(
                    vlm,
                    ids,
                    attention_mask=torch.ones_like(ids),
                    position_ids=None,
                    media=it["media"],
                )
                logp = vlm(input_ids=ids, **kw).logits[0, :-1].log_softmax(-1)
                want.append(logp.gather(-1, ids[0, 1:, None])[start - 1 :, 0].mean())
        got = _score(net, PreferenceCollator(pad)(items))
        got_packed = _score(net, PreferenceCollator(pad, packing=True)(items))
    torch.testing.assert_close(got[:, 0], torch.stack(want), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_packed, got, atol=1e-5, rtol=1e-5)
    # The images matter: the same tokens with another picture score differently.
    from _vision_helpers import square

    blue = ds.media.processors["image"].process(
        [square((0, 0, 255))]
    )  # item 0's size, another colour
    with torch.no_grad():
        swapped = {**items[0], "media": Media(image=blue)}
        other = _score(net, PreferenceCollator(pad)([swapped, items[1]]))
    assert not torch.allclose(other[:2], got[:2])


def test_reward_model_recipe_trains_a_vlm_likelihood_reward_model(tiny_vlm, image_files, tmp_path):
    from lightrft import cli
    from lightrft.models.reward import load_reward_net
    from lightrft.rewards import RewardModel
    from lightrft.training import read_metrics

    # A rejected answer the model can learn to dislike in a few steps: the run shows learning;
    # the test above shows that the images reach the score.
    data = _write(tmp_path / "train.jsonl", _pairs(image_files, 12, rejected="no idea"))
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "device": "cpu",
        "model": {"path": str(tiny_vlm("qwen2_vl")), "pooling": "likelihood"},
        "loss": {"nll_coef": 0.5},
        "dataset": {"_component_": "lightrft.data.PreferenceDataset", "path": data},
        "eval_dataset": {"_component_": "lightrft.data.PreferenceDataset", "path": data},
        "batch_size": 4,
        "epochs": 4,
        "max_steps": 6,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3},
        "eval_every": 6,
        "metrics": {"tensorboard": False},
    }
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["run", "reward_model", "--config", str(path)]) == 0
    evals = [r for r in read_metrics(tmp_path / "out") if "eval/accuracy" in r]
    assert evals[-1]["eval/margin/reward"] > evals[0]["eval/margin/reward"], evals
    final = tmp_path / "out" / "final"
    assert (final / "processor_config.json").is_file()  # the processor, saved with it
    net = load_reward_net(final).eval()
    assert net.pooling == "likelihood" and net.end_token_id is None  # the chat template ends it
    # Scored as in RL: a prompt item's conversation (its chat with its images inline) gives the
    # trained net's scores of the same pairs, chosen and rejected.
    proc = load_processor(final)
    pairs = PreferenceDataset(proc, data)
    prompts = PromptDataset(proc, data, reference_required=False)
    records = [json.loads(line) for line in open(data)][:3]
    chats = [conversation(prompts[k]["messages"], prompts[k]["media"]) for k in range(3)]
    rm = RewardModel(str(final), micro_batch_size=4)
    got = rm(
        Sample.batch(
            [prompts[k]["prompt"] for k in range(3)] * 2,
            [r["chosen"] for r in records] + [r["rejected"] for r in records],
            conversations=chats * 2,
        )
    )
    with torch.no_grad():
        want = _score(
            net, PreferenceCollator(proc.tokenizer.pad_token_id)([pairs[k] for k in range(3)])
        )
    torch.testing.assert_close(got, want[:, 0].view(3, 2).T.flatten(), atol=1e-5, rtol=1e-5)
    # A classifier head on a VLM has no transformers class: refused, naming the way out.
    bad = tmp_path / "bad.yaml"
    model = {"path": cfg["model"]["path"]}
    bad_out = str(tmp_path / "bad_out")  # a fresh run: the used output_dir would be refused
    bad.write_text(yaml.safe_dump({**cfg, "model": model, "loss": {}, "output_dir": bad_out}))
    with pytest.raises(ValueError, match="use pooling='likelihood'"):
        cli.main(["run", "reward_model", "--config", str(bad)])


def test_a_vlm_reward_model_in_rl_reads_the_images_of_each_conversation(
    tiny_vlm, image_files, tmp_path
):
    """Through CombinedReward (as the GRPO and eval recipes call it): the conversations reach
    the model, each with its own picture; what it cannot score is refused with the reason."""
    from _vision_helpers import likelihood_reward_model, square

    from lightrft.rewards import CombinedReward, RewardModel

    path = likelihood_reward_model(tiny_vlm("qwen2_vl"), tmp_path / "rm")
    data = _write(tmp_path / "p.jsonl", _pairs(image_files, 3))
    prompts = PromptDataset(load_processor(path), data, reference_required=False)
    items = [prompts[k] for k in range(3)]
    chats = [conversation(it["messages"], it["media"]) for it in items]
    reward = CombinedReward({"rm": RewardModel(path), "length": lambda samples: [1.0] * 3})
    texts = [it["prompt"] for it in items]
    out = reward(Sample.batch(texts, ["red"] * 3, conversations=chats))
    # Same question, same answer, another picture: another score.
    assert len(set(out.parts["rm"].tolist())) == 3, out.parts["rm"]
    alone = RewardModel(path)(Sample.batch(texts[:1], ["red"], conversations=chats[:1]))
    torch.testing.assert_close(out.parts["rm"][:1], alone)
    recoloured = [
        {
            **chats[0][0],
            "content": [chats[0][0]["content"][0], {"type": "image", "image": square((0, 0, 255))}],
        }
    ]
    assert RewardModel(path)(Sample.batch(texts[:1], ["red"], conversations=[recoloured])) != alone

    rm = RewardModel(path)
    with pytest.raises(ValueError, match="renders each sample.s conversation"):
        rm(Sample.batch(texts, ["red"] * 3))
    with pytest.raises(ValueError, match="apply_chat_template=true in the prompt dataset"):
        rm(Sample.batch(texts[:1], ["red"], conversations=[None]))
    with pytest.raises(ValueError, match=r"sample 0 has \d+ tokens .* max_length=8"):
        RewardModel(path, max_length=8)(Sample.batch(texts[:1], ["red"], conversations=chats[:1]))
    with pytest.raises(ValueError, match="needs chat_template=true"):
        RewardModel(path, chat_template=False)
