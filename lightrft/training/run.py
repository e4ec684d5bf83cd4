"""The run contract: what every training recipe's run does, obtained by one call.

    @config.parse(schema=MyConfig.schema(), options=MyConfig.read)
    def recipe_main(cfg, opts):
        with training_run(cfg, opts.run) as run:      # the whole contract
            recipe = MyRecipe(cfg, opts, run)
            recipe.setup(cfg)                          # run.resume(...), run.open_logger(...)
            recipe.train()                             # for step in run.steps(...): ...

:class:`TrainingRunConfig` holds the keys (``output_dir``, ``seed``, ``device``, ``prepare``,
``log_every``, ``metrics``, ``save_every``, ``keep_last``, ``resume``, ``overwrite``,
``resume_override_lr``) and refuses a resume that contradicts ``overwrite``; :class:`TrainingConfig`
refuses, before anything loads, a resume without a checkpoint or from one it cannot continue
(:func:`~lightrft.training.checkpoint.check_resume`). :func:`training_run` then, in this order:

1. claims ``output_dir`` (a lock held for the run; a fresh run into a used directory is refused
   unless ``overwrite=true``, which clears it; ``resume=true`` continues it);
2. joins the process group (torchrun) or stays one process;
3. seeds torch, then runs the ``prepare`` components on rank 0 while the others wait;
4. :meth:`TrainingRun.resume` restores the newest checkpoint (``resume=true``), after comparing
   the saved config with this one (allowed changes are printed; a changed learning rate needs
   ``resume_override_lr=true``) and prints ``resumed from step N``;
5. :meth:`TrainingRun.open_logger` opens ``metrics.jsonl`` / TensorBoard / W&B (a resumed run
   drops the rows the interrupted run logged after its checkpoint);
6. :meth:`TrainingRun.steps` yields the step numbers under SIGTERM / SIGINT handling: after each
   step it saves when ``save_every`` says so, and on a signal it saves (if that step was not
   saved already) and exits with 128 + the signal number;
7. :meth:`TrainingRun.save` writes a checkpoint with the run's config beside it;
8. on leaving, closes the logger and the process group (the ranks meet at a barrier first after a
   clean run only: after an error a peer may be gone).

tests/recipes/test_run_contract.py runs every training recipe through each item with real
processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig, OmegaConf

from lightrft import config
from lightrft.config import Section, option, section
from lightrft.distributed import DistInfo, barrier, destroy, init_distributed
from lightrft.sections import BatchConfig, MetricsConfig, OptimConfig, RunConfig, StrategyConfig
from lightrft.training.checkpoint import (
    Checkpointer,
    CheckpointState,
    check_resume,
)
from lightrft.training.metrics import MetricLogger
from lightrft.training.outputs import check_output_dir, check_resume_overwrite
from lightrft.training.preemption import Preemption


@section
class TrainingRunConfig(RunConfig):
    """The keys of a training run's bookkeeping (top level): logging, checkpoints, resume."""

    log_every: int = option(1, ge=1, doc="log metrics every this many steps (and the last)")
    metrics: MetricsConfig = option(default_factory=MetricsConfig, doc="")
    save_every: int | None = option(None, ge=1, doc="checkpoint every this many steps")
    keep_last: int = option(2, ge=1, doc="complete checkpoints kept (older ones are deleted)")
    resume: bool = option(False, doc="continue from the newest checkpoint in output_dir")
    overwrite: bool = option(False, doc="a fresh run may delete an earlier run's outputs")
    resume_override_lr: bool = option(
        False, doc="on resume, take the config's learning rate instead of refusing the change"
    )

    def resolve(self, at: str) -> TrainingRunConfig:
        super().resolve(at)
        check_resume_overwrite(self.resume, self.overwrite)
        return self


@section
class TrainingConfig(Section):
    """The base of a training recipe's config: the run, strategy and optimizer sections (all
    top-level keys) and the rules across them. A recipe subclasses it with its own sections
    (``model``, data, algorithm...) and calls ``super().resolve(at)`` from its ``resolve``."""

    run: TrainingRunConfig = option(flat=True)
    strategy: StrategyConfig = option(flat=True)
    optim: OptimConfig = option(flat=True)
    # The names the recipe's checkpoints give their trained models (LoRA resume check).
    CHECKPOINT_MODELS: ClassVar[tuple[str, ...]] = ("model",)

    def resolve(self, at: str) -> TrainingConfig:
        # A resume needs a checkpoint; a LoRA run resumes only from LoRA checkpoints, and the
        # reverse; on another world size
        # only what reshards. The world the run has: torchrun sets WORLD_SIZE (`lightrft run`
        # sets it for its check before launching), else one plain process.
        if self.run.resume:
            lora, world = self.strategy.lora is not None, int(os.environ.get("WORLD_SIZE") or 1)
            check_resume(
                self.run.output_dir, lora, self.CHECKPOINT_MODELS, world, self.global_batch
            )
        return self

    def global_batch(self, world: int) -> int | None:
        """Items the training loader reads per step over ``world`` ranks (what a resume on
        another world size must keep): a supervised recipe's :class:`BatchConfig` ``data``'s;
        ``None``: checked only when the loader loads."""
        data = getattr(self, "data", None)
        return data.global_batch(world) if isinstance(data, BatchConfig) else None


