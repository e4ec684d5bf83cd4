"""Images in prompt and SFT datasets: every source format, resizing, collate and packing, and
bad input failing at load with file, line and field."""

import base64
import io
import json

import pytest
import torch
from _vision_helpers import square

from lightrft.data import (
    DataError,
    Media,
    PackedDataset,
    PromptDataset,
    SFTDataset,
    pack_or_pad_collator,
)
from lightrft.data.media import MediaOptions
from lightrft.data.templates import IGNORE_INDEX
from lightrft.data.vision import ImageInputs, ImageOptions, fit_pixels
from lightrft.models import load_tokenizer
from lightrft.models.multimodal import load_processor


@pytest.fixture(scope="module")
def proc(tiny_vlm):
    return load_processor(tiny_vlm("qwen2_vl"))


def _b64(img, fmt="PNG"):
    buf = io.BytesIO()
    img.save(buf, fmt)
    return base64.b64encode(buf.getvalue()).decode()


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _n_image_tokens(ids, proc):
    return sum(1 for t in ids if t == proc.image_token_id)


def test_sources_paths_base64_data_url_and_inline_parts(proc, tmp_path, image_files):
    sub = tmp_path / "sub"
    sub.mkdir()
    data = _write_jsonl(
        sub / "train.jsonl",
        [
            {"prompt": "<image>a", "answer": "1", "images": ["../img0.png"]},  # relative
            {"prompt": "<image>b", "answer": "2", "images": _b64(square((1, 2, 3)))},  # 1 value
            {
                "prompt": "<image>c",
                "answer": "3",
                "images": ["data:image/png;base64," + _b64(square((4, 5, 6)))],
            },
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": str(image_files[1])},
                            {"type": "text", "text": "d"},
                        ],
                    }
                ],
                "answer": "4",
            },
            {"prompt": "no image", "answer": "5"},
        ],
    )
    ds = PromptDataset(proc, data)
    grids = [ds[i]["media"].image.image_grid_thw.tolist() for i in range(4)]
    # 56x56 -> 2x2 tokens; 84x56 (img1) -> 3x2 tokens.
    assert grids == [[[1, 4, 4]], [[1, 4, 4]], [[1, 4, 4]], [[1, 4, 6]]]
    for i in range(4):
        item = ds[i]
        assert _n_image_tokens(item["prompt_ids"], proc) == sum(item["media"].image.num_tokens)
        assert "<|vision_start|><|image_pad|><|vision_end|>" in item["prompt"]
    assert ds[4]["media"] is None and _n_image_tokens(ds[4]["prompt_ids"], proc) == 0


def test_parquet_image_structs_and_hf_dataset_image_column(proc, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    png = base64.b64decode(_b64(square((10, 20, 30), (84, 84))))
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": "<image>q", "answer": "a", "images": [{"bytes": png, "path": None}]}]
        ),
        tmp_path / "train.parquet",
    )
    ds = PromptDataset(proc, tmp_path / "train.parquet")
    assert ds[0]["media"].image.image_grid_thw.tolist() == [[1, 6, 6]]

    features = datasets.Features(
        {
            "prompt": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "images": datasets.Sequence(datasets.Image()),
        }
    )
    hf = datasets.Dataset.from_dict(
        {"prompt": ["<image>q"], "answer": ["a"], "images": [[square((9, 9, 9), (84, 84))]]},
        features=features,
    )
    hf.save_to_disk(str(tmp_path / "hf"))
    ds = SFTDataset(
        proc,
        tmp_path / "hf",
        records=None,
        prompt_field="prompt",
        completion_field="answer",
    )
    assert ds[0]["media"].image.image_grid_thw.tolist() == [[1, 6, 6]]


