"""Evaluate a model on a prompt dataset with any reward / verifier.

    lightrft run eval --config configs/qwen2_5/gsm8k_eval.yaml model.path=outputs/.../final
    lightrft run --nproc_per_node 8 eval --config ...       # data parallel: each rank a share

For each prompt: ``sampling.n`` responses (greedy with temperature 0), scored by ``reward``;
the answers are extracted (``answer_reward``'s ``extract``) for maj@k. Reports pass@k (unbiased,
Chen et al. 2021), maj@k, mean@k, mean reward and response length for each k in ``ks``; writes
``samples.jsonl`` (one prompt per line) and ``summary.json`` to ``output_dir`` and prints a
table. With an ``environment:`` section (GRPO's) each response is a multi-turn episode played
through the same ``Episodes`` as GRPO's rollout: its final answer is scored and voted on, the
summary adds the ``env/*`` metrics and each line of ``samples.jsonl`` every turn of every
episode. The model is an HF directory, a LightRFT export (``<output_dir>/final``) or a training
checkpoint (``<output_dir>/checkpoints/step_N``), which is exported first as ``lightrft export``
exports it, into a cache reused while the checkpoint is unchanged. A vision- or audio-language
model is loaded with its processor, which the dataset gets in place of the tokenizer, and each
prompt's images / audio go to the engine with it. The numbers come from :mod:`lightrft.evaluation`, the same
code a training recipe can call.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from omegaconf import DictConfig, OmegaConf

from lightrft import config
from lightrft.config import Component, Section, option, section
from lightrft.distributed import barrier
from lightrft.engine import Continuation, Request, SamplingParams
from lightrft.engine.config import EngineConfig
from lightrft.environments import check_environment
from lightrft.evaluation import evaluate_dataset, summarize
from lightrft.export import read_export_spec, resolve_model_dir
from lightrft.models.multimodal import load_processors
from lightrft.rewards import build_reward, reward_names
from lightrft.rollout.source import turns_for
from lightrft.sections import ModelConfig, RunConfig, check_model_path, is_checkpoint_dir
from lightrft.training.run import TrainingRun, training_run


@section
class SamplingConfig(Section):
    """``sampling:``: how many answers per prompt and how they are drawn."""

    n: int = option(1, ge=1, doc="answers per prompt")
    temperature: float = option(0.0, ge=0, doc="0: greedy")
    top_p: float = option(1.0, doc="nucleus sampling")
    top_k: int = option(0, doc="0: off")
    max_tokens: int = option(512, ge=1, doc="answer length limit")

    def resolve(self, at: str) -> SamplingConfig:
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                "sampling.n > 1 with temperature 0 repeats one greedy answer; "
                "set sampling.temperature > 0"
            )
        return self


@section
class EvalConfig(Section):
    """The whole config: the run and model sections (library) and the evaluation's own."""

    run: RunConfig = option(flat=True)
    model: ModelConfig = option(doc="an HF directory or a LightRFT export")
    dataset: Component = option(doc="prompts, with reference answers for the verifier")
    reward: Component = option(doc="the reward / verifier that scores each answer")
    accuracy_reward: str | None = option(None, doc="the function whose reward > 0 is correct")
    answer_reward: str | None = option(None, doc="the function whose extract() gives answers")
    engine: EngineConfig = option(default_factory=EngineConfig, doc="")
    sampling: SamplingConfig = option(default_factory=SamplingConfig, doc="")
    ks: list[int] | None = option(None, doc="the k of pass@k / maj@k; default powers up to n")
    max_prompts: int | None = option(None, ge=1, doc="evaluate the first this many prompts")
    environment: Component | None = option(
        None, doc="multi-turn: builds one Environment per sample (ToolEnvironment + tools)"
    )

    def resolve(self, at: str) -> EvalConfig:
        self.engine.check_device(self.run.device)
        n = self.sampling.n
        ks = self.ks or tuple(k for k in (1, 4, 8, 16, 32, 64) if k <= n)
        bad = [k for k in ks if not 1 <= k <= n]
        if bad:
            raise ValueError(f"ks: k={bad[0]} is not in [1, sampling.n={n}]")
        names = reward_names(self.reward)
        for key in ("accuracy_reward", "answer_reward"):
            val = getattr(self, key)
            if val is not None and names and val not in names:
                raise ValueError(f"{key}={val!r} is not a reward function; they are {names}")
        check_model_path(self.model.path, prepare=self.run.prepare, checkpoint=True)
        if is_checkpoint_dir(self.model.path):  # its model files are checked once it is exported
            try:  # what the export needs is there
                read_export_spec(self.model.path)
            except ValueError as e:
                raise ValueError(f"model.path: {e}") from None
        else:
            check_environment(
                self.environment, self.model.path, trust_remote_code=self.model.trust_remote_code
            )
        return dataclasses.replace(self, ks=tuple(ks))


