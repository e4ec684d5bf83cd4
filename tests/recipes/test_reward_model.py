"""The reward-model recipe through the real CLI, in-process: learning, export, resume, 2 ranks."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _dist import build_recipe, run_distributed
from _serial import each

from lightrft import cli
from lightrft.rewards import Sample
from lightrft.training import read_metrics

WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "quiet", "lamp", "north", "tiger"]


def _pairs(n: int, seed: int, heads: list[str] | None = None) -> list[dict]:
    """Separable pairs: the chosen answer ends in 'yes', the rejected one in 'no'."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(WORDS, 2)
        rec = {"prompt": f"{a} {b}?", "chosen": f"{b} {a} yes", "rejected": f"{b} {a} no"}
        if heads:
            rec["head"] = heads[i % len(heads)]
            rec["chosen_safe"], rec["rejected_safe"] = True, False
        out.append(rec)
    return out


def _config(tmp: Path, heads: list[str] | None = None, **overrides) -> Path:
    data = tmp / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 96, 0), ("test", 32, 1)):
        (data / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in _pairs(n, seed, heads))
        )
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "prepare": [
            {
                "_component_": "lightrft.tasks.ensure_tiny_model",
                "out_dir": str(tmp / "model"),
                "layers": 2,
                "hidden": 32,
                "heads": 2,
                "kv_heads": 1,
                "max_positions": 128,
            }
        ],
        "model": {"path": str(tmp / "model")},
        "dataset": {
            "_component_": "lightrft.data.PreferenceDataset",
            "path": str(data / "train.jsonl"),
            "max_length": 64,
        },
        "eval_dataset": {
            "_component_": "lightrft.data.PreferenceDataset",
            "path": str(data / "test.jsonl"),
        },
        "batch_size": 8,
        "gradient_accumulation_steps": 2,
        "epochs": 1,
        "max_steps": 6,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 1},
        "clip_grad_norm": 1.0,
        "log_every": 1,
        "eval_every": 3,
        "metrics": {"tensorboard": True},
    }
    if heads:
        cfg["model"]["heads"] = heads
    cfg.update(overrides)
    path = tmp / "rm.yaml"
    path.write_text("# lightrft run reward_model --config rm.yaml\n" + yaml.safe_dump(cfg))
    return path


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(out) if "train/loss" in r}


def test_learns_evaluates_and_exports_what_reward_model_and_transformers_load(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from lightrft.models.reward import build_reward_net
    from lightrft.rewards import RewardModel
    from lightrft.training import Checkpointer

    cfg = _config(tmp_path, save_every=6)
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    records = read_metrics(out)
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert evals[-1]["eval/accuracy/reward"] >= 0.9 > evals[0]["eval/accuracy/reward"]
    assert evals[-1]["eval/margin/reward"] > evals[0]["eval/margin/reward"]
    last = [r for r in records if "train/loss" in r][-1]
    for key in ("train/grad_norm", "train/lr", "train/sequences_per_s", "memory/peak_rss_gib"):
        assert key in last
    assert any(r.get("data/pairs") == 96 for r in records)
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))

    final = out / "final"
    meta = json.loads((final / "config.json").read_text())["lightrft_reward"]
    assert meta["heads"] == ["reward"] and meta["pooling"] == "last"
    stats = meta["stats"]["reward"]
    assert stats["mean"] == pytest.approx(evals[-1]["eval/reward_mean/reward"])
    assert stats["std"] == pytest.approx(evals[-1]["eval/reward_std/reward"])

    # The trained model (the step-6 checkpoint) and the export score the same.
    torch.manual_seed(0)
    trained = build_reward_net(tmp_path / "model").eval()
    Checkpointer(out).load_latest(models=trained, required=True)
    rm = RewardModel(str(final), micro_batch_size=1)
    prompts = ["apple river?", "stone lamp?", "north tiger?"]
    responses = ["river apple yes", "lamp stone no", "tiger north yes"]
    scores = rm(Sample.batch(prompts, responses))
    seqs = rm.encode(prompts, responses)[0]
    with torch.no_grad():
        want = torch.stack(
            [
                trained(
                    torch.tensor([s]),
                    torch.arange(len(s))[None],
                    torch.zeros(1, len(s), dtype=torch.long),
                    num_sequences=1,
                )[0, 0]
                for s in seqs
            ]
        )
    assert torch.allclose(scores, want, atol=1e-6), (scores, want)
    assert scores[0] > scores[1] and scores[2] > scores[1]
    # Normalised with the held-out statistics written into the export.
    norm = RewardModel(str(final), micro_batch_size=1, normalize=True)(
        Sample.batch(prompts, responses)
    )
    assert torch.allclose(norm, (scores - stats["mean"]) / stats["std"], atol=1e-5)
    # transformers loads the one-head export as its classifier and agrees (no padding involved).
    hf = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.stack([hf(torch.tensor([s])).logits[0, 0] for s in seqs])
    assert torch.allclose(logits, scores, atol=1e-5)


