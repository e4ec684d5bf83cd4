"""The final export of a trained model: the full HF directory, or for LoRA the adapter directory
and, with ``lora.export_merged``, the merged model beside it, and the record (:class:`ExportSpec`)
a checkpoint's ``meta.json`` carries so that :mod:`lightrft.export` can write the same export of
any mid-run checkpoint.

The merged weights come from the same merge as weight sync (:func:`lightrft.engine.sync.
iter_weight_buckets`), so the export and the rollout engine see identical tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from lightrft.distributed import is_main
from lightrft.engine.sync import iter_weight_buckets
from lightrft.models.export import export_hf, export_hf_state_dict
from lightrft.models.forward import unwrap_peft
from lightrft.models.lora import export_adapter
from lightrft.sections import STRATEGIES, LoraConfig


def export_merged(model: nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write the base model with the adapters merged in, as a plain HF directory (collective).

    The weights come from the same merge as weight sync (``iter_weight_buckets``), so the
    export and the rollout engine see identical tensors. ``model``: a PEFT model, or a model
    with adapters injected in place that saves itself (a reward model,
    :func:`lightrft.models.lora.apply_backbone_lora`).
    """
    main = is_main()  # every rank drains the buckets (collective); the main one keeps copies
    sd = {name: t.clone() for bucket in iter_weight_buckets(model) if main for name, t in bucket}
    return export_hf_state_dict(unwrap_peft(model), sd, tokenizer, out_dir)


def export_trained(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | Path,
    lora: LoraConfig | None,
    *,
    adapter: bool = True,
) -> Path:
    """A recipe's final export (collective): the full HF model, or for LoRA the adapter
    directory at ``out_dir`` and, with ``lora.export_merged``, the merged model beside it
    at ``<out_dir>_merged``; ``adapter=False``: the merged model alone at ``out_dir`` (what a
    reward model exports)."""
    if lora is not None and not adapter:
        return export_merged(model, tokenizer, out_dir)
    if lora is None:
        return export_hf(model, tokenizer, out_dir)
    out = export_adapter(model, tokenizer, out_dir)
    if lora.export_merged:
        export_merged(model, tokenizer, Path(out_dir).with_name(Path(out_dir).name + "_merged"))
    return out


# ---------------------------------------------------------------------------------------------
# A checkpoint as the run's final export (`lightrft export`), on one process

KINDS = ("causal_lm", "reward_net")


@dataclasses.dataclass(frozen=True)
class ExportSpec:
    """What rebuilds a run's trained model on one process and writes it as the run's ``final/``:
    stored in each checkpoint's ``meta.json`` (``"export"``), written by the recipe.

    ``kind``: ``causal_lm`` (text, vision- or audio-language; SFT, GRPO's actor) or
    ``reward_net`` (:class:`~lightrft.models.reward.RewardNet`, its head(s) and pooling in
    ``reward``: the ``lightrft_reward`` block the export's ``config.json`` carries, with the
    held-out statistics measured last before the checkpoint). ``path``: the base HF directory the
    run loaded (``cwd``: the directory it ran in, for a relative path). ``model``: the name the
    trained model has in the checkpoint. ``adapter``: with ``lora``, write the adapter directory
    (and the merged model beside it with ``lora.export_merged``); ``False``: the merged model
    alone, as a reward model's ``final/`` is.
    """

    kind: str
    path: str
    dtype: str = "float32"
    trust_remote_code: bool = False
    strategy: str = "fsdp2"
    lora: dict[str, Any] | None = None
    adapter: bool = True
    model: str = "model"
    cwd: str = ""
    reward: dict[str, Any] | None = None

    @classmethod
    def of(
        cls,
        kind: str,
        model: Any,
        strategy: Any,
        *,
        name: str = "model",
        adapter: bool = True,
        reward: dict[str, Any] | None = None,
    ) -> ExportSpec:
        """The spec of a recipe's trained model: ``model`` its ``model:`` section (path, dtype,
        trust_remote_code), ``strategy`` its :class:`~lightrft.sections.StrategyConfig`."""
        return cls(
            kind=kind,
            path=str(model.path),
            dtype=str(model.dtype),
            trust_remote_code=bool(model.trust_remote_code),
            strategy=strategy.strategy,
            lora=None if strategy.lora is None else dataclasses.asdict(strategy.lora),
            adapter=adapter,
            model=name,
            cwd=os.getcwd(),
            reward=reward,
        )

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON holds it (tuples as lists), so it equals its own round trip."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, record: Any, where: Path) -> ExportSpec:
        """The spec in ``meta.json``'s ``export`` record; a ``ValueError`` naming ``where`` and
        the key that is missing or unknown."""
        if not isinstance(record, dict):
            raise ValueError(f"{where}: 'export' is not a JSON object")
        fields = [f.name for f in dataclasses.fields(cls)]
        # Every key is required: a default would guess what another version meant.
        missing = [k for k in fields if k not in record]
        if missing:
            raise ValueError(f"{where}: 'export' lacks the key {missing[0]!r}")
        unknown = sorted(set(record) - set(fields))
        if unknown:
            raise ValueError(
                f"{where}: 'export' has the key {unknown[0]!r}, which this version of LightRFT "
                "does not know (a checkpoint of a newer version?)"
            )
        spec = cls(**record)
        for key, known, of in (("kind", KINDS, ""), ("strategy", STRATEGIES, "checkpoints of ")):
            if getattr(spec, key) not in known:
                raise ValueError(
                    f"{where}: 'export.{key}' is {getattr(spec, key)!r}; this version exports "
                    f"{of}{list(known)}"
                )
        if spec.kind == "reward_net" and not isinstance(spec.reward, dict):
            raise ValueError(f"{where}: 'export.reward' is missing for kind 'reward_net'")
        try:
            spec.lora_config()  # before any model loads
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return spec

    def lora_config(self) -> LoraConfig | None:
        if self.lora is None:
            return None
        try:
            lora = LoraConfig(**self.lora)
        except TypeError as e:  # a key another version wrote
            raise ValueError(f"'export.lora' is not a lora section of this version: {e}") from None
        return lora.checked("export.lora.")  # resolved as the run's was: JSON's lists as tuples

    def base_path(self) -> str:
        """The base model directory, resolved against the run's working directory."""
        p = Path(self.path).expanduser()
        return str(p if p.is_absolute() or not self.cwd else Path(self.cwd) / p)
