"""The shared config sections: one declaration each (lightrft.sections, lightrft.training.run),
their docs tables generated from them, and the same message for the same mistake in every
recipe that uses a section.

    python tests/test_sections.py --write     # regenerate docs/config.md's section tables
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lightrft import cli
from lightrft.config import ConfigError
from lightrft.sections import (
    BatchConfig,
    OptimConfig,
    PolicyModelConfig,
    StrategyConfig,
    check_model_path,
)
from lightrft.training.run import TrainingRunConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
BEGIN, END = (
    "<!-- sections:begin (generated: python tests/test_sections.py --write) -->",
    ("<!-- sections:end -->"),
)
# The shared sections, as docs/config.md shows them: (title, section, key prefix).
SHARED = [
    (
        "Run: directory, seed, logging, checkpoints, resume (every training recipe)",
        TrainingRunConfig,
        "",
    ),
    ("Model (sft, grpo; reward_model and eval use its first keys)", PolicyModelConfig, "model."),
    ("Strategy: FSDP2, HSDP, LoRA, DeepSpeed (every training recipe)", StrategyConfig, ""),
    ("Optimizer and schedule (every training recipe)", OptimConfig, ""),
    ("Data and batches (sft, reward_model)", BatchConfig, ""),
]


def generated() -> str:
    parts = [BEGIN]
    for title, section, prefix in SHARED:
        parts += ["", f"### {title}", "", section.doc_table(prefix)]
    return "\n".join(parts + ["", END])


def test_docs_tables_are_generated_from_the_sections():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lacks the generated section tables"
    current = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert current == generated(), "docs/config.md is stale: python tests/test_sections.py --write"


def test_a_section_is_its_schema():
    schema = StrategyConfig.schema()
    assert set(schema) == {
        "strategy",
        "deepspeed",
        "lora",
        "shard_size",
        "replicate_size",
        "offload",
        "sequence_parallel",
    }
    assert set(schema["lora"]) == {
        "rank",
        "alpha",
        "dropout",
        "target_modules",
        "trained_modules",
        "export_merged",
    }
    # null means the default; absent sections read as their defaults.
    run = TrainingRunConfig.read({"output_dir": "x", "seed": None, "metrics": None})
    assert (run.seed, run.log_every, run.metrics.tensorboard, run.keep_last) == (0, 1, True, 2)
    assert StrategyConfig.read({"strategy": "fsdp2"}).lora is None
    assert StrategyConfig.read({"lora": {"rank": 4}}).lora.alpha == 8.0


def test_a_section_built_in_python_checks_its_declared_types_and_bounds():
    from lightrft.data.media import MediaOptions
    from lightrft.data.video import VideoOptions

    ok = MediaOptions(video=VideoOptions(fps=4.0, num_frames=8))
    assert ok.checked("media.") == ok
    bad = [
        (VideoOptions(fps=0), "media.video.fps must be > 0, got 0"),
        (VideoOptions(fps=float("nan")), "media.video.fps must be > 0, got nan"),
        (VideoOptions(fps="4"), "media.video.fps expects float, got '4'"),
        (VideoOptions(max_frames=True), "media.video.max_frames expects int, got True"),
        (VideoOptions(min_pixels=0), "media.video.min_pixels must be >= 1, got 0"),
        (VideoOptions(overlong="cut"), "media.video.overlong expects one of 'clip', 'refuse'"),
    ]
    for video, match in bad:
        with pytest.raises(ValueError, match=re.escape(match)):
            MediaOptions(video=video).checked("media.")
    with pytest.raises(ValueError, match="clip_grad_norm must be > 0, got nan"):  # read too
        OptimConfig.read(
            {
                "optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1},
                "clip_grad_norm": float("nan"),
            }
        )


# The same mistake in a shared key, in each recipe that uses it: the same message. Base configs
# are the shipped tiny ones (validate loads nothing, so their data need not exist).
RECIPES = {"sft": "tiny/add_sft", "reward_model": "tiny/rlhf_rm", "grpo": "tiny/add_grpo"}
MISTAKES = [
    ("log_every=0", "log_every must be >= 1, got 0"),
    ("keep_last=0", "keep_last must be >= 1, got 0"),
    ("resume=true", "resume=true but no checkpoint found"),
    ("resume=true overwrite=true", "resume=true and overwrite=true contradict each other"),
    ("lr_scheduler.min_lr_ratio=2", "lr_scheduler.min_lr_ratio must be in [0, 1], got 2"),
    ("lr_scheduler.warmup_steps=-1", "lr_scheduler.warmup_steps must be >= 0, got -1"),
    ("clip_grad_norm=-1.0", "clip_grad_norm must be > 0, got -1.0"),
    ("strategy=zero3", "strategy: unknown strategy 'zero3'; choose one of"),
    ("shard_size=0", "shard_size must be >= 1, got 0"),
    ("deepspeed.stage=2", "a deepspeed: section is set but strategy=fsdp2"),
    ("lora.rank=0", "lora.rank must be >= 1, got 0"),
    ("lora.dropout=1.5 lora.rank=4", "lora.dropout must be in [0, 1), got 1.5"),
    ("model.dtype=float8", "'model.dtype' expects one of"),
    ("seed=x", "'seed' expects int, got 'x'"),
    ("output_dir=", "'output_dir' must not be null"),
    ("model.compile=maybe", "'model.compile' expects bool"),
    # Optimizer arguments, checked before the model loads (torch.optim ones by torch too).
    ("optimizer.lr=-1e-3", "optimizer.lr must be >= 0, got -0.001"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay must be >= 0, got -0.1"),
    (
        "optimizer.betas=[0.9,1.5]",
        "optimizer: torch.optim.AdamW refuses its arguments: Invalid beta parameter at index 1",
    ),
    ("optimizer.betas=[0.9", "override 'optimizer.betas=[0.9': the value of optimizer.betas is"),
    # A model path that is there but no model, or not there where nothing will write it.
    ("model.path=/etc", "model.path='/etc' is not a model directory: it has no config.json"),
    ("model.path=./no_model", "model.path='./no_model' does not exist"),
    pytest.param(
        "device=cuda",
        "device=cuda but CUDA is not available on this machine; use device=cpu",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"),
        id="device=cuda without CUDA",
    ),
]


@pytest.mark.parametrize(
    "overrides,message", MISTAKES, ids=[r[1] if len(r) == 2 else r.id for r in MISTAKES]
)
def test_same_mistake_same_message_in_every_recipe(
    overrides, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # output_dir is relative: nothing there to resume
    errors = {}
    for recipe, config in RECIPES.items():
        assert cli.main(["validate", config, *overrides.split()]) == 2, recipe
        err = capsys.readouterr().err
        assert message in err, (recipe, err)
        # The place (file:line or the override) and the output directory are the config's
        # own: compare the rest.
        err = re.sub(r"\S+\.yaml:\d+: ", "", err)
        errors[recipe] = err.replace(config.split("/")[1], "<run>")
    assert len(set(errors.values())) == 1, errors
    assert not any(tmp_path.iterdir())  # refused before any side effect


def test_model_path_rules(tmp_path, monkeypatch):
    """What validation decides from the disk alone, and what it leaves to the check after the
    prepare steps (``loading=True``), which refuses every local path that is no model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "file.txt").write_text("x")
    check_model_path("model")  # a model directory
    check_model_path("Qwen/Qwen2.5-0.5B-Instruct")  # a hub id: not checked
    check_model_path("outputs/sft/final")  # nothing above it yet: an earlier run writes it
    with pytest.raises(ValueError, match="'empty' is not a model directory"):
        check_model_path("empty")
    with pytest.raises(ValueError, match="'file.txt' is a file"):
        check_model_path("file.txt")
    with pytest.raises(ValueError, match=r"'\./modle' does not exist \(did you mean '.*model'"):
        check_model_path("./modle")
    # A prepare step that names the path (or a directory above it) may write it.
    prepare = [{"_component_": "lightrft.tasks.ensure_tiny_model", "out_dir": str(tmp_path)}]
    check_model_path("empty", prepare=prepare)
    check_model_path("./modle", prepare=prepare)
    # After the prepare steps: a user error (one line, exit 2), naming the key.
    for path in ("empty", "./modle", "outputs/sft/final"):
        with pytest.raises(ConfigError, match="critic.path="):
            check_model_path(path, "critic.path", loading=True)
    check_model_path("model", loading=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        text = DOC.read_text()
        if BEGIN in text:
            text = text[: text.index(BEGIN)] + generated() + text[text.index(END) + len(END) :]
        else:
            text = text.rstrip("\n") + "\n\n## The shared sections\n\n" + generated() + "\n"
        DOC.write_text(text)
        print(f"wrote {DOC}")