def test_likelihood_pooling_learns_and_exports_a_causal_lm_that_scores_the_same(tmp_path):
    """pooling=likelihood on plain text: the LM head scores the response (and the EOS after
    it); the export is a causal LM directory that RewardModel and transformers read the same."""
    from transformers import AutoModelForCausalLM

    from lightrft.models.reward import build_reward_net
    from lightrft.rewards import RewardModel
    from lightrft.training import Checkpointer

    plain = {"apply_chat_template": False}
    cfg = _config(tmp_path, save_every=6)
    raw = yaml.safe_load(cfg.read_text())
    raw["model"]["pooling"] = "likelihood"
    raw["loss"] = {"nll_coef": 0.5}
    raw["dataset"].update(plain)
    raw["eval_dataset"].update(plain)
    cfg.write_text(yaml.safe_dump(raw))
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    out = tmp_path / "out"
    evals = [r for r in read_metrics(out) if "eval/accuracy" in r]
    # The untrained LM already ranks "yes" over "no" here (same tail in every pair): learning
    # shows in the margin.
    assert evals[-1]["eval/accuracy"] == 1.0
    assert evals[-1]["eval/margin/reward"] > 2 * evals[0]["eval/margin/reward"] > 0, evals
    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    meta = config["lightrft_reward"]
    assert meta["pooling"] == "likelihood" and meta["end_token_id"] == config["eos_token_id"]

    torch.manual_seed(0)
    trained = build_reward_net(
        tmp_path / "model", pooling="likelihood", end_token_id=meta["end_token_id"]
    ).eval()
    Checkpointer(out).load_latest(models=trained, required=True)
    rm = RewardModel(str(final), chat_template=False, micro_batch_size=2)
    prompts = ["apple river?", "stone lamp?", "north tiger?"]
    responses = ["river apple yes", "lamp stone no", "tiger north yes"]
    scores = rm(Sample.batch(prompts, responses))
    # By hand: the mean log-prob of the response's tokens and the EOS, under the trained LM
    # (from the checkpoint) and under transformers' load of the export.
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tok = rm.tokenizer
    for lm in (hf, None):
        want = []
        for p, r in zip(prompts, responses, strict=True):
            n = len(tok(p, add_special_tokens=False)["input_ids"])
            ids = torch.tensor(
                [tok(p + r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
            )
            with torch.no_grad():
                if lm is None:
                    hidden = trained.base(input_ids=ids).last_hidden_state
                    logits = trained.head(hidden)
                else:
                    logits = lm(ids).logits
            logp = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            want.append(logp[n - 1 :].mean())
        torch.testing.assert_close(scores, torch.stack(want), atol=1e-5, rtol=1e-5)
    assert scores[0] > scores[1] and scores[2] > scores[1]


def test_resume_gives_the_uninterrupted_loss_curve(tmp_path):
    full = tmp_path / "full"
    cfg = _config(full, save_every=3, keep_last=5, eval_every=None, packing=True)
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    reference = _losses(full / "out")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    crashed = tmp_path / "crashed"
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(full / "out" / "checkpoints" / "step_000003", ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000003")
    # Same model and data: a changed path would be refused by the resume config check.
    over = {"output_dir": str(crashed / "out"), "resume": True}
    cfg = _config(full, save_every=3, keep_last=5, eval_every=None, packing=True, **over)
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    resumed = _losses(crashed / "out")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == reference[step], step  # bitwise on CPU fp32


def test_a_pair_trains_only_its_head_and_cost_heads_get_the_sign_term(tmp_path):
    from omegaconf import OmegaConf

    from lightrft import config as lconfig

    cfg_path = _config(
        tmp_path,
        heads=["helpful", "cost"],
        model={
            "path": str(tmp_path / "model"),
            "heads": ["helpful", "cost"],
            "cost_heads": ["cost"],
        },
    )
    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("reward_model", cfg)
    recipe.setup(cfg)
    try:
        items = [recipe.dataset[i] for i in range(len(recipe.dataset))]
        for name, row in (("helpful", 0), ("cost", 1)):
            batch = recipe.loader.collate_fn.collate([it for it in items if it["head"] == name][:4])
            recipe.model.zero_grad(set_to_none=True)
            recipe._loss(batch, divisor=4.0).backward()
            grad = recipe.model.score.weight.grad  # [2, H]
            assert grad[row].abs().sum() > 0 and grad[1 - row].abs().sum() == 0, name
        # The cost head: chosen (safe) should get the lower cost. With the head's weights set so
        # that every cost is 0, the loss is log 2 (pair) + 2 log 2 (sign terms, safety_coef 1).
        with torch.no_grad():
            recipe.model.score.weight.zero_()
        cost_batch = recipe.loader.collate_fn.collate(
            [it for it in items if it["head"] == "cost"][:4]
        )
        loss = recipe._loss(cost_batch, divisor=4.0).item()
        assert loss == pytest.approx(3 * torch.log(torch.tensor(2.0)).item(), rel=1e-5)
        assert OmegaConf.select(cfg, "model.cost_heads") == ["cost"]
    finally:
        recipe.run.close(clean=True)


def _two_ranks(rank: int, world_size: int, cfg_path: str) -> None:
    from torch.distributed.tensor import DTensor

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("reward_model", cfg)
    recipe.setup(cfg)
    params = list(recipe.model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)
    recipe.train()
    recipe.logger.close()
    if rank == 0:
        evals = [r for r in read_metrics(Path(cfg.output_dir)) if "eval/accuracy" in r]
        assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"], evals
    torch.distributed.barrier()  # both ranks leave together (gloo teardown under load)


def _named_heads_config(tmp_path: Path) -> Path:
    return _config(
        tmp_path,
        heads=["helpful", "cost"],
        model={
            "path": str(tmp_path / "model"),
            "heads": ["helpful", "cost"],
            "cost_heads": ["cost"],
            "pooling": "attention",
        },
        packing=True,
        gradient_accumulation_steps=1,
        batch_size=4,
        eval_every=None,
    )


def test_two_gloo_processes_shard_learn_and_export_named_heads(two_rank_rm):
    from lightrft.rewards import RewardModel

    # _two_ranks checked the sharded parameters and the rising eval accuracy.
    final = two_rank_rm["named_heads"] / "out" / "final"
    meta = json.loads((final / "config.json").read_text())["lightrft_reward"]
    assert meta["heads"] == ["helpful", "cost"] and meta["pooling"] == "attention"
    assert set(meta["stats"]) == {"helpful", "cost"}
    rm = RewardModel(str(final), score_head="cost")
    scores = rm(Sample.batch(["apple river?"], ["river apple no"]))
    assert set(rm.last_head_scores) == {"helpful", "cost"}
    assert scores[0] == rm.last_head_scores["cost"][0]


def _two_ranks_metrics(rank: int, world_size: int, cfg_path: str) -> None:
    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("reward_model", cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.logger.close()
    torch.distributed.barrier()


def test_token_budget_micro_batches_give_the_items_only_curve(two_rank_rm):
    """micro_batch_tokens cuts each step's items (shortest first) by a token budget: on 2 ranks
    whose micro-batch counts then differ, losses and gradient norms equal the items-only run's."""
    runs = {}
    for name in ("items", "budget"):
        rows = read_metrics(two_rank_rm[name] / "out")
        runs[name] = [(r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]
    assert len(runs["budget"]) == 3  # 96 pairs / (8 x 2 x 2 ranks)
    torch.testing.assert_close(runs["budget"], runs["items"], rtol=1e-5, atol=1e-6)


def test_bad_config_and_data_fail_before_training(tmp_path, capsys):
    cfg = _config(tmp_path)
    assert cli.main(["run", "reward_model", "--config", str(cfg), "model.cost_heads=[x]"]) == 2
    assert "model.cost_heads" in capsys.readouterr().err
    assert cli.main(["run", "reward_model", "--config", str(cfg), "loss.type=hinge"]) == 2
    assert "loss.type" in capsys.readouterr().err
    assert cli.main(["run", "reward_model", "--config", str(cfg), "max_tokens_per_row=8"]) == 2
    assert "packing" in capsys.readouterr().err
    assert cli.main(["run", "reward_model", "--config", str(cfg), "micro_batch_tokens=0"]) == 2
    assert "micro_batch_tokens must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["run", "reward_model", "--config", str(cfg), "loss.nll_coef=0.5"]) == 2
    assert "loss.nll_coef applies to model.pooling=likelihood only" in capsys.readouterr().err
    over = ["max_steps=1", "lr_scheduler.warmup_steps=2"]
    assert cli.main(["run", "reward_model", "--config", str(cfg), *over]) == 2
    assert "lr_scheduler.warmup_steps=2 is more than max_steps=1" in capsys.readouterr().err
    two = ["model.pooling=likelihood", "model.heads=[a,b]"]
    assert cli.main(["run", "reward_model", "--config", str(cfg), *two]) == 2
    assert "model.pooling=likelihood scores with the LM head" in capsys.readouterr().err
    assert cli.main(["run", "reward_model", "--config", str(cfg), "resume=true"]) == 2
    assert "resume=true but no checkpoint" in capsys.readouterr().err
    # A pair labelled for a head the model does not have: the file and line, before the model.
    h = tmp_path / "h"
    labelled = _config(h, heads=["helpful"], model={"path": str(h / "model")})
    with pytest.raises(ValueError, match=r"train.jsonl line 1: .*head 'helpful'"):
        cli.main(["run", "reward_model", "--config", str(labelled)])


# ---------------------------------------------------------------------------------- LoRA

_LORA = {"rank": 4, "alpha": 8}


def _scores(net, rm, prompts, responses) -> torch.Tensor:
    seqs = rm.encode(prompts, responses)[0]
    with torch.no_grad():
        return torch.stack(
            [
                net(
                    torch.tensor([s]),
                    torch.arange(len(s))[None],
                    torch.zeros(1, len(s), dtype=torch.long),
                    num_sequences=1,
                )[0, 0]
                for s in seqs
            ]
        )


def test_lora_learns_checkpoints_adapters_resumes_bitwise_and_exports_merged(tmp_path, capsys):
    """LoRA on the backbone, the head and attention pooler in full: the run learns; checkpoints
    hold only the trained parameters; a resumed run repeats the uninterrupted losses bitwise;
    final/ is the merged classifier, which RewardModel and transformers score like the trained
    model; resuming it as a full fine-tune is refused."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForSequenceClassification

    from lightrft.models.lora import apply_backbone_lora
    from lightrft.models.reward import build_reward_net
    from lightrft.rewards import RewardModel
    from lightrft.sections import LoraConfig
    from lightrft.training import Checkpointer

    full = tmp_path / "full"
    pooling = {"path": str(full / "model"), "pooling": "attention"}
    cfg = _config(full, save_every=3, keep_last=5, lora=_LORA, model=pooling)
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    out = full / "out"
    reference = _losses(out)
    evals = [r for r in read_metrics(out) if "eval/accuracy" in r]
    assert evals[-1]["eval/accuracy/reward"] > evals[0]["eval/accuracy/reward"], evals
    keys = FileSystemReader(str(out / "checkpoints" / "step_000006")).read_metadata()
    saved = [k for k in keys.state_dict_metadata if k.startswith("model.model.model.")]
    # Adapters, the head and the pooler: no frozen base weight is checkpointed.
    assert saved and all(".lora_" in k or ".score." in k or ".pooler." in k for k in saved)
    assert any(".score." in k for k in saved) and any(".lora_" in k for k in saved)

    # The trained model (adapters from the step-6 checkpoint) and the merged export agree.
    torch.manual_seed(0)
    trained = build_reward_net(full / "model", pooling="attention")
    trained = apply_backbone_lora(trained, LoraConfig.read(_LORA)).eval()
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad])
    Checkpointer(out).load_latest(models=trained, optimizers=optimizer, required=True)
    final = out / "final"
    assert not (final / "adapter_config.json").exists()
    rm = RewardModel(str(final), micro_batch_size=1)
    prompts, responses = ["apple river?", "stone lamp?"], ["river apple yes", "lamp stone no"]
    scores = rm(Sample.batch(prompts, responses))
    torch.testing.assert_close(scores, _scores(trained, rm, prompts, responses), atol=1e-5, rtol=0)
    initial = build_reward_net(full / "model", pooling="attention").eval()
    assert not torch.allclose(scores, _scores(initial, rm, prompts, responses))
    assert AutoModelForSequenceClassification.from_pretrained(final) is not None

    # Resume from step 3: the same losses, bitwise.
    crashed = tmp_path / "crashed"
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_000003", ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000003")
    # Same model and data: a changed path would be refused by the resume config check.
    pooling = {"path": str(full / "model"), "pooling": "attention"}
    over = dict(save_every=3, keep_last=5, model=pooling, resume=True)
    over["output_dir"] = str(crashed / "out")
    cfg = _config(full, lora=_LORA, **over)
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    resumed = _losses(crashed / "out")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == reference[s] for s in (4, 5, 6)), (resumed, reference)
    assert cli.main(["run", "reward_model", "--config", str(_config(full, **over))]) == 2
    assert "holds LoRA adapters" in capsys.readouterr().err


def test_lora_on_a_likelihood_reward_model_keeps_the_lm_head_frozen(tmp_path):
    """LoRA with the likelihood pooling: only the adapters train (the LM head is the pretrained
    one, not a new head), and the merged export is the causal LM that RewardModel scores."""
    from lightrft.data.preference import pad_sequences
    from lightrft.models.lora import apply_backbone_lora
    from lightrft.models.reward import build_reward_net
    from lightrft.rewards import RewardModel
    from lightrft.sections import LoraConfig

    model = {"path": str(tmp_path / "model"), "pooling": "likelihood"}
    cfg = _config(tmp_path, lora=_LORA, model=model, max_steps=3, eval_every=None)
    assert cli.main(["run", "reward_model", "--config", str(cfg)]) == 0
    net = build_reward_net(tmp_path / "model", pooling="likelihood")
    lora = apply_backbone_lora(
        build_reward_net(tmp_path / "model", pooling="likelihood"), LoraConfig.read(_LORA)
    )
    trained = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained), trained

    final = tmp_path / "out" / "final"
    meta = json.loads((final / "config.json").read_text())["lightrft_reward"]
    assert meta["pooling"] == "likelihood"
    rm = RewardModel(str(final))
    prompts, responses = ["apple river?"], ["river apple yes"]
    after = rm(Sample.batch(prompts, responses))
    seqs, starts = rm.encode(prompts, responses)
    with torch.no_grad():
        before = net.eval()(
            num_sequences=1, **pad_sequences([torch.tensor(seqs[0])], 0, starts=starts)
        )[:, 0]
    assert torch.isfinite(after).all() and not torch.allclose(after, before)


def test_lora_on_two_gloo_processes_exports_a_loadable_merged_model(two_rank_rm):
    """LoRA under FSDP2 on 2 ranks (adapters sharded with the frozen weights): the run learns and
    the merged export, gathered from the shards, loads in RewardModel."""
    from lightrft.rewards import RewardModel

    final = two_rank_rm["lora"] / "out" / "final"  # _two_ranks checked the rising accuracy
    scores = RewardModel(str(final))(Sample.batch(["apple river?"], ["river apple yes"]))
    assert torch.isfinite(scores).all()


# ---------------------------------------------------------------------------------- sharded load


_IDS = torch.arange(3, 19).view(2, 8)
_LAYOUT = dict(
    position_ids=torch.arange(8).repeat(2, 1),
    segment_ids=torch.tensor([[0] * 8, [1] * 8]),
    num_sequences=2,
    scored=torch.arange(8).repeat(2, 1) >= 3,
)


def _sharded_scores(rank: int, world_size: int, rm: str, lm: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from lightrft.models.reward import load_reward_net_parallel

    classifier = load_reward_net_parallel(rm, heads=["helpful", "cost"]).eval()
    likelihood = load_reward_net_parallel(lm, pooling="likelihood", end_token_id=2).eval()
    scores = []
    for net in (classifier, likelihood):
        assert all(isinstance(p, DTensor) for p in net.parameters())
        with torch.no_grad():  # a collective forward: every rank runs it
            scores.append(net(_IDS, **_LAYOUT))
    if rank == 0:
        torch.save(scores, out)
    torch.distributed.barrier()


def _sharded_inputs(tmp_path: Path) -> None:
    """A causal LM (``lm``) and a classifier checkpoint with its random head from it (``rm``)."""
    from lightrft.models.export import export_hf
    from lightrft.models.reward import load_reward_net_parallel
    from lightrft.tasks import make_tiny_model

    make_tiny_model(tmp_path / "lm", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    torch.manual_seed(0)
    net = load_reward_net_parallel(tmp_path / "lm", heads=["helpful", "cost"], shard=False)
    export_hf(net, None, tmp_path / "rm")  # a classifier checkpoint with its (random) head


def test_sharded_reward_net_loads_its_slices_and_scores_like_one_process(two_rank_rm):
    """Under 2 gloo ranks the reward model is built on the meta device and each rank reads its
    slices (backbone and head from a classifier checkpoint; the causal LM whole for the
    likelihood pooling): the scores equal one process's."""
    from lightrft.models.reward import load_reward_net_parallel

    tmp_path = two_rank_rm["sharded"]
    one = load_reward_net_parallel(tmp_path / "rm", heads=["helpful", "cost"], shard=False).eval()
    lm = load_reward_net_parallel(
        tmp_path / "lm", pooling="likelihood", end_token_id=2, shard=False
    ).eval()
    with torch.no_grad():
        want = [one(_IDS, **_LAYOUT), lm(_IDS, **_LAYOUT)]
    torch.testing.assert_close(torch.load(tmp_path / "s.pt"), want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def two_rank_rm(tmp_path_factory) -> dict[str, Path]:
    """name -> the directory of a finished 2-rank body, all run in one spawn of the 2 ranks:
    ``named_heads`` and ``lora`` (recipe runs through :func:`_two_ranks`), ``items`` and
    ``budget`` (:func:`_two_ranks_metrics`), ``sharded`` (:func:`_sharded_scores`' scores in
    ``s.pt``)."""
    root = tmp_path_factory.mktemp("two_rank_rm")
    dirs = {n: root / n for n in ("named_heads", "items", "budget", "lora", "sharded")}
    for d in dirs.values():
        d.mkdir()
    _sharded_inputs(dirs["sharded"])
    calls = [
        (_two_ranks, (str(_named_heads_config(dirs["named_heads"])),)),
        (_two_ranks_metrics, (str(_config(dirs["items"], eval_every=None)),)),
        (
            _two_ranks_metrics,
            (str(_config(dirs["budget"], eval_every=None, micro_batch_tokens=190)),),
        ),
        (
            _two_ranks,
            (str(_config(dirs["lora"], lora=_LORA, gradient_accumulation_steps=1, batch_size=4)),),
        ),
        (
            _sharded_scores,
            tuple(str(dirs["sharded"] / n) for n in ("rm", "lm", "s.pt")),
        ),
    ]
    run_distributed(each, calls, world_size=2)
    return dirs
