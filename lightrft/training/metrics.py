"""Metric logging (JSONL, TensorBoard, optional W&B), progress bar, timers, throughput, memory.

Only rank 0 writes; every helper here is a no-op or cheap on other ranks, so recipes call them
unconditionally. :func:`reduce_metrics` is the one collective: call it on every rank.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lightrft.distributed import is_main

GIB = 2**30


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        return float(value.detach().float().cpu().item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"metric {name!r} must be a number, got {type(value).__name__}: {value!r}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Logger


class MetricLogger(AbstractContextManager):  # __enter__ returns the logger
    """Fan scalar metrics out to ``metrics.jsonl``, TensorBoard and (optionally) W&B, on rank 0.

    Args:
        output_dir: the run's output directory; ``metrics.jsonl`` and ``tensorboard/`` go there.
        tensorboard: write TensorBoard event files under ``output_dir/tensorboard``.
        wandb: ``False`` (default), ``True`` or a dict of ``wandb.init`` keyword arguments
            (``project``, ``name``, ``mode``, ...). When enabled, ``wandb`` must be importable
            (``pip install 'lightrft[wandb]'``); it is never needed otherwise.
        config: the run's config (a plain dict), recorded by W&B and as TensorBoard text.
        resume_step: the step a resumed run restarts from: rows logged after it by the
            interrupted run are dropped from ``metrics.jsonl`` and TensorBoard (``purge_step``),
            so the files hold one clean curve. ``None``: append to whatever is there.
        enabled: write at all; default: this process is rank 0.

    ``metrics.jsonl`` gets one JSON object per :meth:`log` call, ``{"step": k, "train/loss": ...}``,
    flushed at once, so a crash loses nothing already logged.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb: bool | Mapping[str, Any] = False,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        enabled: bool | None = None,
    ):
        self.enabled = is_main() if enabled is None else enabled
        self.output_dir = Path(output_dir)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self._jsonl = self._tb = self._wandb = None
        if not self.enabled:
            return
        wandb_mod = None
        if wandb is True or isinstance(wandb, Mapping):
            try:
                import wandb as wandb_mod
            except ImportError:
                raise ValueError(
                    "wandb logging is enabled (metrics wandb setting) but the "
                    "`wandb` package is not installed: pip install "
                    "'lightrft[wandb]', or disable wandb"
                ) from None
        elif wandb is not None and wandb is not False:
            raise ValueError(
                f"wandb must be a bool or a dict of wandb.init arguments, got {wandb!r}"
            )
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _truncate_jsonl(self.jsonl_path, resume_step)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=purge)
            if config:
                self._tb.add_text(
                    "config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```"
                )
        if wandb_mod is not None:
            wandb_kwargs = {} if wandb is True else dict(wandb)
            wandb_kwargs.setdefault("dir", str(self.output_dir))
            if config is not None:
                wandb_kwargs.setdefault("config", dict(config))
            self._wandb = wandb_mod.init(**wandb_kwargs)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Record ``metrics`` (name -> number or 1-element tensor) at ``step``; returns them as
        floats. Tensors are converted on every rank (the conversion may sync a GPU)."""
        values = {k: _to_float(k, v) for k, v in metrics.items()}
        if self._jsonl is not None:
            # NaN / inf are written as NaN / Infinity, which Python's json and pandas read back.
            row = {"step": int(step), **values}
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        return values

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        for sink in (self._jsonl, self._tb):
            if sink is not None:
                sink.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._tb = self._wandb = None

    def __exit__(self, *exc: object) -> None:
        self.close()


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only rows with ``step <= last_step`` (and drop a line torn by a crash)."""
    if not path.is_file():
        return
    kept = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            step = row.get("step", 0)
            odd = not isinstance(step, int) or isinstance(step, bool)
            if odd:
                print(
                    f"resume: warning: {path}:{lineno}: step {step!r} is not an integer; "
                    "the row is kept as it is",
                    flush=True,
                )
            if odd or step <= last_step:
                kept.append(json.dumps(row) + "\n")
    from lightrft.training.safe_state import write_atomic  # (imports DCP: only when resuming)

    write_atomic(path, "".join(kept).encode("utf-8"))


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (or of ``<dir>/metrics.jsonl``), in order."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    with open(p, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# Progress bar


class ProgressBar(tqdm):
    """A tqdm bar on rank 0 (nothing elsewhere) showing loss and tokens/s after each step."""

    def __init__(
        self,
        total: int | None,
        *,
        initial: int = 0,
        desc: str = "train",
        enabled: bool | None = None,
    ):
        super().__init__(
            total=total,
            initial=initial,
            desc=desc,
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not (is_main() if enabled is None else enabled),  # tqdm's own no-op bar
        )

    def update(self, n: int = 1, **postfix: float) -> None:
        """Advance ``n`` steps and show ``postfix`` (e.g. ``loss=0.42, tok_s=1234``)."""
        self.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
        super().update(n)


# ---------------------------------------------------------------------------------------------
# Timers and throughput


