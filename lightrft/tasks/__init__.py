"""The data sets and tiny models that configs' ``prepare`` steps make: synthetic demo tasks
(arithmetic, multiplication with a calculator, counting boards, moving squares, tones), converters of public tasks (GSM8K, audio question
answering), and tiny randomly initialised HF models.

    prepare:
      - _component_: lightrft.tasks.ensure_arith_dataset
        out_dir: outputs/data/arith
"""

from lightrft.tasks.aqa import prepare_aqa
from lightrft.tasks.arith import (
    arith_records,
    ensure_arith_dataset,
    ensure_arith_judgments,
    ensure_arith_preferences,
    near_miss,
    write_arith_dataset,
)
from lightrft.tasks.calc import ensure_calc_dataset, write_calc_dataset
from lightrft.tasks.gsm8k import ensure_gsm8k, prepare_gsm8k
from lightrft.tasks.motion import ensure_motion_dataset
from lightrft.tasks.shapes import (
    ensure_shapes_dataset,
    ensure_shapes_judgments,
    ensure_shapes_preferences,
)
from lightrft.tasks.tiny import ensure_tiny_model, make_tiny_model
from lightrft.tasks.tones import ensure_tones_dataset

__all__ = [
    "arith_records",
    "ensure_arith_dataset",
    "ensure_arith_judgments",
    "ensure_arith_preferences",
    "ensure_calc_dataset",
    "ensure_gsm8k",
    "ensure_motion_dataset",
    "ensure_shapes_dataset",
    "ensure_shapes_judgments",
    "ensure_shapes_preferences",
    "ensure_tiny_model",
    "ensure_tones_dataset",
    "make_tiny_model",
    "near_miss",
    "prepare_aqa",
    "prepare_gsm8k",
    "write_arith_dataset",
    "write_calc_dataset",
]
