"""In-process reward models on tiny checkpoints: both layouts, batching and padding invariance."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from lightrft.data.media import MediaOptions
from lightrft.data.video import VideoOptions
from lightrft.data.vision import ImageOptions
from lightrft.rewards import CombinedReward, RewardModel, Sample
from lightrft.tasks.tiny import char_tokenizer, tiny_config

PROMPTS = ["What is 2+2?", "Name a colour.", "x", "Count to five, slowly please.", "Hi", "?"]
RESPONSES = ["4", "Blue, or maybe a deep red.", "yz", "1 2 3 4 5", "Hello there!", ""]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """A tiny Qwen2ForSequenceClassification (num_labels=1) saved with the char tokenizer."""
    from transformers import Qwen2ForSequenceClassification

    out = tmp_path_factory.mktemp("rm") / "qwen2_cls"
    tok = char_tokenizer()
    cfg = tiny_config(
        -(-len(tok) // 16) * 16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    cfg.num_labels = 1
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():  # a larger head than the 0.02-std init, so scores differ visibly
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return out


@pytest.fixture(scope="module")
def value_head_dir(tiny_model_dir, tmp_path_factory):
    """The tiny causal LM plus a value head stored in its own safetensors file."""
    out = tmp_path_factory.mktemp("rm") / "qwen2_vhead"
    shutil.copytree(tiny_model_dir, out)
    g = torch.Generator().manual_seed(1)
    save_file(
        {
            "value_head.weight": torch.randn(1, 64, generator=g),
            "value_head.bias": torch.tensor([0.5]),
        },
        str(out / "value_head.safetensors"),
    )
    return out


def test_classifier_scores_match_hf_and_are_batch_invariant(classifier_dir):
    from transformers import AutoModelForSequenceClassification

    rm1 = RewardModel(str(classifier_dir), micro_batch_size=1)
    assert rm1.chat_template and not rm1.net.base.training
    s1 = rm1(Sample.batch(PROMPTS, RESPONSES))
    assert s1.shape == (len(PROMPTS),) and s1.dtype == torch.float32 and not s1.requires_grad
    assert s1.std() > 1e-3, "scores of different texts should differ"
    # HF's own pooling on each sequence alone (no padding, so it finds the last token).
    hf = AutoModelForSequenceClassification.from_pretrained(classifier_dir, num_labels=1).eval()
    with torch.no_grad():
        for i, ids in enumerate(rm1.encode(PROMPTS, RESPONSES)[0]):
            ref = hf(input_ids=torch.tensor([ids])).logits[0, 0]
            torch.testing.assert_close(s1[i], ref, atol=1e-5, rtol=1e-5)
    for mbs, side in ((4, "right"), (4, "left"), (3, "left"), (6, "right")):
        rm = RewardModel(str(classifier_dir), micro_batch_size=mbs, padding_side=side)
        torch.testing.assert_close(rm(Sample.batch(PROMPTS, RESPONSES)), s1, atol=1e-5, rtol=1e-5)


def test_render_uses_the_chat_template(classifier_dir):
    rm = RewardModel(str(classifier_dir))
    assert rm.render("Q?", "A.") == (
        "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\nA.<|im_end|>\n"
    )
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    assert rm.render(conv, "A.").startswith("<|im_start|>system\nS<|im_end|>\n")
    plain = RewardModel(str(classifier_dir), chat_template=False)
    assert plain.render("Q? ", "A.") == "Q? A."
    with pytest.raises(ValueError, match="string prompts"):
        plain.render(conv, "A.")


def test_truncation_keeps_the_end(classifier_dir):
    rm = RewardModel(str(classifier_dir), max_length=16, micro_batch_size=2)
    long_prompt = "a long prompt " * 10
    ids = rm.encode([long_prompt], ["answer"])[0][0]
    assert len(ids) == 16
    full = RewardModel(str(classifier_dir)).encode([long_prompt], ["answer"])[0][0]
    assert ids == full[-16:]
    torch.testing.assert_close(
        rm(Sample.batch([long_prompt, "x"], ["answer", "y"]))[0], rm.score_ids([full[-16:]])[0]
    )


def test_sequence_ending_in_pad_token_is_read_at_its_end(classifier_dir):
    # Pooling by the attention mask, not by pad_token_id: a trailing pad-id token still counts.
    rm = RewardModel(str(classifier_dir), micro_batch_size=2)
    seq = [10, 11, 12, rm.pad_id]
    with torch.no_grad():
        hidden = rm.net.base(input_ids=torch.tensor([seq])).last_hidden_state
        ref = rm.net.head(hidden[0, -1])[0]
    torch.testing.assert_close(rm.score_ids([seq, [5, 6]])[0], ref, atol=1e-5, rtol=1e-5)


def test_value_head_layout(value_head_dir):
    from transformers import AutoModel

    rm = RewardModel(str(value_head_dir), micro_batch_size=4, padding_side="left")
    assert rm.net.head.bias is not None
    scores = rm(Sample.batch(PROMPTS, RESPONSES))
    backbone = AutoModel.from_pretrained(value_head_dir).eval()
    w = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i, ids in enumerate(rm.encode(PROMPTS, RESPONSES)[0]):
            h = backbone(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]  # [H]
            torch.testing.assert_close(scores[i], (h @ w[0]) + 0.5, atol=1e-5, rtol=1e-5)
    scaled = RewardModel(str(value_head_dir), micro_batch_size=1, scale=2.0, bias=-1.0)
    torch.testing.assert_close(
        scaled(Sample.batch(PROMPTS, RESPONSES)), 2.0 * scores - 1.0, atol=1e-5, rtol=1e-5
    )


def test_from_modules_and_no_grad(classifier_dir):
    from transformers import AutoModelForSequenceClassification

    from lightrft.models import load_tokenizer

    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir, num_labels=1)
    rm = RewardModel.from_modules(
        model.base_model, model.score, load_tokenizer(classifier_dir), micro_batch_size=2
    )
    assert not any(p.requires_grad for p in model.parameters())
    ref = RewardModel(str(classifier_dir))(Sample.batch(PROMPTS, RESPONSES))
    torch.testing.assert_close(rm(Sample.batch(PROMPTS, RESPONSES)), ref, atol=1e-5, rtol=1e-5)


def test_reward_model_inside_combined_reward(classifier_dir):
    rm = RewardModel(str(classifier_dir), micro_batch_size=2)
    out = CombinedReward(
        {"rm": rm}, weights={"rm": 0.5}, routes={"chat": ["rm"]}, default_reward=0.0
    )(Sample.batch(PROMPTS, RESPONSES, labels=["chat", "math"] * 3))
    alone = rm(Sample.batch(PROMPTS[::2], RESPONSES[::2]))
    torch.testing.assert_close(out.total[::2], 0.5 * alone)
    assert out.total[1::2].tolist() == [0.0] * 3


def test_chat_reward_model_renders_the_conversation_not_the_rendered_prompt(classifier_dir):
    """With the chat template, a sample's conversation (what the recipes pass) is what is
    rendered: the prompt text, already rendered by the actor's template, is not wrapped again.
    A raw prompt (conversation None) falls back to its text; a text model refuses images."""
    rm = RewardModel(str(classifier_dir), micro_batch_size=2)
    chats = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}]
        for p in PROMPTS
    ]
    rendered = ["<rendered>" + p for p in PROMPTS]  # stands for the actor's rendered prompt
    got = rm(Sample.batch(rendered, RESPONSES, conversations=chats[:5] + [None]))
    torch.testing.assert_close(got[:5], rm(Sample.batch(chats[:5], RESPONSES[:5])))
    torch.testing.assert_close(got[5:], rm(Sample.batch(rendered[5:], RESPONSES[5:])))
    raw = RewardModel(str(classifier_dir), chat_template=False)  # reads the rendered text
    torch.testing.assert_close(
        raw(Sample.batch(rendered[:2], RESPONSES[:2], conversations=chats[:2])),
        raw(Sample.batch(rendered[:2], RESPONSES[:2])),
    )
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(
        ValueError, match="sample 0's prompt has images, videos or audio, which a text reward"
    ):
        rm(Sample.batch(["x"], ["y"], conversations=[image]))
    # The image and video options of a vision-language reward model are refused by name.
    with pytest.raises(ValueError, match="media.video options need a Qwen2-VL or Qwen2.5-VL"):
        RewardModel(str(classifier_dir), media=MediaOptions(video=VideoOptions(fps=4.0)))
    with pytest.raises(ValueError, match="media.image options need a vision-language"):
        RewardModel(str(classifier_dir), media=MediaOptions(image=ImageOptions(min_pixels=100)))


def test_errors(classifier_dir, value_head_dir, tiny_model_dir, monkeypatch):
    # Bad options are refused before any weights load.
    import lightrft.rewards.reward_model as rm_module

    with monkeypatch.context() as m:

        def no_loading(*args, **kwargs):
            raise AssertionError("weights loaded before the options were checked")

        m.setattr(rm_module, "load_reward_net", no_loading)
        for bad, message in [
            ({"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
            ({"max_length": 1}, "max_length must be >= 2"),
            ({"padding_side": "top"}, "padding_side must be 'left' or 'right'"),
        ]:
            with pytest.raises(ValueError, match=message):
                RewardModel(str(classifier_dir), **bad)
    with pytest.raises(ValueError, match="head must be"):
        RewardModel(str(classifier_dir), head="linear")
    with pytest.raises(ValueError, match="no tensor 'value_head.weight'.*value_head_key"):
        RewardModel(str(tiny_model_dir))  # a plain causal LM: no head stored
    with pytest.raises(ValueError, match="no tensor 'v_head.weight'"):
        RewardModel(str(value_head_dir), value_head_key="v_head")
    with pytest.raises(ValueError, match="does not exist"):
        RewardModel("/nonexistent/rm")
    # Relative, with more parts than a hub id ("namespace/name") has: a path, not a hub id.
    with pytest.raises(ValueError, match="model path 'outputs/tiny/rm/final' does not exist"):
        RewardModel("outputs/tiny/rm/final")
    rm = RewardModel(str(classifier_dir))
    with pytest.raises(ValueError, match="prompts has 1 entries but responses has 2"):
        rm(Sample.batch(["a"], ["b", "c"]))
    assert rm(Sample.batch([], [])).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scores_match_cpu(classifier_dir):
    cpu = RewardModel(str(classifier_dir), micro_batch_size=4)(Sample.batch(PROMPTS, RESPONSES))
    gpu = RewardModel(str(classifier_dir), micro_batch_size=4, device="cuda")
    scores = gpu(Sample.batch(PROMPTS, RESPONSES))
    assert scores.device.type == "cpu"
    torch.testing.assert_close(scores, cpu, atol=1e-4, rtol=1e-4)
    bf16 = RewardModel(str(classifier_dir), micro_batch_size=4, device="cuda", dtype="bfloat16")
    torch.testing.assert_close(bf16(Sample.batch(PROMPTS, RESPONSES)), cpu, atol=0.1, rtol=0.05)


def test_likelihood_export_scores_the_assistant_turn_batch_invariant_and_cut(
    tiny_model_dir, tmp_path
):
    """A likelihood reward model (a causal LM with the lightrft_reward block) is detected, and
    scores the mean log-prob of what follows the rendered prompt (with the chat template, the
    assistant turn and its end tokens), whatever the batching; a cut keeps the response."""
    from transformers import AutoModelForCausalLM

    from lightrft.models.export import export_hf
    from lightrft.models.loading import load_tokenizer
    from lightrft.models.reward import CONFIG_KEY, build_reward_net

    net = build_reward_net(tiny_model_dir, pooling="likelihood")
    setattr(net._hf[0].config, CONFIG_KEY, net.reward_config())
    export_hf(net, load_tokenizer(tiny_model_dir), tmp_path / "ll")
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "ll", dtype=torch.float32).eval()
    one = RewardModel(str(tmp_path / "ll"), micro_batch_size=1)
    prompts, responses = PROMPTS[:5], RESPONSES[:5]
    scores = one(Sample.batch(prompts, responses))
    tok = one.tokenizer
    for k, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        head = tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tok(one.render(p, r), add_special_tokens=False)["input_ids"]])
        n = len(tok(head, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logp = lm(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(scores[k], logp[n - 1 :].mean(), atol=1e-5, rtol=1e-5)
    batched = RewardModel(str(tmp_path / "ll"), micro_batch_size=4, padding_side="left")
    torch.testing.assert_close(
        batched(Sample.batch(prompts, responses)), scores, atol=1e-5, rtol=1e-5
    )
    # A cut drops the prompt's start: the response's tokens are the same, in a shorter context.
    cut = RewardModel(str(tmp_path / "ll"), max_length=24)
    (seq,), (start,) = cut.encode([PROMPTS[3]], [RESPONSES[3]])
    assert seq == cut.encode([PROMPTS[3]], [RESPONSES[3]])[0][0] and len(seq) == 24
    assert tok.decode(seq[start:]) == RESPONSES[3] + "<|im_end|>\n"
