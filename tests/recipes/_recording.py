"""Datasets that write down every item a run reads (the resume-on-another-world-size tests):
with ``LIGHTRFT_TEST_RECORD=<prefix>`` each read appends its index to ``<prefix>.<rank>``."""

from __future__ import annotations

import os

from lightrft.data import PreferenceDataset, PromptDataset, SFTDataset


def _record(i: int) -> None:
    prefix = os.environ.get("LIGHTRFT_TEST_RECORD")
    if prefix:
        with open(f"{prefix}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(f"{i}\n")


class RecordingSFTDataset(SFTDataset):
    def __getitem__(self, i: int):
        _record(i)
        return super().__getitem__(i)


class RecordingPromptDataset(PromptDataset):
    def __getitem__(self, i: int):
        _record(i)
        return super().__getitem__(i)


def read_record(prefix: str, rank: int = 0) -> list[int]:
    """The indices rank ``rank`` read under ``prefix``, in order."""
    path = f"{prefix}.{rank}"
    return [int(x) for x in open(path).read().split()] if os.path.exists(path) else []


class DigitReward:
    """Fraction of the response's characters that are digits (a trivial task with a signal)."""

    def __call__(self, samples):
        responses = [s.response for s in samples]
        return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


class RecordingPreferenceDataset(PreferenceDataset):
    def __getitem__(self, i: int):
        _record(i)
        return super().__getitem__(i)
