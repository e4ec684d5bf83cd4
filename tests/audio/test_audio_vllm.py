"""The vLLM adapter's audio request conversion on CPU (the engine itself needs CUDA)."""

import pytest
from _audio_helpers import tone

from lightrft.data import PromptDataset
from lightrft.engine import SamplingParams
from lightrft.engine import vllm_adapter as va
from lightrft.engine.external import collapse_placeholders, hf_weight_names
from lightrft.models import load_processor
from lightrft.models.modality import media_token_ids


def test_vllm_prompt_collapses_each_audio_run_and_passes_waveforms(audio_processor):
    ds = PromptDataset(
        audio_processor,
        records=[
            {
                "prompt": "<audio> vs <audio>: higher?",
                "answer": "2",
                "audios": [
                    {"array": tone(0.5, 16000, 300), "sampling_rate": 16000},
                    {"array": tone(1.2, 16000, 900), "sampling_rate": 16000},
                ],
            }
        ],
    )
    item = ds[0]
    audios = item["media"].audio
    tok = audio_processor.audio_token_id
    prompt = va.vllm_prompt(item["prompt_ids"], item["media"], None, tok)
    ids = prompt["prompt_token_ids"]
    assert ids.count(tok) == 2 and audios.num_tokens == [12, 30]
    back, k = [], 0
    for t in ids:
        back += [t] * (audios.num_tokens[k] if t == tok else 1)
        k += t == tok
    assert back == item["prompt_ids"]
    sent = prompt["multi_modal_data"]["audio"]
    assert [(w is a, sr) for (w, sr), a in zip(sent, audios.audios, strict=True)] == [
        (True, 16000),
        (True, 16000),
    ]
    with pytest.raises(ValueError, match="media is a dict; pass the Media"):
        va.vllm_prompt(item["prompt_ids"], {"audio": audios}, None, tok)
    with pytest.raises(ValueError, match="the model is not audio-language"):
        va.vllm_prompt(item["prompt_ids"], item["media"], None, None)
    with pytest.raises(ValueError, match="audio 0 needs 12 consecutive audio tokens"):
        collapse_placeholders([5, tok, 5], tok, [12], kind="audio")


def test_audio_token_gets_logit_bias_and_weight_names_include_the_tower(tiny_alm):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_alm)
    ids = media_token_ids(cfg)
    assert ids == [load_processor(tiny_alm).audio_token_id]
    kw = va.vllm_sampling_kwargs(SamplingParams(), suppress_token_ids=ids)
    assert kw["logit_bias"] == {ids[0]: -100.0}
    _, required = hf_weight_names(cfg)
    assert "model.audio_tower.layers.0.fc1.weight" in required
    assert "model.multi_modal_projector.linear.weight" in required
    assert "model.language_model.layers.0.mlp.up_proj.weight" in required