# What `lightrft validate` and `run` check before anything loads (lightrft.config.parse).
CONFIG_SCHEMA = EvalConfig.schema()
build_options = EvalConfig.read


class EvalRecipe:
    """Generate, score, gather, summarise."""

    def __init__(self, cfg: DictConfig, opts: EvalConfig, run: TrainingRun) -> None:
        self.opts, self.dist, self.out = opts, run.dist, run.output_dir

    def setup(self, cfg: DictConfig) -> None:
        o, e = self.opts, self.opts.engine
        check_model_path(o.model.path, loading=True, checkpoint=True)  # whatever prepare wrote
        # A training checkpoint is exported (once, cached) into the directory final/ would be.
        m = dataclasses.replace(
            o.model,
            path=resolve_model_dir(o.model.path, trust_remote_code=o.model.trust_remote_code),
        )
        # The environment: section's episodes (None: single turn), checked again: a checkpoint
        # prepare wrote exists now.
        self.turns = turns_for(o.environment, m)
        processor, self.tokenizer = load_processors(
            m.path, trust_remote_code=m.trust_remote_code, template_args=m.chat_template_args
        )
        self.dataset = config.instantiate(o.dataset, processor)
        self.reward_fn = build_reward(o.reward)
        self.accuracy = o.accuracy_reward or next(iter(self.reward_fn.functions))  # the first
        source = self.reward_fn.functions[o.answer_reward or self.accuracy]
        self.extract = getattr(source, "extract", None)
        self.engine = e.build(
            m.path, self.tokenizer, device=self.dist.device, seed=o.run.seed, dtype=m.dtype
        )
        params = SamplingParams(**dataclasses.asdict(o.sampling), seed=o.run.seed)  # same names
        self.params = self.turns.sampling(params, self.tokenizer)  # multi-turn: stop at turn end

    def run(self) -> dict[str, float]:
        def generate(
            prompt_ids: list[list[int]], items: list, continuation: Continuation | None
        ) -> list:
            requests = [
                Request(ids, it.get("media")) for ids, it in zip(prompt_ids, items, strict=True)
            ]
            return self.engine.generate(requests, self.params, continuation=continuation)

        records = evaluate_dataset(
            self.dataset,
            generate,
            self.reward_fn,
            self.opts.sampling.n,
            self.dist,
            limit=self.opts.max_prompts,
            accuracy=self.accuracy,
            extract=self.extract,
            environment=self.turns.environment,
            tokenizer=self.tokenizer,
        )
        summary = summarize(records, list(self.opts.ks))
        if self.dist.is_main:
            rows = "".join(json.dumps(r.to_json(), default=str) + "\n" for r in records)
            (self.out / "samples.jsonl").write_text(rows)
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(format_table(summary), flush=True)
        barrier()
        return summary

    def cleanup(self) -> None:
        for fn in self.reward_fn.functions.values():
            if callable(getattr(fn, "close", None)):  # e.g. math-verify worker processes
                fn.close()


def format_table(summary: dict[str, float]) -> str:
    """The summary as a two-column text table."""
    width = max(len(k) for k in summary)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    for k, v in summary.items():
        lines.append(f"{k:<{width}}  {int(v) if float(v).is_integer() else f'{v:.4f}'}")
    return "\n".join(lines)


@config.parse(schema=CONFIG_SCHEMA, options=build_options)
def recipe_main(cfg: DictConfig, opts: EvalConfig) -> None:
    OmegaConf.resolve(cfg)
    with training_run(cfg, opts.run) as run:
        recipe = EvalRecipe(cfg, opts, run)
        recipe.setup(cfg)
        try:
            recipe.run()
        finally:
            recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
