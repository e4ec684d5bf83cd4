"""Audio-language data: decoding, resampling, duration bounds, placeholders and bad input."""

import json

import numpy as np
import pytest
import torch
from _audio_helpers import tone, write

from lightrft.data import DataError, PromptDataset, SFTDataset
from lightrft.data.audio import AudioInputs, AudioOptions, decode_audio
from lightrft.data.collate import PackCollator, PadCollator
from lightrft.data.media import MediaOptions

AUDIO_TOKEN = "<|AUDIO|>"


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_files_decode_resample_and_expand_as_the_stock_processor(
    tmp_path, audio_processor, audio_files
):
    data = jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "<audio>Count.", "completion": "3", "audios": [audio_files[0]]},
            {"prompt": "<audio> vs <audio>?", "completion": "b", "audios": audio_files[1:]},
        ],
    )
    ds = SFTDataset(audio_processor, data)
    assert ds.stats["audios"] == 3 and ds.stats["audio_clipped"] == 0
    item = ds[1]
    inputs = item["media"].audio
    assert isinstance(inputs, AudioInputs) and len(inputs) == 2
    # 0.8 s at 22.05 kHz stereo and 0.3 s at 8 kHz, both at the extractor's 16 kHz, mono.
    assert [a.shape for a in inputs.audios] == [(12800,), (4800,)]
    tok = audio_processor.tokenizer
    audio_id = tok.convert_tokens_to_ids(AUDIO_TOKEN)
    assert int((item["input_ids"] == audio_id).sum()) == sum(inputs.num_tokens)
    assert (item["labels"][item["input_ids"] == audio_id] == -100).all()
    # The stock Qwen2AudioProcessor, given the same rendered prompt and waveforms, gives the
    # same prompt ids and features.
    prompts = PromptDataset(audio_processor, data, reference_field="completion")
    text = audio_processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "audio"},
                    {"type": "text", "text": " vs "},
                    {"type": "audio"},
                    {"type": "text", "text": "?"},
                ],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    stock = audio_processor(text=text, audio=inputs.audios, return_tensors="pt")
    assert stock["input_ids"][0].tolist() == prompts[1]["prompt_ids"]
    torch.testing.assert_close(stock["input_features"], prompts[1]["media"].audio.input_features)
    torch.testing.assert_close(stock["input_features"], inputs.input_features)
    torch.testing.assert_close(
        stock["feature_attention_mask"].long(), inputs.feature_attention_mask
    )


def test_inline_parts_hf_arrays_and_bytes(tmp_path, audio_processor, audio_files):
    wave = tone(0.4, 8000)
    flac = (tmp_path / audio_files[1]).read_bytes()
    records = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "audio", "audio": str(tmp_path / audio_files[0])},
                        {"type": "text", "text": "hi"},
                    ],
                },
                {"role": "assistant", "content": "ok"},
            ]
        },
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [
                        {"type": "audio", "audio_url": {"bytes": flac}},
                        {"type": "text", "text": "x"},
                    ],
                }
            ],
            "completion": "y",
        },
        {
            "prompt": "<audio>z",
            "completion": "w",
            "audios": {"array": wave.tolist(), "sampling_rate": 8000},
        },
    ]
    ds = SFTDataset(audio_processor, records=records)
    assert ds.stats["audios"] == 3
    assert ds[2]["media"].audio.audios[0].shape == (6400,)
    pd = PromptDataset(audio_processor, records=records, reference_required=False)
    assert [len(pd[i]["media"].audio) for i in range(3)] == [1, 1, 1]
    assert (
        pd[0]["prompt_ids"].count(audio_processor.audio_token_id)
        == pd[0]["media"].audio.num_tokens[0]
    )


