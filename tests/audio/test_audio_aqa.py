"""R1-AQA-style data: prepare_aqa records, bad records, and the shipped 7B config's datasets on
prepared data with a tiny Qwen2-Audio processor."""

import json

import pytest
import yaml
from _audio_helpers import tone, write
from omegaconf import OmegaConf

from lightrft import cli
from lightrft import config as lconfig
from lightrft.data import DataError
from lightrft.tasks.aqa import prepare_aqa


def _source(tmp_path, records):
    src = tmp_path / "avqa" / "train.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)
    write(src.parent / "clip.wav", tone(0.8), 16000)
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    return src


GOOD = {
    "question": "What makes the sound?",
    "choices": ["dog", "car", "rain"],
    "answer": "car",
    "audio": "clip.wav",
}


def test_prepared_records_feed_the_shipped_config(tmp_path, audio_processor):
    src = _source(tmp_path, [GOOD, {**GOOD, "answer": "rain"}])
    out = prepare_aqa(src, tmp_path / "prepared" / "train.jsonl")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["prompt"].startswith("<audio>What makes the sound? Options: dog; car; rain.")
    assert "<answer></answer>" in rows[0]["prompt"]
    assert rows[0]["audios"] == ["../avqa/clip.wav"] and rows[1]["answer"] == "rain"

    cfg = yaml.safe_load(cli.list_configs()["qwen2_audio/aqa_grpo_7b"].read_text())
    # The tiny extractor cuts at 2 s (the real one at 30 s, as the config says).
    node = {**cfg["dataset"], "path": str(out), "media": {"audio": {"max_seconds": 2.0}}}
    ds = lconfig.instantiate(OmegaConf.create(node), audio_processor)
    assert len(ds) == 2 and ds[1]["reference"] == "rain"
    audios = ds[0]["media"].audio
    assert ds[0]["prompt_ids"].count(audio_processor.audio_token_id) == audios.num_tokens[0]
    assert (
        cfg["reward"]["functions"]["accuracy"]["_component_"] == "lightrft.rewards.ChoiceVerifier"
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({**GOOD, "answer": "cat"}, r"line 2: field 'answer': 'cat' is not one of the options"),
        ({**GOOD, "choices": ["dog"]}, r"line 2: field 'choices' needs at least two options"),
        ({k: v for k, v in GOOD.items() if k != "audio"}, r"line 2: missing field 'audio'"),
        ({**GOOD, "choices": "dog, car"}, r"line 2: field 'choices' must be"),
    ],
)
def test_bad_aqa_records_name_file_line_and_field(tmp_path, bad, message):
    src = _source(tmp_path, [GOOD, bad])
    with pytest.raises(DataError, match=message):
        prepare_aqa(src, tmp_path / "out.jsonl")
