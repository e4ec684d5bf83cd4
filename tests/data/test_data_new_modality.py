"""A toy modality added through only the files docs/architecture.md names for a new kind: its
own module (here, this test's classes: inputs, options, processor) and the three registrations
in ``lightrft/data/media.py`` (a ``Media`` field, a ``MediaOptions`` field, its processor in
``PROCESSORS``), patched in as that file's edit would make them. Nothing else is touched: the
datasets find, load, process and expand it, ``validate`` checks its options, and it reaches the
model's forward through ``Media.model_inputs``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from lightrft import config
from lightrft.config import Section, option, section
from lightrft.data import PromptDataset, SFTDataset, conversation
from lightrft.data import media as media_module
from lightrft.data.io import DataError
from lightrft.data.media import Media, MediaOptions
from lightrft.models import load_tokenizer

# ------------------------------------------------------------- lightrft/data/toy.py, the new kind


@dataclass
class ToyInputs:
    """A sample's toy signals: ``values`` ``[signals, 4]``, one token per value row."""

    signals: list[list[float]]
    toy_values: torch.Tensor
    num_tokens: list[int]

    def __len__(self) -> int:
        return len(self.signals)

    def parts(self) -> list[dict[str, Any]]:
        return [{"toy": s} for s in self.signals]

    def model_inputs(self, device=None) -> dict[str, torch.Tensor]:
        return {"toy_values": self.toy_values.to(device) if device else self.toy_values}

    @staticmethod
    def cat(items: Sequence[ToyInputs | None]) -> ToyInputs | None:
        present = [x for x in items if x is not None and len(x)]
        if not present:
            return None
        return ToyInputs(
            [s for x in present for s in x.signals],
            torch.cat([x.toy_values for x in present]),
            [n for x in present for n in x.num_tokens],
        )


@section
class ToyOptions(Section):
    field: str = option("toys", doc="the records' toy signals")
    scale: float = option(1.0, doc="multiplies every value", gt=0)


class ToyProcessor:
    kind, tag, inline = "toy", "<toy>", ("toy",)
    needs = "a toy-language"

    @staticmethod
    def takes(processor) -> bool:
        return getattr(processor, "toy_extractor", None) is not None

    def __init__(self, processor, options: ToyOptions) -> None:
        self.token, self.token_id, self.scale = "<toy>", processor.toy_token_id, options.scale

    def load(self, values, *, base_dir, where: str, field: str) -> list[list[float]]:
        for j, v in enumerate(values):
            if not isinstance(v, list) or not v:
                raise DataError(f"{where}: {field}[{j}]: a toy signal is a non-empty list")
        return [[float(x) * self.scale for x in v] for v in values]

    def process(self, signals: list[list[float]]) -> ToyInputs:
        rows = [torch.tensor(s).repeat(4, 1).T for s in signals]  # [len, 4] each
        return ToyInputs(list(signals), torch.cat(rows), [len(s) for s in signals])


# ------------------------------------------------- the three lines lightrft/data/media.py gains


@dataclass(frozen=True)
class ToyMedia(Media):
    toy: ToyInputs | None = None


@section
class ToyMediaOptions(MediaOptions):
    toy: ToyOptions = option(default_factory=ToyOptions, doc="toy signals")


@pytest.fixture
def toy(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(media_module, "Media", ToyMedia)
    monkeypatch.setattr(media_module, "MediaOptions", ToyMediaOptions)
    monkeypatch.setattr(media_module, "PROCESSORS", (*media_module.PROCESSORS, ToyProcessor))
    tok = load_tokenizer(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<toy>"]})
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}{% if p.type == 'toy' %}<toy>{% else %}{{ p.text }}"
        "{% endif %}{% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tid = tok.convert_tokens_to_ids("<toy>")
    return SimpleNamespace(tokenizer=tok, toy_extractor=True, toy_token_id=tid), tid


def test_a_toy_kind_rides_the_datasets_generic_path(toy):
    proc, tid = toy
    recs = [{"prompt": "hear <toy> and <toy>", "answer": "a", "toys": [[1, 2, 3], [4]]}]
    opts = ToyMediaOptions(toy=ToyOptions(scale=2.0))
    item = PromptDataset(proc, records=recs, media=opts)[0]
    assert item["prompt_ids"].count(tid) == 4  # 3 + 1 toy tokens, expanded
    media = item["media"]
    assert isinstance(media, ToyMedia) and media.toy.signals == [[2, 4, 6], [8]]
    assert media.model_inputs()["toy_values"].shape == (4, 4)  # what the forward gets
    chat = conversation(item["messages"], media)
    assert [p for p in chat[0]["content"] if p["type"] == "toy"][1] == {"type": "toy", "toy": [8]}
    # A message list's toy content part is a part like an image's (no table to add it to).
    parts = [{"type": "toy"}, {"type": "text", "text": "hear"}]
    msgs = [{"role": "user", "content": parts}]
    item = PromptDataset(proc, records=[{"messages": msgs, "answer": "a", "toys": [[1]]}])[0]
    assert item["prompt_ids"].count(tid) == 1 and item["media"].toy.signals == [[1.0]]
    # SFT: no loss on toy tokens; a record with more signals than tags names file and field.
    sft = SFTDataset(proc, records=[{"prompt": "<toy>x", "completion": "y", "toys": [[1, 2]]}])
    assert sft[0]["input_ids"].tolist().count(tid) == 2
    with pytest.raises(DataError, match=r"field 'toys': 2 toy\(s\) but the messages have 1"):
        SFTDataset(proc, records=[{"prompt": "<toy>x", "completion": "y", "toys": [[1], [2]]}])


def test_a_toy_kinds_options_are_checked_by_validate_and_need_a_toy_model(toy, tiny_model_dir):
    proc, _ = toy
    # A text model refuses the toy options, naming the key (the one rule, for every kind).
    with pytest.raises(ValueError, match="media.toy options need a toy-language model"):
        PromptDataset(
            load_tokenizer(tiny_model_dir),
            records=[{"prompt": "q", "answer": "a"}],
            media=ToyMediaOptions(toy=ToyOptions(scale=3.0)),
        )
    node = OmegaConf.create({"toy": {"scale": -1.0, "field": "signals"}})
    config.check(node, ToyMediaOptions.schema())  # the types hold; the bound is read:
    with pytest.raises(ValueError, match=r"dataset\.media\.toy\.scale must be > 0"):
        ToyMediaOptions.read(node, "dataset.media.")
    with pytest.raises(config.ConfigError, match="unknown key 'toy.rate'"):
        config.check(OmegaConf.create({"toy": {"rate": 2}}), ToyMediaOptions.schema())