def test_max_duration_clips_or_drops_counted(tmp_path, audio_processor):
    long = write(tmp_path / "long.wav", tone(1.5, 16000), 16000)
    short = write(tmp_path / "short.wav", tone(0.5, 16000), 16000)
    records = [
        {"prompt": "<audio>a", "completion": "1", "audios": [long]},
        {"prompt": "<audio>b", "completion": "2", "audios": [short]},
    ]
    data = jsonl(tmp_path / "d.jsonl", records)
    clipped = SFTDataset(
        audio_processor, data, media=MediaOptions(audio=AudioOptions(max_seconds=1.0))
    )
    assert clipped.stats["audio_clipped"] == 1 and clipped.stats["audio_dropped"] == 0
    assert clipped[0]["media"].audio.audios[0].shape == (16000,)
    assert int(clipped[0]["media"].audio.feature_attention_mask.sum()) == 100  # 1 s of 10 ms frames
    dropped = SFTDataset(
        audio_processor,
        data,
        media=MediaOptions(audio=AudioOptions(max_seconds=1.0, overlong="drop")),
    )
    assert dropped.stats["audio_dropped"] == 1 and len(dropped) == 1
    prompts = PromptDataset(
        audio_processor,
        data,
        reference_field="completion",
        media=MediaOptions(audio=AudioOptions(max_seconds=1.0, overlong="drop")),
    )
    assert prompts.stats["audio_dropped"] == 1 and prompts.stats["prompts"] == 1
    with pytest.raises(ValueError, match=r"media.audio.max_seconds must be in \(0, 2\]"):
        SFTDataset(audio_processor, data, media=MediaOptions(audio=AudioOptions(max_seconds=5)))
    with pytest.raises(
        ValueError, match="media.audio.overlong expects one of 'clip', 'drop', got 'cut'"
    ):
        SFTDataset(audio_processor, data, media=MediaOptions(audio=AudioOptions(overlong="cut")))


def test_audio_options_need_an_audio_processor(tmp_path, tiny_model_dir):
    from lightrft.models import load_tokenizer

    with pytest.raises(ValueError, match="media.audio options need an audio-language"):
        SFTDataset(
            load_tokenizer(tiny_model_dir),
            records=[{"prompt": "a", "completion": "b"}],
            media=MediaOptions(audio=AudioOptions(max_seconds=1.0)),
        )


GOOD = {"prompt": "<audio>ok", "completion": "c", "audios": ["a.wav"]}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"prompt": "<audio>x", "completion": "c", "audios": ["missing.wav"]},
            r"line 2: audios\[0\]: audio file not found: .*missing.wav",
        ),
        (
            {"prompt": "<audio>x", "completion": "c", "audios": ["notaudio.wav"]},
            r"line 2: audios\[0\]: cannot decode the audio file .*notaudio.wav",
        ),
        (
            {"prompt": "<audio>x", "completion": "c", "audios": ["a.wav", "a.wav"]},
            r"line 2: field 'audios': 2 audio\(s\) but the messages have 1 audio part",
        ),
        (
            {"prompt": "x", "completion": "c", "audios": ["a.wav"]},
            r"line 2: field 'audios': 1 audio\(s\) but the messages have 0 audio part",
        ),
        (
            {"prompt": "<audio>x", "completion": "c", "audios": [{"array": [0.1] * 800}]},
            r"line 2: audios\[0\]: an audio array needs its 'sampling_rate'",
        ),
        (
            {
                "prompt": "<audio>x",
                "completion": "c",
                "audios": [{"array": [0.1] * 800, "sampling_rate": 0}],
            },
            r"line 2: audios\[0\]: sampling rate must be a positive integer, got 0",
        ),
        (
            {
                "prompt": "<audio>x",
                "completion": "c",
                "audios": [{"array": [0.1] * 8, "sampling_rate": 16000}],
            },
            r"line 2: audios\[0\]: the audio is 0.5 ms long; at least",
        ),
        (
            {
                "prompt": "<audio>x",
                "completion": "c",
                "audios": [{"array": [], "sampling_rate": 16000}],
            },
            r"line 2: audios\[0\]: the audio is empty",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [{"type": "audio", "audio": "a.wav"}]},
                ]
            },
            r"line 2: audios: an audio in an assistant turn",
        ),
        (
            {
                "prompt": "<audio>x",
                "completion": "c",
                "audios": ["a.wav"],
                "messages": None,
                "extra": 1,
                "images": ["a.png"],
            },
            r"line 2: the record has images, but the dataset was built with a processor for "
            r"audios only \(field 'images'\)",
        ),
        (
            {
                "prompt": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}
                ],
                "completion": "c",
            },
            r"line 2: an image part, but the model's processor takes audios only",
        ),
    ],
)
def test_bad_input_fails_at_load_naming_file_line_and_field(
    tmp_path, audio_processor, bad, message
):
    write(tmp_path / "a.wav", tone(0.3), 16000)
    (tmp_path / "notaudio.wav").write_text("this is not a RIFF file")
    data = jsonl(tmp_path / "train.jsonl", [GOOD, bad])
    with pytest.raises(DataError, match=message) as err:
        SFTDataset(audio_processor, data)
    assert "train.jsonl line 2" in str(err.value)


