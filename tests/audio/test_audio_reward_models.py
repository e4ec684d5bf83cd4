"""Audio-language reward models: preference pairs with audio, the likelihood pooling through the
Qwen2-Audio forward, the reward-model recipe on a tiny Qwen2-Audio, scoring audio rollouts in RL,
and what is refused. Audio rides the path images ride (tests/vision/test_vision_reward_models.py):
the media container from the dataset to the forward."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from _audio_helpers import tone, write

from lightrft.data import DataError, Media, PromptDataset, conversation
from lightrft.data.audio import AudioOptions
from lightrft.data.media import MediaOptions
from lightrft.data.preference import PreferenceCollator, PreferenceDataset
from lightrft.data.vision import ImageOptions
from lightrft.rewards import Sample

NAMES = ["mid", "high", "low"]  # the pitches of the audio_files fixture: 440, 660, 330 Hz


def _pairs(audio_files, n: int = 12, rejected: str | None = None) -> list[dict]:
    """How high the tone is: the right word preferred over another's (or over ``rejected``)."""
    out = []
    for k in range(n):
        i = k % 3
        out.append(
            {
                "prompt": "<audio>How high is the tone?",
                "audios": [audio_files[i]],
                "chosen": NAMES[i],
                "rejected": rejected or NAMES[(i + 1 + k // 3 % 2) % 3],
            }
        )
    return out


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "segment_ids", "scored", "media")


def _score(net, batch) -> torch.Tensor:
    """The net's scores of a collated batch (its candidates' sequences, in order)."""
    n = int(batch["candidates"].max()) + 1
    return net(num_sequences=n, **{k: batch[k] for k in _FORWARD_KEYS if k in batch})


def test_pairs_with_audio_let_every_candidate_hear_it_and_bad_audio_names_the_line(
    audio_processor, audio_files, tmp_path
):
    proc, tok = audio_processor, audio_processor.tokenizer
    ds = PreferenceDataset(proc, _write(tmp_path / "p.jsonl", _pairs(audio_files, 3)))
    assert ds.stats["audio_clipped"] == ds.stats["audio_dropped"] == 0
    item = ds[0]
    chosen, rejected = (s.tolist() for s in item["sequences"])
    audio_token = proc.audio_token_id
    n_audio = sum(item["media"].audio.num_tokens)
    assert chosen.count(audio_token) == rejected.count(audio_token) == n_audio > 1
    # The response starts after the expanded audio tokens, at the assistant turn.
    assert tok.decode(chosen[item["starts"][0] :]).startswith("mid<|im_end|>")
    assert tok.decode(rejected[item["starts"][1] :]).startswith("high<|im_end|>")
    # The collator gives each sequence (chosen and rejected) the item's audio, in order.
    batch = PreferenceCollator(tok.pad_token_id)([ds[0], ds[1]])
    assert batch["media"].image is None and batch["media"].audio.input_features.shape[0] == 4
    assert batch["media"].audio.num_tokens == [n_audio] * 2 + ds[1]["media"].audio.num_tokens * 2
    packed = PreferenceCollator(tok.pad_token_id, packing=True)([ds[0], ds[1]])
    assert packed["media"].audio.num_tokens == batch["media"].audio.num_tokens

    # The same audio inline in an audio part of a message-list prompt: the same item.
    part = {"type": "audio", "audio": audio_files[0]}
    chat = [{"role": "user", "content": [part, {"type": "text", "text": "How high is the tone?"}]}]
    inline = {"prompt": chat, "chosen": "mid", "rejected": "high"}
    same = PreferenceDataset(proc, _write(tmp_path / "inline.jsonl", [inline]))[0]
    assert [s.tolist() for s in same["sequences"]] == [chosen, rejected]
    torch.testing.assert_close(
        same["media"].audio.input_features, item["media"].audio.input_features
    )

    # Bad audio fails when the dataset is built, naming the file, the line and the field.
    (tmp_path / "bad.wav").write_bytes(b"not audio at all")
    write(tmp_path / "click.wav", tone(0.01), 16000)
    for name, want in [
        ("gone.wav", "audio file not found"),
        ("bad.wav", "cannot decode"),
        ("click.wav", r"the audio is 10.0 ms long"),
    ]:
        records = [*_pairs(audio_files, 1), {**_pairs(audio_files, 1)[0], "audios": [name]}]
        with pytest.raises(DataError, match=rf"q.jsonl line 2: audios\[0\]: {want}"):
            PreferenceDataset(proc, _write(tmp_path / "q.jsonl", records))
    # Too long: clipped (counted) or, with media.audio.overlong=drop, the record dropped (counted).
    data = _write(tmp_path / "p.jsonl", _pairs(audio_files, 3))  # 0.5, 0.8 and 0.3 s of audio
    clipped = PreferenceDataset(proc, data, media=MediaOptions(audio=AudioOptions(max_seconds=0.4)))
    assert (clipped.stats["audio_clipped"], len(clipped)) == (2, 3)
    dropped = PreferenceDataset(
        proc, data, media=MediaOptions(audio=AudioOptions(max_seconds=0.4, overlong="drop"))
    )
    assert (dropped.stats["audio_dropped"], len(dropped)) == (2, 1)
    with pytest.raises(
        DataError, match=r"all 3 records .* 3 with audio over media.audio.max_seconds"
    ):
        PreferenceDataset(
            proc, data, media=MediaOptions(audio=AudioOptions(max_seconds=0.2, overlong="drop"))
        )
    # Audio needs an audio-language processor and the chat template (which places its tokens).
    with pytest.raises(
        DataError, match=r"p.jsonl line 1: the record has audios.*'audios'.*processor"
    ):
        PreferenceDataset(tok, data)
    with pytest.raises(DataError, match=r"line 1: .*apply_chat_template=true"):
        PreferenceDataset(proc, data, apply_chat_template=False)
    # max_length keeps the start: a cut inside the responses keeps every audio token; a record
    # whose cut would reach into its audio is dropped (its candidates would be identical).
    cut = PreferenceDataset(proc, data, max_length=len(chosen) - 1)
    assert cut.stats["truncated"] >= 1 and len(cut) >= 1
    for k in range(len(cut)):
        it = cut[k]
        for seq in it["sequences"]:
            assert seq.tolist().count(audio_token) == sum(it["media"].audio.num_tokens)
    with pytest.raises(DataError, match="3 too long with max_length"):
        PreferenceDataset(proc, data, max_length=n_audio)


def test_likelihood_pooling_with_audio_is_the_alm_mean_logprob(
    tiny_alm, audio_processor, audio_files, tmp_path
):
    """The score equals the mean log-prob of the response tokens under a plain HF forward of
    the Qwen2-Audio (log-mel features in), padded or packed; another tone gives another score."""
    from transformers import AutoModelForMultimodalLM

    from lightrft.models.reward import build_reward_net

    ds = PreferenceDataset(audio_processor, _write(tmp_path / "p.jsonl", _pairs(audio_files, 2)))
    net = build_reward_net(tiny_alm, pooling="likelihood").eval()
    hf = AutoModelForMultimodalLM.from_pretrained(tiny_alm, dtype=torch.float32).eval()
    items = [ds[0], ds[1]]
    pad = audio_processor.tokenizer.pad_token_id
    want = []
    with torch.no_grad():
        for it in items:
            for seq, start in zip(it["sequences"], it["starts"], strict=True):
                ids = seq[None]
                logits = hf(input_ids=ids, **it["media"].audio.model_inputs()).logits
                logp = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
                want.append(logp[start - 1 :].mean())
        got = _score(net, PreferenceCollator(pad)(items))
        got_packed = _score(net, PreferenceCollator(pad, packing=True)(items))
    torch.testing.assert_close(got[:, 0], torch.stack(want), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_packed, got, atol=1e-5, rtol=1e-5)
    # The audio matters: the same tokens with another tone of the same length score differently.
    other = ds.media.audio.process([tone(0.5, 16000, 1800.0)])
    with torch.no_grad():
        swapped = {**items[0], "media": Media(audio=other)}
        moved = _score(net, PreferenceCollator(pad)([swapped, items[1]]))
    assert not torch.allclose(moved[:2], got[:2])


def test_reward_model_recipe_trains_an_audio_reward_model_that_scores_rl_conversations(
    tiny_alm, audio_files, tmp_path
):
    from lightrft import cli
    from lightrft.models import load_processor
    from lightrft.models.reward import load_reward_net
    from lightrft.rewards import RewardModel
    from lightrft.training import read_metrics

    # A rejected answer the model can learn to dislike in a few steps: the run shows learning;
    # the test above shows that the audio reaches the score.
    data = _write(tmp_path / "train.jsonl", _pairs(audio_files, 12, rejected="no idea"))
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "device": "cpu",
        "model": {"path": str(tiny_alm), "pooling": "likelihood"},
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
    # Scored as in RL: a prompt item's conversation (its chat with its audio inline) gives the
    # trained net's scores of the same pairs, chosen and rejected, batched or one at a time.
    proc = load_processor(final)
    pairs = PreferenceDataset(proc, data)
    prompts = PromptDataset(proc, data, reference_required=False)
    records = [json.loads(line) for line in open(data)][:3]
    chats = [conversation(prompts[k]["messages"], prompts[k]["media"]) for k in range(3)]
    texts = [prompts[k]["prompt"] for k in range(3)] * 2
    responses = [r["chosen"] for r in records] + [r["rejected"] for r in records]
    got = RewardModel(str(final), micro_batch_size=4)(
        Sample.batch(texts, responses, conversations=chats * 2)
    )
    with torch.no_grad():
        want = _score(
            net, PreferenceCollator(proc.tokenizer.pad_token_id)([pairs[k] for k in range(3)])
        )
    torch.testing.assert_close(got, want[:, 0].view(3, 2).T.flatten(), atol=1e-5, rtol=1e-5)
    rm = RewardModel(str(final), micro_batch_size=1)
    alone = torch.cat(
        [
            rm(Sample.batch([texts[k]], [responses[k]], conversations=[(chats * 2)[k]]))
            for k in range(6)
        ]
    )
    torch.testing.assert_close(alone, got, atol=1e-5, rtol=1e-5)
    # A classifier head on an audio-language model has no transformers class: refused.
    bad = tmp_path / "bad.yaml"
    bad_out = str(tmp_path / "bad_out")  # a fresh run: the used output_dir would be refused
    model = {"path": cfg["model"]["path"]}
    bad.write_text(yaml.safe_dump({**cfg, "model": model, "loss": {}, "output_dir": bad_out}))
    with pytest.raises(ValueError, match="use pooling='likelihood'"):
        cli.main(["run", "reward_model", "--config", str(bad)])


def test_an_audio_reward_model_in_rl_hears_the_audio_of_each_conversation(
    tiny_alm, audio_processor, audio_files, tmp_path
):
    """Through CombinedReward (as the GRPO and eval recipes call it): the conversations reach
    the model, each with its own audio; scores equal a plain HF forward of the same inputs;
    batched equals one at a time; what it cannot score is refused with the reason."""
    from _exports import likelihood_reward_model
    from transformers import AutoModelForMultimodalLM

    from lightrft.rewards import CombinedReward, RewardModel

    path = likelihood_reward_model(tiny_alm, tmp_path / "rm")
    data = _write(tmp_path / "p.jsonl", _pairs(audio_files, 3))
    prompts = PromptDataset(audio_processor, data, reference_required=False)
    items = [prompts[k] for k in range(3)]
    chats = [conversation(it["messages"], it["media"]) for it in items]
    assert chats[0][0]["content"][0]["audio"]["sampling_rate"] == 16000  # the audio, inline
    reward = CombinedReward({"rm": RewardModel(path), "length": lambda samples: [1.0] * 3})
    texts = [it["prompt"] for it in items]
    out = reward(Sample.batch(texts, ["mid"] * 3, conversations=chats))
    # Same question, same answer, another tone: another score.
    assert len(set(out.parts["rm"].tolist())) == 3, out.parts["rm"]
    rm = RewardModel(path, micro_batch_size=1)
    alone = torch.cat(
        [
            rm(Sample.batch(texts[k : k + 1], ["mid"], conversations=chats[k : k + 1]))
            for k in range(3)
        ]
    )
    torch.testing.assert_close(out.parts["rm"], alone, atol=1e-5, rtol=1e-5)
    # A plain HF forward of the same model on the same inputs: the prompt dataset's ids and
    # audio features, then the answer turn the chat template writes.
    hf = AutoModelForMultimodalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = audio_processor.tokenizer
    reply = tok("mid<|im_end|>", add_special_tokens=False)["input_ids"]
    want = []
    with torch.no_grad():
        for it in items:
            prompt_ids = list(it["prompt_ids"])
            ids = torch.tensor([prompt_ids + reply])
            logits = hf(input_ids=ids, **it["media"].audio.model_inputs()).logits
            logp = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            want.append(logp[len(prompt_ids) - 1 :].mean())
    torch.testing.assert_close(out.parts["rm"], torch.stack(want), atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match="renders each sample.s conversation"):
        rm(Sample.batch(texts, ["mid"] * 3))
    with pytest.raises(ValueError, match="apply_chat_template=true in the prompt dataset"):
        rm(Sample.batch(texts[:1], ["mid"], conversations=[None]))
    with pytest.raises(ValueError, match=r"sample 0 has \d+ tokens .* max_length=8"):
        RewardModel(path, max_length=8)(Sample.batch(texts[:1], ["mid"], conversations=chats[:1]))
    with pytest.raises(ValueError, match="needs chat_template=true"):
        RewardModel(path, chat_template=False)
    with pytest.raises(ValueError, match="media.image options need a vision-language"):
        RewardModel(path, media=MediaOptions(image=ImageOptions(max_pixels=56 * 56)))


@pytest.mark.slow  # 2.5-3 min on the 2-core machine
def test_a_tone_reward_model_learns_to_hear_the_band(tmp_path):
    """Pairs from the tone task (lightrft.tasks.tones): the clip's band preferred over each other
    band, so an answer prior alone ranks half the held-out pairs right; the likelihood reward model
    from a random tiny Qwen2-Audio (the demo's size) learns to rank them by the audio."""
    from lightrft import cli
    from lightrft.tasks import ensure_tiny_model, ensure_tones_dataset
    from lightrft.training import read_metrics

    model = ensure_tiny_model(
        tmp_path / "model", arch="qwen2_audio", layers=4, hidden=128, heads=4, kv_heads=2
    )
    data = ensure_tones_dataset(tmp_path / "tones", n_train=512, n_rl=4, n_test=64)
    for split in ("train", "test"):
        records = [json.loads(line) for line in open(data / f"{split}.jsonl")]
        pairs = [
            {
                "prompt": r["prompt"],
                "audios": r["audios"],
                "chosen": r["answer"],
                "rejected": [str(b) for b in range(1, 5) if str(b) != r["answer"]],
            }
            for r in records
        ]
        _write(data / f"{split}_pairs.jsonl", pairs)  # beside the clips: paths stay relative
    pairs_of = {
        "_component_": "lightrft.data.PreferenceDataset",
        "media": {"audio": {"max_seconds": 1.0}},
    }
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "device": "cpu",
        "model": {"path": str(model), "pooling": "likelihood"},
        "loss": {"nll_coef": 1.0},
        "dataset": {**pairs_of, "path": str(data / "train_pairs.jsonl")},
        "eval_dataset": {**pairs_of, "path": str(data / "test_pairs.jsonl")},
        "batch_size": 16,
        "epochs": 10,
        "max_steps": 80,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.0},
        "lr_scheduler": {"warmup_steps": 10, "min_lr_ratio": 0.5},
        "clip_grad_norm": 1.0,
        "eval_every": 80,
        "metrics": {"tensorboard": False},
    }
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["run", "reward_model", "--config", str(path)]) == 0
    acc = [r["eval/accuracy"] for r in read_metrics(tmp_path / "out") if "eval/accuracy" in r]
    assert acc[0] < 0.6 and acc[-1] > 0.8, acc
