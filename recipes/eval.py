"""Evaluate a model on a prompt dataset with any reward / verifier.

    lightrft run eval --config configs/qwen2_5/gsm8k_eval.yaml model.path=outputs/.../final
    lightrft run --nproc_per_node 8 eval --config ...       # data parallel: each rank a share

For each prompt: ``sampling.n`` responses (greedy with temperature 0), scored by ``reward``;
the answers are extracted (``answer_reward``'s ``extract``) for maj@k. Reports pass@k (unbiased,
Chen et al. 2021), maj@k, mean@k, mean reward and response length for each k in ``ks``; writes
``samples.jsonl`` (one prompt per line) and ``summary.json`` to ``output_dir`` and prints a
table. The model is an HF directory or a LightRFT export (``<output_dir>/final``); a DCP training
checkpoint must be exported first. A vision- or audio-language model is loaded with its
processor, which the dataset gets in place of the tokenizer, and each prompt's images / audio go
to the engine with it. The numbers come from :mod:`lightrft.evaluation`, the same
code a training recipe can call.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from lightrft import config
from lightrft.config import Component
from lightrft.distributed import barrier, destroy, init_distributed
from lightrft.engine import NativeEngine, Request, SamplingParams
from lightrft.evaluation import EvalRecord, evaluate_items, summarize
from lightrft.models import checkpoint_is_multimodal, load_processor, load_tokenizer
from lightrft.models.loading import DTYPES
from lightrft.rewards import build_reward
from lightrft.training import check_output_dir

DTYPE = Literal[tuple(DTYPES)]

CONFIG_SCHEMA = {
    "output_dir": str,
    "prepare": list[Component] | None,  # run once on rank 0 before anything loads
    "seed": int | None,
    "device": Literal["cpu", "cuda"] | None,
    "model": {"path": str, "dtype": DTYPE | None, "trust_remote_code": bool | None},
    "dataset": Component,
    "reward": Component,
    "accuracy_reward": str | None,  # the function whose reward > 0 means correct
    "answer_reward": str | None,  # the function whose extract() gives answers for maj@k
    "engine": {
        "backend": Literal["native", "vllm"] | None,
        "max_model_len": int | None,
        "max_num_seqs": int | None,
        "gpu_memory_utilization": float | None,  # vllm only
    },
    "sampling": {
        "n": int | None,
        "temperature": float | None,
        "top_p": float | None,
        "top_k": int | None,
        "max_tokens": int | None,
    },
    "ks": list[int] | None,
    "max_prompts": int | None,
}


@dataclass(frozen=True)
class EvalOptions:
    output_dir: str
    seed: int
    device: str | None
    model_path: str
    dtype: str
    trust_remote_code: bool
    backend: str
    engine_kwargs: dict
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    ks: tuple[int, ...]
    max_prompts: int | None
    accuracy_reward: str | None
    answer_reward: str | None


def _get(node, key, default):
    val = node.get(key) if node is not None else None
    return default if val is None else val


def build_options(cfg: DictConfig) -> EvalOptions:
    """Every default and cross-field check of the eval config (no side effects)."""
    e, s = cfg.get("engine"), cfg.get("sampling")
    backend = _get(e, "backend", "native")
    if backend == "native" and _get(e, "gpu_memory_utilization", None) is not None:
        raise ValueError("engine.gpu_memory_utilization applies to engine.backend=vllm only")
    n = _get(s, "n", 1)
    temperature = float(_get(s, "temperature", 0.0))
    if n < 1:
        raise ValueError(f"sampling.n must be >= 1, got {n}")
    if temperature < 0:
        raise ValueError(f"sampling.temperature must be >= 0, got {temperature}")
    if temperature == 0 and n > 1:
        raise ValueError(
            "sampling.n > 1 with temperature 0 repeats one greedy answer; "
            "set sampling.temperature > 0"
        )
    ks = tuple(_get(cfg, "ks", None) or [k for k in (1, 4, 8, 16, 32, 64) if k <= n])
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"ks: k={bad[0]} is not in [1, sampling.n={n}]")
    max_tokens = _get(s, "max_tokens", 512)
    if max_tokens < 1:
        raise ValueError(f"sampling.max_tokens must be >= 1, got {max_tokens}")
    names = list((cfg.reward.get("functions") or {}).keys())
    for key in ("accuracy_reward", "answer_reward"):
        val = cfg.get(key)
        if val is not None and names and val not in names:
            raise ValueError(f"{key}={val!r} is not a reward function; they are {names}")
    max_prompts = cfg.get("max_prompts")
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
    engine_kwargs = {
        k: e[k]
        for k in ("max_model_len", "max_num_seqs", "gpu_memory_utilization")
        if e is not None and e.get(k) is not None
    }
    return EvalOptions(
        output_dir=cfg.output_dir,
        seed=_get(cfg, "seed", 0),
        device=cfg.get("device"),
        model_path=cfg.model.path,
        dtype=_get(cfg.model, "dtype", "float32"),
        trust_remote_code=_get(cfg.model, "trust_remote_code", False),
        backend=backend,
        engine_kwargs=engine_kwargs,
        n=n,
        temperature=temperature,
        top_p=float(_get(s, "top_p", 1.0)),
        top_k=int(_get(s, "top_k", 0)),
        max_tokens=max_tokens,
        ks=ks,
        max_prompts=max_prompts,
        accuracy_reward=cfg.get("accuracy_reward"),
        answer_reward=cfg.get("answer_reward"),
    )


class EvalRecipe:
    """Generate, score, gather, summarise."""

    def __init__(self, cfg: DictConfig, opts: EvalOptions) -> None:
        self.opts = opts
        if not (Path(opts.model_path) / "config.json").is_file():
            raise ValueError(
                f"model.path={opts.model_path!r} is not an HF model directory (no config.json); "
                "a training checkpoint must be exported first (its <output_dir>/final)"
            )
        self.dist = init_distributed(opts.device)
        self.out = check_output_dir(opts.output_dir)

    def setup(self, cfg: DictConfig) -> None:
        o = self.opts
        if self.dist.is_main:
            for node in cfg.get("prepare") or []:
                config.instantiate(node)
        barrier()
        if checkpoint_is_multimodal(o.model_path):
            processor = load_processor(o.model_path, trust_remote_code=o.trust_remote_code)
            self.tokenizer = processor.tokenizer
        else:
            processor = self.tokenizer = load_tokenizer(
                o.model_path, trust_remote_code=o.trust_remote_code
            )
        self.dataset = config.instantiate(cfg.dataset, processor)
        self.reward_fn = build_reward(cfg.reward)
        names = list(self.reward_fn.functions)
        self.accuracy = o.accuracy_reward or names[0]
        source = self.reward_fn.functions[o.answer_reward or self.accuracy]
        self.extract = getattr(source, "extract", None)
        if o.backend == "vllm":
            from lightrft.engine import VLLMEngine

            self.engine = VLLMEngine(o.model_path, seed=o.seed, dtype=o.dtype, **o.engine_kwargs)
        else:
            self.engine = NativeEngine(
                o.model_path,
                self.tokenizer,
                dtype=o.dtype,
                device=self.dist.device,
                seed=o.seed,
                **o.engine_kwargs,
            )
        self.params = SamplingParams(
            n=o.n,
            temperature=o.temperature,
            top_p=o.top_p,
            top_k=o.top_k,
            max_tokens=o.max_tokens,
            seed=o.seed,
        )

    def run(self) -> dict[str, float]:
        total = len(self.dataset)
        if self.opts.max_prompts is not None:
            total = min(total, self.opts.max_prompts)
        mine = list(range(self.dist.rank, total, self.dist.world_size))
        items = [self.dataset[i] for i in mine]

        def generate(prompt_ids: list[list[int]]) -> list:
            # evaluate_items generates for the items in order: their images / audio go alongside.
            requests = [
                Request.with_media(ids, it.get("images"), it.get("audios"))
                for ids, it in zip(prompt_ids, items, strict=True)
            ]
            return self.engine.generate(requests, self.params)

        records = evaluate_items(
            items,
            mine,
            generate,
            self.reward_fn,
            self.opts.n,
            accuracy=self.accuracy,
            extract=self.extract,
        )
        if dist.is_initialized():
            gathered: list[list[EvalRecord]] = [None] * self.dist.world_size  # type: ignore
            dist.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        records.sort(key=lambda r: r.index)
        summary = summarize(records, self.opts.ks)
        if self.dist.is_main:
            with open(self.out / "samples.jsonl", "w") as f:
                for r in records:
                    f.write(json.dumps(r.to_json(), default=str) + "\n")
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(format_table(summary), flush=True)
        barrier()
        return summary

    def cleanup(self, clean: bool = True) -> None:
        for fn in self.reward_fn.functions.values():
            if callable(getattr(fn, "close", None)):  # e.g. math-verify worker processes
                fn.close()
        destroy(clean)


def format_table(summary: dict[str, float]) -> str:
    """The summary as a two-column text table."""
    width = max(len(k) for k in summary)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    for k, v in summary.items():
        lines.append(
            f"{k:<{width}}  {v:.4f}" if not float(v).is_integer() else f"{k:<{width}}  {int(v)}"
        )
    return "\n".join(lines)


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: EvalOptions) -> None:
    OmegaConf.resolve(cfg)
    recipe = EvalRecipe(cfg, opts)
    recipe.setup(cfg)
    try:
        recipe.run()
    except BaseException:
        recipe.cleanup(clean=False)  # no barrier: a peer may be stuck or gone
        raise
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