def test_audio_needs_an_audio_model_and_the_chat_template(
    tmp_path, tiny_model_dir, audio_processor
):
    from lightrft.models import load_tokenizer

    write(tmp_path / "a.wav", tone(0.3), 16000)
    data = jsonl(tmp_path / "train.jsonl", [GOOD])
    with pytest.raises(
        DataError, match="line 1: the record has audios, but the dataset was built with a tokenizer"
    ):
        SFTDataset(load_tokenizer(tiny_model_dir), data)
    with pytest.raises(DataError, match="line 1: field 'audios': audios need apply_chat_template"):
        PromptDataset(
            audio_processor, data, reference_field="completion", apply_chat_template=False
        )


def test_audio_part_for_a_vision_model_is_refused(tmp_path, tiny_vlm):
    from lightrft.models import load_processor

    write(tmp_path / "a.wav", tone(0.3), 16000)
    rec = {
        "prompt": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}],
        "completion": "c",
    }
    with pytest.raises(
        DataError,
        match="line 1: an audio part, but the model's processor takes images and videos only",
    ):
        SFTDataset(load_processor(tiny_vlm("qwen2_vl")), jsonl(tmp_path / "t.jsonl", [rec]))


def test_collators_join_audio_in_token_order(tmp_path, audio_processor, audio_files):
    data = jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "<audio>a", "completion": "1", "audios": [audio_files[0]]},
            {"prompt": "plain", "completion": "2"},
            {"prompt": "<audio><audio>b", "completion": "3", "audios": audio_files[1:]},
        ],
    )
    ds = SFTDataset(audio_processor, data)
    items = [ds[i] for i in range(3)]
    pad = PadCollator(audio_processor.tokenizer.pad_token_id)(items)
    assert [a.shape for a in pad["media"].audio.audios] == [(8000,), (12800,), (4800,)]
    assert pad["media"].audio.input_features.shape[0] == 3
    packed = PackCollator(audio_processor.tokenizer.pad_token_id)(items)
    assert packed["media"].audio.num_tokens == pad["media"].audio.num_tokens
    assert packed["input_ids"].shape[0] == 1
    ids = packed["input_ids"][0]
    assert int((ids == audio_processor.audio_token_id).sum()) == sum(pad["media"].audio.num_tokens)


def test_decode_audio_mixes_channels_and_keeps_the_rate(tmp_path):
    stereo = np.stack([tone(0.1), -tone(0.1)], axis=1)
    name = write(tmp_path / "s.wav", stereo, 16000)
    wave = decode_audio(name, sampling_rate=16000, base_dir=tmp_path, where="w", field="f")
    assert wave.dtype == np.float32 and wave.shape == (1600,)
    np.testing.assert_allclose(wave, 0.0, atol=1e-4)  # left and right cancel


def test_hf_datasets_directory_with_an_audio_column(tmp_path, audio_processor):
    """A saved HF dataset with an ``Audio`` column (stored as file bytes) and one with decoded
    ``{"array", "sampling_rate"}`` values both load (no torchcodec: the bytes are decoded here)."""
    import io

    import datasets
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, tone(0.6, 22050), 22050, format="WAV")
    encoded = datasets.Dataset.from_dict(
        {
            "prompt": ["<audio>q"],
            "answer": ["a"],
            "audio": [{"bytes": buf.getvalue(), "path": "x.wav"}],
        }
    ).cast_column("audio", datasets.Audio(sampling_rate=16000))
    encoded.save_to_disk(tmp_path / "encoded")
    arrays = datasets.Dataset.from_dict(
        {
            "prompt": ["<audio>q"],
            "answer": ["a"],
            "audio": [{"array": tone(0.6, 8000).tolist(), "sampling_rate": 8000}],
        }
    )
    arrays.save_to_disk(tmp_path / "arrays")
    for name in ("encoded", "arrays"):
        ds = PromptDataset(
            audio_processor, tmp_path / name, media=MediaOptions(audio=AudioOptions(field="audio"))
        )
        assert ds[0]["media"].audio.audios[0].shape == (9600,), name  # 0.6 s at 16 kHz
