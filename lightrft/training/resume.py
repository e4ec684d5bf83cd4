"""Resume after the config changed: compare the checkpoint's config with the current one.

Every checkpoint stores the run's resolved config (``config.json``, see
:meth:`~lightrft.training.Checkpointer.save`). On resume each changed key (dotted path) is

* allowed and logged when it only steers the rest of the run (:data:`ALLOWED_CHANGES`: length,
  logging, eval and checkpoint cadence, output paths, engine and memory knobs);
* a learning rate (a key whose last part is ``lr``): applied only with ``resume_override_lr=true``
  (the optimizer and scheduler states would otherwise silently keep the saved one);
* the run's length (``max_steps``; ``epochs`` when no ``max_steps`` is set) while the LR decays
  (``lr_scheduler.min_lr_ratio`` < 1, the default): the warmup + cosine schedule would be
  stretched over the new length and the learning rate would jump at the resume step, so, like a
  learning rate, this needs ``resume_override_lr=true`` (with a constant LR it is allowed);
* refused otherwise (model, optimizer type, algorithm, data, ... ): the saved optimizer and
  algorithm states cannot honour them, so the resume stops before loading anything, listing
  every such key with its saved and current value.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightrft.config import ConfigError

ALLOWED_CHANGES: tuple[str, ...] = (
    "max_steps",
    "epochs",
    "resume",
    "overwrite",
    "resume_override_lr",
    "output_dir",
    "prepare",  # data/model makers: what is read is checked through dataset.* and model.*
    "prepare.*",
    "log_every",
    "save_every",
    "keep_last",
    "trajectories",
    "metrics",
    "metrics.*",
    "eval",
    "eval.*",
    "eval_every",
    "eval_dataset",
    "eval_dataset.*",
    "engine.max_num_seqs",
    "engine.gpu_memory_utilization",
    "engine.max_prefill_tokens",
    "engine.max_kv_tokens",
    "engine.compile",
    "engine.sleep_level",
    "train.micro_batch_size",
    "model.activation_checkpointing",
    "model.compile",
    "offload",  # where FSDP2 keeps the shards; the checkpoint's layout is the same
)
"""Dotted keys (fnmatch patterns) that may change between a checkpoint and its resume."""

RESHARD_KEYS: tuple[str, ...] = ("batch_size", "gradient_accumulation_steps")
"""Per-rank batch keys that may change with the world size: a resume on another world size keeps
the global batch by scaling them (checked against the checkpoint before anything loads)."""


@dataclass(frozen=True)
class ConfigChange:
    """One key that differs between the checkpoint's config and the current one."""

    key: str
    saved: Any
    current: Any
    kind: Literal["allowed", "lr", "schedule", "refused"]

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.current!r}"


_MISSING = "<unset>"


def flatten(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves; ``None`` is dropped
    (null means "use the default" everywhere, so unset and null compare equal)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif v is not None:
            out[key] = v
    return out


def config_changes(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    allowed: Iterable[str] = ALLOWED_CHANGES,
) -> list[ConfigChange]:
    """Every differing dotted key, classified (sorted by key)."""
    a, b = flatten(saved), flatten(current)
    patterns = tuple(allowed)
    # The run's length (max_steps, or epochs when no max_steps is set) is the length of the
    # warmup + cosine LR schedule, which decays unless lr_scheduler.min_lr_ratio (default 0) is 1.
    sched = current.get("lr_scheduler")
    ratio = sched.get("min_lr_ratio") if isinstance(sched, Mapping) else None
    decays = (0.0 if ratio is None else float(ratio)) < 1.0
    lengths = ("max_steps",) if current.get("max_steps") is not None else ("max_steps", "epochs")
    changes = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, _MISSING), b.get(key, _MISSING)
        if old == new:
            continue
        if decays and key in lengths:
            kind = "schedule"
        elif any(fnmatch.fnmatchcase(key, p) for p in patterns):
            kind = "allowed"
        elif key.rsplit(".", 1)[-1] == "lr":
            kind = "lr"
        else:
            kind = "refused"
        changes.append(ConfigChange(key, old, new, kind))
    return changes


def check_resume_config(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    path: Any,
    override_lr: bool = False,
    resharded: bool = False,
) -> list[ConfigChange]:
    """The allowed changes (to log), or a ``ValueError`` listing every change that cannot be
    honoured: refused keys, learning rates without ``override_lr``. ``resharded`` (a resume on
    another world size than the saved one): the per-rank batch keys (:data:`RESHARD_KEYS`) may
    change too."""
    allowed = (*ALLOWED_CHANGES, *RESHARD_KEYS) if resharded else ALLOWED_CHANGES
    changes = config_changes(saved, current, allowed=allowed)
    # What each kind of change that cannot be honoured says (the opt-in ones without the flag).
    why = {
        "refused": "",
        "lr": " (set resume_override_lr=true to apply the new learning rate)",
        "schedule": " (the lr_scheduler would be stretched over the new length and the learning "
        "rate would jump at the resume step; set resume_override_lr=true to accept that)",
    }
    if override_lr:
        why = {"refused": ""}
    lines = [f"  {c}{note}" for kind, note in why.items() for c in changes if c.kind == kind]
    if lines:
        raise ConfigError(
            f"cannot resume from {path}: the config changed in ways the checkpoint cannot "
            "honour:\n" + "\n".join(lines) + "\nRestore those values to resume, or start a new "
            "run (overwrite=true or another output_dir)"
        )
    return changes