class TrainingRun:
    """One training run's contract (see the module docstring); made by :func:`training_run`."""

    def __init__(self, cfg: DictConfig, opts: RunConfig):
        # A recipe that does not train (eval) gets the directory, process group, seed and
        # prepare steps; its outputs are no training run's (no fresh-run rule, no checkpoints).
        training = isinstance(opts, TrainingRunConfig)
        self.opts = opts
        self.config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)
        self.output_dir: Path = check_output_dir(
            opts.output_dir,
            resume=opts.resume if training else None,
            overwrite=opts.overwrite if training else False,
        )
        self.dist: DistInfo = init_distributed(opts.device, opts.collective_timeout_s)
        self.checkpointer = (
            Checkpointer(opts.output_dir, keep_last=opts.keep_last, every_n_steps=opts.save_every)
            if training
            else None
        )
        self.logger: MetricLogger | None = None
        self.resumed = False
        torch.manual_seed(opts.seed)
        if self.dist.is_main:
            for node in opts.prepare or ():
                config.instantiate(node)
        barrier()

    def resume(self, **state: Any) -> CheckpointState | None:
        """With ``resume=true``: restore ``state`` (``models``, ``optimizers``, ``schedulers``,
        ``dataloaders`` as :meth:`Checkpointer.load_latest` takes them) from the newest
        checkpoint after checking the config against the saved one; else None."""
        if not getattr(self.opts, "resume", False):
            return None
        self.resumed = True
        return self.checkpointer.load_latest(
            **state,
            required=True,
            config=self.config,
            override_lr=self.opts.resume_override_lr,
            seed=self.opts.seed,
        )

    def open_logger(self, step: int, data_stats: Mapping[str, float] | None = None) -> MetricLogger:
        """The run's metric logger, from ``step``; a fresh run logs the data set's statistics
        (``data/*``) at that step."""
        m = self.opts.metrics
        self.logger = MetricLogger(
            self.output_dir,
            tensorboard=m.tensorboard,
            wandb=m.wandb,
            config=self.config,
            resume_step=step if self.resumed else None,
        )
        if data_stats and not self.resumed:
            self.logger.log(step, {f"data/{k}": v for k, v in data_stats.items()})
        return self.logger

    def should_log(self, step: int, last: int) -> bool:
        return step % self.opts.log_every == 0 or step == last

    def steps(self, start: int, stop: int, save: Callable[[], None]) -> Iterator[int]:
        """Steps ``start + 1 .. stop``. After the caller's body for a step: ``save()`` when the
        step is due (``save_every``); on SIGTERM / SIGINT (any rank), ``save()`` unless just
        done, then exit with 128 + the signal."""
        with Preemption() as preempt:
            for step in range(start + 1, stop + 1):
                yield step
                saved = self.checkpointer.should_save(step)
                if saved:
                    save()
                if preempt.stop_requested():  # collective: every rank stops after this step
                    if not saved:
                        save()
                    preempt.exit(self.checkpointer.latest())

    def save(self, step: int, **state: Any) -> Path:
        """A checkpoint of ``state`` (:meth:`Checkpointer.save`'s keywords, ``extra`` included)
        at ``step``, with the run's config beside it; ``export``
        (:meth:`lightrft.training.export.ExportSpec.to_json`) lets ``lightrft export`` turn it
        into the directory the run's ``final/`` would be."""
        return self.checkpointer.save(step, **state, config=self.config)

    def close(self, clean: bool) -> None:
        if self.logger is not None:
            self.logger.close()
        destroy(clean)


@contextmanager
def training_run(cfg: DictConfig, opts: RunConfig) -> Iterator[TrainingRun]:
    """Start a run under the contract; tear it down on leaving (see the module docstring)."""
    run = TrainingRun(cfg, opts)
    try:
        yield run
    except BaseException:
        run.close(clean=False)  # no barrier: a peer may be stuck or gone
        raise
    run.close(clean=True)
