"""Data: loading records, SFT and RL prompt datasets, packing, collators, resumable loaders.

See docs/data.md.
"""

from lightrft.data.audio import AudioInputs, AudioOptions
from lightrft.data.collate import (
    PackCollator,
    PackedDataset,
    PadCollator,
    StepCollator,
    collate_prompts,
    pack_indices,
    pack_or_pad_collator,
    packed_sft_dataset,
    plan_micro_batches,
)
from lightrft.data.io import DataError, Records, load_records
from lightrft.data.loader import (
    ResumableDataLoader,
    build_dataloader,
    epoch_batches,
    step_batches,
)
from lightrft.data.media import Media, MediaOptions
from lightrft.data.preference import (
    PreferenceCollator,
    PreferenceDataset,
    UnpairedPreferenceDataset,
)
from lightrft.data.prompts import PromptDataset, conversation
from lightrft.data.sft import SFTDataset
from lightrft.data.templates import IGNORE_INDEX
from lightrft.data.video import VideoInputs, VideoOptions
from lightrft.data.vision import ImageInputs, ImageOptions

__all__ = [
    "IGNORE_INDEX",
    "AudioInputs",
    "AudioOptions",
    "DataError",
    "ImageInputs",
    "ImageOptions",
    "Media",
    "MediaOptions",
    "PackCollator",
    "PackedDataset",
    "PadCollator",
    "PreferenceCollator",
    "PreferenceDataset",
    "UnpairedPreferenceDataset",
    "PromptDataset",
    "Records",
    "ResumableDataLoader",
    "SFTDataset",
    "StepCollator",
    "VideoInputs",
    "VideoOptions",
    "build_dataloader",
    "collate_prompts",
    "conversation",
    "load_records",
    "pack_indices",
    "pack_or_pad_collator",
    "packed_sft_dataset",
    "plan_micro_batches",
    "epoch_batches",
    "step_batches",
]
