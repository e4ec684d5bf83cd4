"""Data: loading records, SFT and RL prompt datasets, packing, collators, resumable loaders.

See docs/data.md.
"""

from lightrft.data.arith import (
    arith_records,
    ensure_arith_dataset,
    ensure_arith_judgments,
    ensure_arith_preferences,
    write_arith_dataset,
)
from lightrft.data.audio import AudioInputs, AudioProcessor
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
from lightrft.data.gsm8k import convert_gsm8k, ensure_gsm8k, prepare_gsm8k
from lightrft.data.io import DataError, Records, load_records
from lightrft.data.loader import ResumableDataLoader, build_dataloader, step_batches
from lightrft.data.preference import PreferenceCollator, PreferenceDataset
from lightrft.data.prompts import PromptDataset, conversation
from lightrft.data.sft import SFTDataset
from lightrft.data.shapes import (
    ensure_shapes_dataset,
    ensure_shapes_preferences,
    write_shapes_dataset,
)
from lightrft.data.templates import IGNORE_INDEX
from lightrft.data.tones import ensure_tones_dataset, write_tones_dataset
from lightrft.data.vision import ImageInputs, ImageProcessor

__all__ = [
    "IGNORE_INDEX",
    "AudioInputs",
    "AudioProcessor",
    "DataError",
    "ImageInputs",
    "ImageProcessor",
    "PackCollator",
    "PackedDataset",
    "PadCollator",
    "PreferenceCollator",
    "PreferenceDataset",
    "PromptDataset",
    "Records",
    "ResumableDataLoader",
    "SFTDataset",
    "StepCollator",
    "arith_records",
    "build_dataloader",
    "collate_prompts",
    "conversation",
    "convert_gsm8k",
    "ensure_arith_dataset",
    "ensure_arith_judgments",
    "ensure_arith_preferences",
    "ensure_tones_dataset",
    "ensure_gsm8k",
    "ensure_shapes_dataset",
    "ensure_shapes_preferences",
    "load_records",
    "pack_indices",
    "pack_or_pad_collator",
    "packed_sft_dataset",
    "plan_micro_batches",
    "prepare_gsm8k",
    "step_batches",
    "write_arith_dataset",
    "write_tones_dataset",
    "write_shapes_dataset",
]