def test_pixel_bounds_resize_keeping_aspect(proc):
    img = fit_pixels(square((1, 1, 1), (400, 200)), None, 28 * 28 * 4)
    assert img.size[0] * img.size[1] <= 28 * 28 * 4 and abs(img.size[0] / img.size[1] - 2) < 0.05
    img = fit_pixels(square((1, 1, 1), (10, 20)), 28 * 28, None)
    assert img.size[0] * img.size[1] >= 28 * 28
    recs = [{"prompt": "<image>q", "answer": "a", "images": [square((1, 1, 1), (448, 448))]}]
    small = PromptDataset(
        proc, records=recs, media=MediaOptions(image=ImageOptions(max_pixels=56 * 56))
    )
    assert small[0]["media"].image.image_grid_thw.tolist() == [[1, 4, 4]]
    assert small[0]["media"].image.images[0].size == (56, 56)
    with pytest.raises(
        ValueError, match="media.image.min_pixels .* must be <= media.image.max_pixels"
    ):
        PromptDataset(
            proc,
            records=recs,
            media=MediaOptions(image=ImageOptions(min_pixels=10_000, max_pixels=100)),
        )
    with pytest.raises(ValueError, match="media.image options need a vision-language"):
        PromptDataset(
            proc.tokenizer,
            records=[{"prompt": "q", "answer": "a"}],
            media=MediaOptions(image=ImageOptions(max_pixels=100)),
        )


def test_sft_labels_never_train_vision_tokens_and_collate_packs_images(proc):
    recs = [
        {"prompt": "<image>colour?", "completion": "red", "images": [square((255, 0, 0))]},
        {
            "prompt": "two: <image><image>",
            "completion": "ok",
            "images": [square((0, 255, 0)), square((0, 0, 255), (84, 56))],
        },
        {"prompt": "text", "completion": "only"},
    ]
    ds = SFTDataset(proc, records=recs)
    assert ds.stats["images"] == 3
    for i in range(2):
        item = ds[i]
        vis = item["input_ids"] == proc.image_token_id
        assert int(vis.sum()) == sum(item["media"].image.num_tokens)
        assert (item["labels"][vis] == IGNORE_INDEX).all()
    assert "media" not in ds[2]
    items = [ds[i] for i in range(3)]
    for packing in (False, True):
        batch = pack_or_pad_collator(proc.tokenizer, packing)(items)
        images = batch["media"].image
        assert isinstance(images, ImageInputs) and len(images) == 3
        assert images.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 6]]
        assert images.pixel_values.shape[0] == int(images.image_grid_thw.prod(-1).sum())
    packed = PackedDataset(ds, max_tokens=200, shuffle=False)
    row = packed[0]
    assert len(row["media"].image) == 3 and int(
        (row["input_ids"] == proc.image_token_id).sum()
    ) == sum(row["media"].image.num_tokens)


def test_truncation_that_would_cut_an_image_drops_the_sample(proc):
    recs = [{"prompt": "<image>" + "x" * 30, "answer": "a", "images": [square((1, 1, 1))]}]
    ds_kw = dict(records=recs, max_prompt_length=30, truncation="truncate")
    with pytest.raises(DataError, match="empty dataset"):
        PromptDataset(proc, **ds_kw)
    # The engine's limit too: a cut that would lose vision tokens drops the prompt.
    ds = PromptDataset(
        proc,
        records=[*recs, {"prompt": "<image>q", "answer": "a", "images": [square((1, 1, 1))]}],
        truncation="truncate",
    )
    assert ds.fit_to_engine(31) == 1 and ds.stats["engine_dropped"] == 1 and len(ds) == 1


