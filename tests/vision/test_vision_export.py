"""export_hf with a processor: the export reloads with AutoModelForImageTextToText and
AutoProcessor (and our loaders) and gives the trained model's logits."""

import torch
from _vision_helpers import square

from lightrft.models.export import export_hf
from lightrft.models.multimodal import load_processor, load_vision_model, set_vision_trainable


def _inputs(proc):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return proc(text=[text], images=[square((200, 30, 30), (84, 56))], return_tensors="pt")


def test_export_with_processor_round_trips(tiny_vlm, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_vlm("qwen2_5_vl")
    proc, model = load_processor(path), load_vision_model(path)
    set_vision_trainable(model, True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs = _inputs(proc)
    ids = inputs["input_ids"]
    model(**inputs, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        trained = model(**inputs).logits

    out = export_hf(model, proc, tmp_path / "export")
    assert (out / "processor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    for reload_model, reload_proc in (
        (AutoModelForImageTextToText.from_pretrained, AutoProcessor.from_pretrained),
        (load_vision_model, load_processor),
    ):
        again, proc2 = reload_model(out), reload_proc(out)
        assert type(proc2) is type(proc)
        inputs2 = _inputs(proc2)
        assert torch.equal(inputs2["input_ids"], ids)
        assert torch.equal(inputs2["pixel_values"], inputs["pixel_values"])
        with torch.no_grad():
            assert torch.equal(again(**inputs2).logits, trained)