class PhaseTimer:
    """Accumulate wall-clock seconds per named phase: ``with timer("rollout"): ...``.

    ``cuda_sync=True`` synchronises the current CUDA device at both ends so a phase is charged for
    the GPU work it launched (costs a sync; off by default).
    """

    def __init__(self, *, cuda_sync: bool = False):
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.cuda_sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda_sync:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start
            self.counts[name] += 1

    def summary(self) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` accumulated since the last reset, then reset."""
        out = {f"time/{k}": v for k, v in self.totals.items()}
        self.reset()
        return out

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()


class Throughput:
    """Tokens per second between successive :meth:`rate` calls (e.g. once per logged step)."""

    def __init__(self) -> None:
        self._tokens = 0.0
        self._start = time.perf_counter()

    def add(self, tokens: int | float | torch.Tensor) -> None:
        self._tokens += float(tokens)

    def rate(self) -> tuple[float, float]:
        """``(tokens, seconds)`` since the last call; see :func:`tokens_per_second`."""
        now = time.perf_counter()
        out = (self._tokens, now - self._start)
        self._tokens, self._start = 0.0, now
        return out


def tokens_per_second(tokens: float, seconds: float) -> float:
    """``tokens / seconds``, 0 when no time passed."""
    return tokens / seconds if seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Memory


def peak_memory(device: torch.device | str | None = None) -> dict[str, float]:
    """Peak memory in GiB: CUDA ``max_memory_allocated`` / ``max_memory_reserved`` on a GPU device,
    else this process's peak resident set size (``getrusage``; it never goes down)."""
    if device is not None and torch.device(device).type == "cuda":
        return {
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    return {"memory/peak_rss_gib": rss_bytes / GIB}


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start a new CUDA peak window (the CPU RSS peak cannot be reset)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------------
# Cross-rank reduction

_REDUCE_OPS = ("mean", "sum", "max", "min")


def collective_device() -> torch.device | None:
    """Where a small reduction runs: the current CUDA device under nccl, else None (CPU; also
    in one process, whose reductions are the identity)."""
    nccl = dist.is_initialized() and "nccl" in dist.get_backend()  # "nccl" or "cpu:gloo,cuda:nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else None


def reduce_metrics(metrics: Mapping[str, Any], op: str = "mean") -> dict[str, float]:
    """All-reduce scalar metrics across ranks in one collective; identity in a single process.

    ``op``: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``. Every rank must pass the same keys
    (they are sorted, so order does not matter). The reduction runs on
    :func:`collective_device`.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {_REDUCE_OPS}, got {op!r}")
    keys = sorted(metrics)
    values = [_to_float(k, metrics[k]) for k in keys]
    if not dist.is_initialized() or not keys:
        return dict(zip(keys, values, strict=True))
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())  # [num_metrics]
    dist.all_reduce(t, op=getattr(dist.ReduceOp, "SUM" if op == "mean" else op.upper()))
    if op == "mean":
        t /= dist.get_world_size()
    return dict(zip(keys, t.tolist(), strict=True))


class MetricAccumulator:
    """Scalar metrics over many micro-batches and all ranks, each with a declared reduction.

    ``reductions`` maps a name to ``"mean"`` (weighted mean: ``add`` passes the weight, e.g.
    the micro-batch's token count), ``"sum"``, ``"min"`` or ``"max"``; names not listed use
    ``"mean"``. ``empty`` maps a name to the value reported when nothing with a positive weight
    was added on any rank (default 0.0): the one place that decides what a metric reads when
    ranks ran only padding micro-batches. Every rank must ``add`` the same names (a rank without
    data adds with weight 0) and call :meth:`reduce` (a collective).
    """

    def __init__(
        self,
        reductions: Mapping[str, str] | None = None,
        *,
        empty: Mapping[str, float] | None = None,
    ):
        self.reductions = dict(reductions or {})
        for name, op in self.reductions.items():
            if op not in _REDUCE_OPS:
                raise ValueError(f"reduction of {name} must be one of {_REDUCE_OPS}, got {op!r}")
        self.empty = dict(empty or {})
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._extremes: dict[str, float] = {}

    def op(self, name: str) -> str:
        return self.reductions.get(name, "mean")

    def add(self, name: str, value: Any, weight: float = 1.0) -> None:
        """Record ``value`` (a number or 0-d tensor); ``weight`` <= 0 records only the name."""
        op, v = self.op(name), _to_float(name, value)
        if op in ("mean", "sum"):
            w = weight if op == "mean" else 1.0
            self._sums[name] = self._sums.get(name, 0.0) + v * w
            self._weights[name] = self._weights.get(name, 0.0) + weight
        else:  # a weight <= 0 leaves the extreme at its fill (+inf for min, -inf for max)
            pick, fill = (min, math.inf) if op == "min" else (max, -math.inf)
            self._extremes[name] = pick(self._extremes.get(name, fill), v if weight > 0 else fill)

    def reduce(self) -> dict[str, float]:
        """Reduce over ranks (three collectives) and reset: name -> value."""
        sums = reduce_metrics(
            {
                **{f"s/{k}": v for k, v in self._sums.items()},
                **{f"w/{k}": v for k, v in self._weights.items()},
            },
            "sum",
        )
        out: dict[str, float] = {}
        for k in self._sums:
            if self.op(k) == "sum":
                out[k] = sums[f"s/{k}"]
            elif sums[f"w/{k}"] > 0:
                out[k] = sums[f"s/{k}"] / max(sums[f"w/{k}"], 1e-12)
            else:
                out[k] = self.empty.get(k, 0.0)
        for op in ("min", "max"):
            mine = {k: v for k, v in self._extremes.items() if self.op(k) == op}
            for k, v in reduce_metrics(mine, op).items():
                out[k] = v if math.isfinite(v) else self.empty.get(k, 0.0)
        self._sums, self._weights, self._extremes = {}, {}, {}
        return out