@pytest.mark.parametrize(
    "record, match",
    [
        (
            {"prompt": "<image>q", "answer": "a", "images": ["missing.png"]},
            r"train\.jsonl line 1: images\[0\]: image file not found: .*missing\.png",
        ),
        (
            {"prompt": "<image>q", "answer": "a", "images": ["bad.png"]},
            r"train\.jsonl line 1: images\[0\]: cannot decode the image",
        ),
        (
            {"prompt": "<image><image>q", "answer": "a", "images": ["img0.png"]},
            r"train\.jsonl line 1: field 'images': 1 image\(s\) but the messages have 2 image part",
        ),
        (
            {"prompt": "q", "answer": "a", "images": ["img0.png"]},
            r"train\.jsonl line 1: field 'images': 1 image\(s\) but the messages have 0 image part",
        ),
        (
            {"prompt": "<image>q", "answer": "a"},
            r"train\.jsonl line 1: field 'images': 0 image\(s\) but the messages have 1 image part",
        ),
        (
            {"prompt": "<image>q", "answer": "a", "images": ["!!notbase64!!" * 8]},
            r"train\.jsonl line 1: images\[0\]: not a valid base64 image",
        ),
        (
            {
                "messages": [{"role": "user", "content": [{"type": "image", "image": "img0.png"}]}],
                "answer": "a",
                "images": ["img0.png"],
            },
            r"train\.jsonl line 1: images both in field 'images' and inline",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}], "answer": "a"},
            r"train\.jsonl line 1: field 'videos': 0 video\(s\) but the messages have 1 video",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "gif"}]}], "answer": "a"},
            r"train\.jsonl line 1: messages\[0\]\.content\[0\] must be a text part",
        ),
    ],
)
def test_bad_images_fail_at_load_naming_file_line_and_field(
    proc, tmp_path, image_files, record, match
):
    (tmp_path / "bad.png").write_bytes(b"not an image at all")
    data = _write_jsonl(tmp_path / "train.jsonl", [record])
    with pytest.raises(DataError, match=match):
        PromptDataset(proc, data)


def test_images_need_a_processor_and_the_chat_template(proc, tiny_model_dir, tmp_path, image_files):
    data = _write_jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": "<image>q", "completion": "a", "images": ["img0.png"]}],
    )
    with pytest.raises(
        DataError, match="line 1: the record has images, but the dataset was built with a tokenizer"
    ):
        SFTDataset(load_tokenizer(tiny_model_dir), data)
    with pytest.raises(
        DataError, match="line 1: field 'images': images need apply_chat_template=true"
    ):
        SFTDataset(proc, data, apply_chat_template=False)


def test_an_image_in_an_assistant_turn_is_refused(proc):
    recs = [
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "image"}]},
            ],
            "images": [square((1, 1, 1))],
        }
    ]
    with pytest.raises(DataError, match="an image in an assistant turn"):
        SFTDataset(proc, records=recs)


def test_media_cat_keeps_order(proc):
    ds = PromptDataset(
        proc,
        records=[
            {"prompt": "<image>a", "answer": "1", "images": [square((1, 1, 1), (84, 56))]},
            {"prompt": "b", "answer": "2"},
            {"prompt": "<image>c", "answer": "3", "images": [square((2, 2, 2))]},
        ],
    )
    media = Media.cat([ds[i]["media"] for i in range(3)])
    cat = media.image
    assert cat.image_grid_thw.tolist() == [[1, 4, 6], [1, 4, 4]]
    assert torch.equal(cat.pixel_values[:24], ds[0]["media"].image.pixel_values)
    assert media.audio is None and [k for k, _ in media.kinds()] == ["image"]
    assert Media.cat([None, None]) is None and Media.cat([Media()]) is None
    # The forward's inputs: floating features take the model's dtype, the grid stays long.
    kw = media.model_inputs(dtype=torch.bfloat16)
    assert kw["pixel_values"].dtype == torch.bfloat16 and kw["image_grid_thw"].dtype == torch.long
    with pytest.raises(TypeError, match="Media.image must be the processed ImageInputs"):
        Media(image=[square((1, 1, 1))])


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_sft_and_rl_see_the_same_prompt_tokens_and_pixels(tiny_vlm, arch):
    """What SFT trains on and what the engine is prompted with agree (same prompt ids, same
    pixel values), so an SFT warm-up transfers to RL."""
    proc = load_processor(tiny_vlm(arch))
    rec = {
        "prompt": "<image>How many?",
        "completion": "3",
        "answer": "3",
        "images": [square((1, 200, 3), (84, 84))],
    }
    sft = SFTDataset(proc, records=[rec])[0]
    rl = PromptDataset(proc, records=[rec])[0]
    n = len(rl["prompt_ids"])
    assert sft["input_ids"][:n].tolist() == rl["prompt_ids"]
    assert torch.equal(sft["media"].image.pixel_values, rl["media"].image.pixel_values)
