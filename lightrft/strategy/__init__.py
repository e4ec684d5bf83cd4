"""Training strategies: one object owns how the trained model is wrapped, stepped,
checkpointed, synced into the rollout engine and exported, so a recipe never branches on it.

    strategy = build_strategy(opts.strategy, run.dist)          # the `strategy:` section
    model = strategy.load_policy(opts.model)                    # + load_beside(): a reference
    optimizer = strategy.setup(model, opts.optim, micro_batch_size=..., accum=...)
    strategy.backward(loss); grad_norm = strategy.step()        # per micro-batch / per step
    run.save(step, **strategy.checkpoint_state(), schedulers=..., dataloaders=...)
    strategy.sync_weights(engine)                               # the engine gets the weights
    with strategy.reference():  ...                             # LoRA: the frozen base
    strategy.export(processor, out_dir)                         # <output_dir>/final

- :class:`~lightrft.strategy.base.Strategy` (default): FSDP2 over a 1-D mesh, or HSDP
  (``shard_size`` / ``replicate_size``), optionally with LoRA adapters (``lora:``, the rules in
  :mod:`lightrft.models.lora`).
- :class:`~lightrft.strategy.deepspeed.DeepSpeedStrategy`: DeepSpeed ZeRO-1/2/3 (± offload),
  imported only when chosen.

Frozen models beside the trained one (a reference policy, a critic) are always FSDP2-sharded
(:meth:`Strategy.load_beside`). Adding a strategy is one new module with a subclass of
:class:`Strategy` (overriding what it does otherwise) and a line in :func:`build_strategy`.
"""

from __future__ import annotations

from lightrft.distributed import DistInfo
from lightrft.sections import StrategyConfig
from lightrft.strategy.base import Strategy


def build_strategy(cfg: StrategyConfig, dist: DistInfo) -> Strategy:
    """The strategy the config's ``strategy`` key names (checked by :class:`StrategyConfig`)."""
    if cfg.strategy == "deepspeed":
        from lightrft.strategy.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(cfg, dist)
    return Strategy(cfg, dist)


__all__ = ["Strategy", "build_strategy"]
