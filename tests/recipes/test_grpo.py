"""The GRPO recipe through the real CLI, in-process: every advantage estimator, the loss / KL /
shaping options, gradient accumulation, resume, 2 gloo processes, learning and bad input."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml
from _dist import build_recipe, run_distributed
from _serial import each
from transformers import AutoTokenizer

from lightrft import cli
from lightrft.algorithms import ESTIMATORS
from lightrft.training import read_metrics


@pytest.fixture(autouse=True)
def _slow_is_opt_in(request):
    """`slow` tests run only when selected with `-m slow` (the marker is documented as opt-in)."""
    if request.node.get_closest_marker("slow") and "slow" not in (
        request.config.getoption("markexpr") or ""
    ):
        pytest.skip("slow test: select it with -m slow")


# Reward functions for the tests, importable as `test_grpo.<Name>` by the config.
class DigitReward:
    """Fraction of the response's characters that are digits (a trivial task)."""

    def __call__(self, samples):
        responses = [s.response for s in samples]
        return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


class TwoHeadReward:
    """A stand-in for a two-head reward model: scores with its ``a`` head, reports both heads
    (``last_head_scores``) and a metric of its own (``last_metrics``), as RewardModel and
    GenerativeReward do."""

    def __call__(self, samples):
        responses = [s.response for s in samples]
        a = [float(len(r)) for r in responses]
        self.last_head_scores = {"a": a, "b": [2.0 * x for x in a]}
        self.last_metrics = {"calls": 1.0, "size": float(len(responses))}
        return a


class NanReward:
    def __call__(self, samples):
        responses = [s.response for s in samples]
        return [math.nan] * len(responses)


class ZeroReward:
    def __call__(self, samples):
        responses = [s.response for s in samples]
        return [0.0] * len(responses)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("grpo_assets")
    make_tiny_model(root / "model", layers=2, hidden=32, heads=2, kv_heads=1, max_positions=64)
    ensure_arith_dataset(root / "data", n_train=40, n_test=8, digits=1)
    return root


def _config(tmp: Path, assets: Path, **overrides) -> Path:
    """2 steps of 2 prompts x 4 samples of 4 tokens on a 2-layer, hidden-32 model."""
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(assets / "model")},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(assets / "data" / "train.jsonl"),
        },
        "eval_dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(assets / "data" / "test.jsonl"),
        },
        "reward": {
            "_component_": "lightrft.rewards.CombinedReward",
            "functions": {
                "accuracy": {"_component_": "lightrft.rewards.MathVerifier"},
                "digits": {"_component_": "test_grpo.DigitReward"},
            },
            "weights": {"digits": 0.5},
        },
        "rollout": {"prompts_per_step": 2, "n": 4, "max_tokens": 4},
        "algorithm": {"advantage": {"estimator": "grpo"}},
        "train": {"micro_batch_size": 4, "ppo_epochs": 1},
        "max_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "clip_grad_norm": 1.0,
        "eval": {"every": 1, "max_tokens": 3},
        "metrics": {"tensorboard": False},
    }
    for key, value in overrides.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    path = tmp / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    return path


def _run(tmp: Path, assets: Path, *args: str, **overrides) -> list[dict]:
    cfg = _config(tmp, assets, **overrides)
    assert cli.main(["run", "grpo", "--config", str(cfg), *args]) == 0
    return read_metrics(tmp / "out")


def _train_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if "train/lr" in r}


def _finite(row: dict, *keys: str) -> None:
    for k in keys:
        assert k in row, (k, sorted(row))
        assert math.isfinite(row[k]), (k, row[k])


# ---------------------------------------------------------------------------------- estimators


# grpo, gae (the critic path) and rloo by default; the other estimators differ only in the pure
# function that tests/algorithms checks value by value: opt-in with -m slow.
@pytest.mark.parametrize(
    "estimator",
    [
        e if e in ("grpo", "gae", "rloo") else pytest.param(e, marks=pytest.mark.slow)
        for e in ESTIMATORS
    ],
)
def test_every_estimator_runs_two_steps(tmp_path, assets, estimator):
    over = {"algorithm.advantage.estimator": estimator, "eval": None, "eval_dataset": None}
    if estimator == "gae":
        over["critic"] = {"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}}
        over["algorithm.value"] = {"clip": 0.2}
    rows = _run(tmp_path, assets, **over)
    train = _train_rows(rows)
    assert sorted(train) == [1, 2]
    for row in train.values():
        _finite(
            row,
            "train/loss",
            "train/policy_loss",
            "train/grad_norm",
            "train/entropy",
            "train/clip_frac",
            "reward/total/mean",
            "reward/accuracy/mean",
            "reward/digits/std",
            "rollout/response_length/mean",
            "time/rollout",
            "time/scoring",
            "time/training",
            "time/weight_sync",
            "perf/tokens_per_s",
            "memory/peak_rss_gib",
        )
        assert row["rollout/samples"] == 8
        if estimator == "gae":
            _finite(row, "train/value_loss", "critic/grad_norm")
        else:
            assert "train/value_loss" not in row
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


def test_options_compose_and_are_applied(tmp_path, assets):
    """KL in the loss with an adaptive controller, entropy bonus and high-entropy tokens, TIS,
    dual clip + clip-higher, overlong penalty, reward normalisation, several mini-batches and
    PPO epochs, packing, trajectories and eval."""
    rows = _run(
        tmp_path,
        assets,
        **{
            "algorithm.kl": {
                "coef": 0.1,
                "estimator": "k3",
                "placement": "loss",
                "controller": "adaptive",
                "target": 0.01,
                "horizon": 100,
            },
            "algorithm.entropy": {"coef": 0.01, "top_rho": 0.5},
            "algorithm.tis": {"mode": "token", "cap": 2.0},
            "algorithm.policy_loss": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
            "algorithm.shaping": {
                "reward_norm": True,
                "reward_clip": 5.0,
                "overlong": {"buffer": 2, "factor": 0.5},
            },
            "train": {
                "micro_batch_size": 3,
                "ppo_epochs": 2,
                "mini_batch_size": 4,
                "packing": True,
            },
            "trajectories": True,
            "trajectory_tokens": True,  # from the old-log-prob pass, which has the entropy
            "engine": {"sleep_level": 2},
        },
    )
    train = _train_rows(rows)
    for row in train.values():
        _finite(
            row,
            "train/kl",
            "train/kl_coef",
            "train/kl_loss",
            "train/tis_weight_mean",
            "train/high_entropy_frac",
            "reward/overlong/mean",
            "time/reference",
            "time/old_logprobs",
        )
        assert row["train/optimizer_steps"] == 4  # 2 epochs x 8 samples / 4
        assert 0.4 <= row["train/high_entropy_frac"] <= 1.0
    # The adaptive controller moved the coefficient after step 1.
    assert train[2]["train/kl_coef"] != 0.1
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    lines = (tmp_path / "out" / "trajectories" / "step_000002.jsonl").read_text().splitlines()
    assert len(lines) == 8
    rec = json.loads(lines[0])
    assert {"prompt", "response", "reward_parts", "advantage", "reward"} <= set(rec)
    assert set(rec["reward_parts"]) == {"accuracy", "digits"}
    n, tokens = rec["response_length"], rec["tokens"]
    assert all(len(tokens[k]) == n for k in ("text", "logprob", "entropy", "advantage"))


def test_trajectory_tokens_add_to_the_lines_and_change_no_number(tmp_path, assets):
    """``trajectory_tokens`` adds a ``tokens`` entry to each trajectory line (the rest of the line
    byte for byte as without it) and changes no logged number but its own time. With dynamic
    sampling some samples are dropped: they get the engine's log-probs only."""
    over = {"trajectories": True, "algorithm.shaping": {"dynamic_sampling": {"max_draws": 2}}}
    (tmp_path / "plain").mkdir()
    (tmp_path / "tokens").mkdir()
    plain = _run(tmp_path / "plain", assets, **over)
    tokens = _run(tmp_path / "tokens", assets, trajectory_tokens=True, **over)
    timing = ("time/", "perf/", "memory/")
    special = set(AutoTokenizer.from_pretrained(assets / "model").get_added_vocab())
    for a, b in zip(plain, tokens, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing)
        }
    assert all("time/trajectories" in r for r in _train_rows(tokens).values())
    assert not any("time/trajectories" in r for r in plain)
    for step in (1, 2):
        name = f"trajectories/step_{step:06d}.jsonl"
        before = (tmp_path / "plain" / "out" / name).read_text().splitlines()
        after = (tmp_path / "tokens" / "out" / name).read_text().splitlines()
        assert len(before) == len(after) > 0
        for old, new in zip(before, after, strict=True):
            rec = json.loads(new)
            detail = rec.pop("tokens")
            assert json.dumps(rec) == old
            n = rec["response_length"]
            assert len(detail["text"]) == len(detail["engine_logprob"]) == n
            # The pieces join to the text with special tokens kept (the response drops them).
            assert "".join(t for t in detail["text"] if t not in special) == rec["response"]
            trained = ("logprob", "entropy", "advantage")
            if rec["kept"]:
                assert all(len(detail[k]) == n for k in trained)
                assert all(e >= 0 for e in detail["entropy"])
                # on-policy: the trainer's log-probs before the update equal the engine's
                diff = max(
                    abs(a - b)
                    for a, b in zip(detail["logprob"], detail["engine_logprob"], strict=True)
                )
                assert diff < 1e-3
                assert sum(detail["advantage"]) / n == pytest.approx(rec["advantage"], abs=1e-3)
            else:
                assert all(detail[k] is None for k in trained)


def test_mismatch_corrections_narrow_the_policy_loss(tmp_path, assets):
    """algorithm.mismatch: IcePop masks exactly the tokens whose ratio trainer / engine (the
    trajectory files' ``logprob`` and ``engine_logprob``) leaves its band; bands nothing leaves
    change no trained number. top_k=2: the engine reports log-probs renormalised over its two
    tokens, below the trainer's (full distribution), so the ratios spread over (0, 1)."""
    over = {"rollout.top_k": 2, "trajectories": True, "trajectory_tokens": True, "eval": None}

    def run(name, mismatch):
        (tmp_path / name).mkdir()
        rows = _run(tmp_path / name, assets, eval_dataset=None, **over, algorithm=mismatch)
        return _train_rows(rows)

    def deltas(name, step):
        lines = (tmp_path / name / "out" / f"trajectories/step_{step:06d}.jsonl").read_text()
        tokens = [json.loads(line)["tokens"] for line in lines.splitlines()]
        return [
            a - b for t in tokens for a, b in zip(t["logprob"], t["engine_logprob"], strict=True)
        ]

    def trained(row):
        return {k: v for k, v in row.items() if k.startswith(("train/", "reward/"))}

    alg = {"advantage": {"estimator": "grpo"}}
    plain = run("plain", alg)
    wide = {"low": 1e-30, "high": 1e30}
    both = {"icepop": wide, "geometric": {**wide, "veto": 0}}
    for step, row in run("wide", {**alg, "mismatch": both}).items():
        assert trained(row) == trained(plain[step])
        assert row["rollout/mismatch/icepop_masked_frac"] == 0
        assert row["rollout/mismatch/geometric_rejected_frac"] == 0
    d = sorted(deltas("plain", 1))  # equal tokens of a group have equal ratios: find a gap
    k = min(range(1, len(d)), key=lambda i: (d[i] - d[i - 1] < 1e-3, abs(i - len(d) / 2)))
    low = math.exp((d[k - 1] + d[k]) / 2)
    icepop = run("icepop", {**alg, "mismatch": {"icepop": {"low": low, "high": 2.0}}})
    for step, row in icepop.items():
        d = deltas("icepop", step)
        expected = sum(not math.log(low) <= x <= math.log(2) for x in d) / len(d)
        assert row["rollout/mismatch/icepop_masked_frac"] == pytest.approx(expected, abs=1e-6)
        assert "rollout/mismatch/geometric_rejected_frac" not in row
    assert 0.2 < icepop[1]["rollout/mismatch/icepop_masked_frac"] < 0.8
    assert trained(icepop[1]) != trained(plain[1])


def test_kl_in_reward_and_other_objectives(tmp_path, assets):
    for objective, extra in [
        ("gspo", {"algorithm.tis": {"mode": "sequence_mask"}}),
        ("gmpo", {"algorithm.old_logprobs": "engine"}),
        (
            "cpgd",
            {
                "algorithm.policy_loss.agg": "seq_mean_token_sum_norm",
                "algorithm.policy_loss.norm_len": 4,
            },
        ),
    ]:
        tmp = tmp_path / objective
        tmp.mkdir()
        rows = _run(
            tmp,
            assets,
            max_steps=1,
            eval=None,
            eval_dataset=None,
            **{
                "algorithm.policy_loss.objective": objective,
                "algorithm.kl": {"coef": 0.05, "placement": "reward", "estimator": "k1"},
                "train": {"micro_batch_size": 4, "ppo_epochs": 2},
                **extra,
            },
        )
        row = _train_rows(rows)[1]
        _finite(row, "train/loss", "train/kl", "train/ratio_mean")
        if objective == "gspo":
            _finite(row, "train/tis_weight_mean")


def test_micro_batches_and_packing_equal_one_big_batch(tmp_path, assets):
    """token_mean with global token counts: the gradient does not depend on how the step is
    split into micro-batches, nor on packing vs padding."""
    results = {}
    for name, train in {
        "big": {"micro_batch_size": 8},
        "micro": {"micro_batch_size": 3},
        "packed": {"micro_batch_size": 2, "packing": True},
        # Token budgets: rows of different lengths split by tokens, not by a row count.
        "packed_budget": {"micro_batch_size": 8, "micro_batch_tokens": 40, "packing": True},
        "padded_budget": {"micro_batch_size": 8, "micro_batch_tokens": 40},
    }.items():
        tmp = tmp_path / name
        tmp.mkdir()
        rows = _run(tmp, assets, max_steps=1, eval=None, eval_dataset=None, train=train)
        results[name] = _train_rows(rows)[1]
    for name in ("micro", "packed", "packed_budget", "padded_budget"):
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert results[name][key] == pytest.approx(results["big"][key], rel=1e-4, abs=1e-6)


def test_training_forward_computes_the_lm_head_gradients(tmp_path, assets, monkeypatch):
    """Issue 15 item 2: with a per-token objective the training forward hands the kernel a
    grad_hint built from the recipe's own loss (policy + KL + entropy bonus + TIS), so the
    kernel's backward recomputes nothing and no disagreement is warned about; the step equals
    the one without the hint. gspo (a sequence ratio) takes the recomputing path."""
    import warnings

    import lightrft.kernels
    import lightrft.kernels.logprobs as lp_mod

    calls = {"sweep": 0, "recompute": 0}
    chunked = lp_mod.chunked_sweep

    def counted(*args, **kwargs):
        # The forward's sweep passes the hint; the recomputing backward writes no log-probs.
        if kwargs.get("hint") is not None:
            calls["sweep"] += 1
        elif kwargs.get("logp_out") is None:
            calls["recompute"] += 1
        return chunked(*args, **kwargs)

    monkeypatch.setattr(lp_mod, "chunked_sweep", counted)
    over = {
        "max_steps": 1,
        "eval": None,
        "eval_dataset": None,
        "algorithm.kl": {"coef": 0.1, "estimator": "k3", "placement": "loss"},
        "algorithm.entropy": {"coef": 0.01},
        "algorithm.tis": {"mode": "token", "cap": 2.0},
        "train": {"micro_batch_size": 3, "ppo_epochs": 2, "packing": True},
    }
    results = {}
    for name in ("hint", "no_hint", "gspo"):
        tmp = tmp_path / name
        tmp.mkdir()
        extra = {"algorithm.policy_loss.objective": "gspo"} if name == "gspo" else {}
        if name == "no_hint":
            monkeypatch.setattr(lightrft.kernels, "response_grad_hint", lambda *a, **k: None)
        calls.update(sweep=0, recompute=0)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fused_linear_logprobs")
            results[name] = _train_rows(_run(tmp, assets, **over, **extra))[1]
        results[name]["calls"] = dict(calls)
    # 2 epochs x 3 micro-batches, every one through the sweep and none recomputed.
    assert results["hint"]["calls"] == {"sweep": 6, "recompute": 0}
    assert results["no_hint"]["calls"] == {"sweep": 0, "recompute": 6}
    assert results["gspo"]["calls"] == {"sweep": 0, "recompute": 6}
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/entropy"):
        assert results["hint"][key] == pytest.approx(results["no_hint"][key], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    "objective,agg",
    [
        # One token-level, one constant-norm and one sequence-level mode by default (the
        # losses' own tests cover every mode's normaliser); the rest with `-m slow`.
        ("ppo", "seq_mean_token_mean"),
        pytest.param("ppo", "seq_mean_token_sum", marks=pytest.mark.slow),
        # Dr.GRPO: norm_len defaults to max_tokens
        pytest.param("ppo", "seq_mean_token_sum_norm", marks=pytest.mark.slow),
        ("gspo", None),
        pytest.param("gmpo", None, marks=pytest.mark.slow),
        pytest.param("cpgd", None, marks=pytest.mark.slow),
    ],
)
def test_accumulation_equals_one_big_batch_for_every_aggregation(tmp_path, assets, objective, agg):
    """Every objective and aggregation mode normalises by the counts of the whole mini-batch
    (and Dr.GRPO by the constant rollout.max_tokens), so micro-batching does not change the
    step."""
    results = {}
    for name, micro in {"big": 8, "micro": 3}.items():
        tmp = tmp_path / name
        tmp.mkdir()
        over = {"algorithm.policy_loss.objective": objective, "algorithm.policy_loss.agg": agg}
        rows = _run(
            tmp,
            assets,
            max_steps=1,
            eval=None,
            eval_dataset=None,
            train={"micro_batch_size": micro},
            **over,
        )
        results[name] = _train_rows(rows)[1]
    # policy_loss (like loss) is the mini-batch's, whatever its micro-batches: they add up.
    for key in ("train/loss", "train/policy_loss", "train/grad_norm", "train/entropy"):
        assert results["micro"][key] == pytest.approx(results["big"][key], rel=1e-4, abs=1e-6)


# ---------------------------------------------------------------------------------- resume


def test_resume_gives_the_uninterrupted_curve_bitwise(tmp_path, assets):
    over = {
        "max_steps": 3,
        "save_every": 2,
        "keep_last": 5,
        "eval": {"every": 2},
        "algorithm.kl": {"coef": 0.1, "controller": "adaptive", "target": 0.01, "horizon": 50},
        "algorithm.shaping": {"reward_norm": True},
        "train": {"micro_batch_size": 4, "ppo_epochs": 2, "mini_batch_size": 4},
        "lr_scheduler": {"warmup_steps": 1},
    }
    full = tmp_path / "full"
    full.mkdir()
    reference = _train_rows(_run(full, assets, **over))
    assert sorted(reference) == [1, 2, 3]

    crashed = tmp_path / "crashed"
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(full / "out" / "checkpoints" / "step_000002", ckpts / "step_000002")
    (ckpts / "latest").write_text("step_000002")
    rows = _run(crashed, assets, resume=True, **over)
    resumed = _train_rows(rows)
    assert sorted(resumed) == [3]
    deterministic = [k for k in reference[3] if k.split("/")[0] in ("train", "reward", "rollout")]
    assert len(deterministic) > 20
    for step in (3,):
        for key in deterministic:
            assert resumed[step][key] == reference[step][key], (step, key)
    final_eval = [r for r in rows if "eval/accuracy" in r][-1]
    ref_eval = [r for r in read_metrics(full / "out") if "eval/accuracy" in r][-1]
    assert final_eval == ref_eval


# ---------------------------------------------------------------------------------- 2 processes


def _two_rank_grpo(rank: int, world_size: int, cfg_path: str) -> None:

    from torch.distributed.tensor import DTensor

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("grpo", cfg)
    recipe.setup(cfg)
    assert all(isinstance(p, DTensor) for p in recipe.model.parameters())
    recipe.train()
    recipe.logger.close()
    if rank == 0:
        rows = read_metrics(Path(cfg.output_dir))
        train = _train_rows(rows)
        assert sorted(train) == [1, 2]
        for row in train.values():
            assert row["rollout/samples"] == 8  # 2 prompts per step over 2 ranks, 4 each
            _finite(row, "train/loss", "train/grad_norm", "train/kl", "train/value_loss")
        assert [r["eval/samples"] for r in rows if "eval/samples" in r] == [8, 8]


TWO_RANK_TRAIN = {
    "rows": {"micro_batch_size": 2, "mini_batch_size": 4},
    # A token budget: the ranks' micro-batch counts can differ and must still pair up.
    "token_budget": {
        "micro_batch_size": 4,
        "mini_batch_size": 4,
        "micro_batch_tokens": 30,
        "packing": True,
    },
}


def _two_rank_config(tmp: Path, assets: Path, train: dict) -> Path:
    return _config(
        tmp,
        assets,
        **{
            "algorithm.advantage.estimator": "gae",
            "critic": {"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}},
            "algorithm.kl": {"coef": 0.05},
            "train": train,
            "eval": {"max_tokens": 3},
            "save_every": 2,
        },
    )


def _lora_config(tmp: Path, assets: Path) -> Path:
    lora = {"rank": 4, "alpha": 16, "export_merged": True}
    return _config(
        tmp,
        assets,
        lora=lora,
        **{
            "algorithm.kl": {"coef": 0.05},
            "save_every": 2,
            "eval": None,
            "eval_dataset": None,
            "max_steps": 3,
        },
    )


@pytest.fixture(scope="module")
def two_rank_grpo(tmp_path_factory, assets) -> dict[str, Path]:
    """name -> the directory of a finished 2-rank GRPO run, all in one spawn of the 2 ranks:
    ``rows`` and ``token_budget`` (:func:`_two_rank_grpo`'s checks), ``lora``
    (:func:`_two_rank_grpo_lora`'s, when PEFT is installed)."""
    import importlib.util

    root = tmp_path_factory.mktemp("two_rank_grpo")
    dirs = {name: root / name for name in (*TWO_RANK_TRAIN, "lora")}
    for d in dirs.values():
        d.mkdir()
    calls = [
        (_two_rank_grpo, (str(_two_rank_config(dirs[name], assets, train)),))
        for name, train in TWO_RANK_TRAIN.items()
    ]
    if importlib.util.find_spec("peft") is not None:
        calls.append((_two_rank_grpo_lora, (str(_lora_config(dirs["lora"], assets)),)))
    run_distributed(each, calls, world_size=2)
    return dirs


@pytest.mark.parametrize("train", list(TWO_RANK_TRAIN))
def test_two_gloo_processes(two_rank_grpo, train):
    out = two_rank_grpo[train] / "out"  # _two_rank_grpo checked the rows in both ranks
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "step_000002").is_dir()


# ---------------------------------------------------------------------------------- learning


def test_reward_rises_on_a_trivial_task(tmp_path, assets):
    """Reward = fraction of digits in the response: GRPO raises it from the random model's
    level within 12 steps."""
    rows = _run(
        tmp_path,
        assets,
        max_steps=12,
        eval=None,
        eval_dataset=None,
        reward={"_component_": "test_grpo.DigitReward"},
        rollout={"prompts_per_step": 4, "n": 8, "max_tokens": 4},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-2},
        train={"micro_batch_size": 32},
    )
    train = _train_rows(rows)
    first = sum(train[s]["reward/total/mean"] for s in (1, 2)) / 2
    last = sum(train[s]["reward/total/mean"] for s in (11, 12)) / 2
    assert last > first + 0.3, (first, last)


# ---------------------------------------------------------------------------------- bad input


def test_long_prompts_are_dropped_or_truncated_and_counted(tmp_path, assets):
    data = tmp_path / "mixed.jsonl"
    short = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    long = [{"prompt": f"{i}+1+1+1+1+1=", "answer": str(i + 5)} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in short + long))
    for mode in ("drop", "truncate"):
        tmp = tmp_path / mode
        tmp.mkdir()
        rows = _run(
            tmp,
            assets,
            max_steps=1,
            eval=None,
            eval_dataset=None,
            **{
                "dataset.path": str(data),
                "dataset.max_prompt_length": 24,
                "dataset.truncation": mode,
            },
        )
        stats = rows[0]
        assert stats["data/records"] == 10
        if mode == "drop":
            assert (stats["data/dropped"], stats["data/prompts"]) == (4, 6)
        else:
            assert (stats["data/truncated"], stats["data/prompts"]) == (4, 10)
        assert _train_rows(rows)[1]["rollout/prompt_length/mean"] <= 24


def test_empty_batch_after_dynamic_sampling_skips_the_update(tmp_path, assets):
    rows = _run(
        tmp_path,
        assets,
        eval=None,
        eval_dataset=None,
        reward={"_component_": "test_grpo.ZeroReward"},
        **{"algorithm.shaping": {"dynamic_sampling": {"max_draws": 2}}},
    )
    train = _train_rows(rows)
    for row in train.values():
        assert row["train/skipped"] == 1.0
        assert row["dynamic_sampling/groups_used"] == 0.0
        assert row["dynamic_sampling/draws"] == 2.0
        assert all(not isinstance(v, float) or math.isfinite(v) for v in row.values())


def test_bad_input_fails_with_a_clear_error(tmp_path, assets, capsys):
    # User errors (rewards, data) end the run with one clean line and exit 2, no traceback.
    def refused(pattern: str, **overrides) -> None:
        overrides["output_dir"] = str(tmp_path / f"out{len(list(tmp_path.glob('out*')))}")
        cfg = _config(tmp_path, assets, **overrides)
        capsys.readouterr()
        assert cli.main(["run", "grpo", "--config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert re.search(pattern, err) and "Traceback" not in err, err

    # NaN rewards name the function and the sample.
    refused(
        "RewardError: .*non-finite reward .*sample 0", reward={"_component_": "test_grpo.NanReward"}
    )
    # A prompt without a reference answer: the dataset names the file and line...
    bad = tmp_path / "noref.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    refused(r"DataError: .*noref.jsonl line 2.*answer", **{"dataset.path": str(bad)})
    # ... and a verifier that needs one names the sample when the dataset allows none.
    with pytest.raises(ValueError, match="needs a reference answer, but sample"):
        _run(
            tmp_path,
            assets,
            eval=None,
            eval_dataset=None,
            **{
                "dataset.path": str(bad),
                "dataset.reference_required": False,
                "rollout.prompts_per_step": 2,
            },
        )
    # Schema errors stop before anything loads, naming the key.
    cfg = _config(tmp_path, assets)
    assert cli.main(["run", "grpo", "--config", str(cfg), "rollout.nn=2"]) == 2
    assert (
        cli.main(["run", "grpo", "--config", str(cfg), "algorithm.advantage.estimator=gpro"]) == 2
    )


# One row per cross-field rule of build_options: `lightrft validate` and `lightrft run` both
# refuse the config, exit 2 and print the same message, before any model loads.
_ADAM = {"_component_": "torch.optim.AdamW", "lr": 1e-3}


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


BAD_CONFIGS = [
    ({"algorithm.kl": {"coef": 0.0}}, "kl.coef must be > 0"),
    ({"strategy": "zero3"}, "strategy: unknown strategy 'zero3'"),
    ({"deepspeed": {"stage": 2}}, "a deepspeed: section is set but strategy=fsdp2"),
    ({"replicate_size": 0}, "replicate_size must be >= 1, got 0"),
    ({"lora": {"rank": 4, "dropout": 1.5}}, "lora.dropout must be in [0, 1)"),
    ({"algorithm.kl": {"coef": 0.1, "controller": "adaptive"}}, "needs target and horizon"),
    ({"algorithm.kl": {"coef": 0.1, "target": 0.1}}, "adaptive only"),
    ({"critic": {"optimizer": {"_component_": "torch.optim.AdamW"}}}, "only by estimator=gae"),
    ({"algorithm.value": {"clip": 0.2}}, "only by estimator=gae"),
    ({"algorithm.advantage.estimator": "gae"}, "needs a critic"),
    ({"algorithm.advantage.lam": 0.9}, "takes options"),
    ({"rollout.n": 1}, "needs a group"),
    ({"algorithm.policy_loss.norm_len": 8}, "norm_len is used only"),
    (
        {"algorithm.policy_loss.objective": "gmpo", "algorithm.policy_loss.agg": "token_mean"},
        "aggregates 'seq_mean_token_mean'",
    ),
    (
        {"algorithm.policy_loss.objective": "cpgd", "algorithm.policy_loss.dual_clip": 3.0},
        "dual_clip applies",
    ),
    ({"algorithm.policy_loss.dual_clip": 0.5}, "dual_clip must be > 1"),
    ({"algorithm.policy_loss.clip_low": 1.0}, "clip_low must be < 1"),
    ({"algorithm.policy_loss.clip_high": -0.1}, "must be >= 0"),
    ({"algorithm.tis": {"cap": 3.0}}, "tis.cap is set but"),
    ({"algorithm.tis": {"mode": "token", "cap": 0.0}}, "tis.cap must be > 0"),
    (
        {"algorithm.tis": {"mode": "token"}, "algorithm.old_logprobs": "engine"},
        "old_logprobs=trainer",
    ),
    (
        {"rollout.first_token_temperature": 2.0, "algorithm.old_logprobs": "engine"},
        "first_token_temperature",
    ),
    (
        {"rollout.first_token_temperature": 2.0, "algorithm.tis": {"mode": "token"}},
        "first_token_temperature",
    ),
    (
        {"rollout.first_token_temperature": 2.0, "algorithm.mismatch": {"icepop": {}}},
        "algorithm.tis or algorithm.mismatch",
    ),
    (
        {"algorithm.mismatch": {"icepop": {"low": 2.0, "high": 3.0}}},
        r"algorithm.mismatch.icepop.low < 1 < algorithm.mismatch.icepop.high is needed, got 2.0",
    ),
    ({"algorithm.mismatch": {"icepop": {"low": -0.5}}}, "icepop.low must be > 0, got -0.5"),
    (
        {"algorithm.mismatch": {"geometric": {"low": 1.01}}},
        "algorithm.mismatch.geometric.low <= 1 <= algorithm.mismatch.geometric.high",
    ),
    ({"algorithm.mismatch": {"geometric": {"veto": 1.0}}}, "geometric.veto must be < 1 "),
    ({"algorithm.mismatch": {"geometric": {"veto": -1}}}, "geometric.veto must be >= 0"),
    ({"rollout.top_p": 0.9, "algorithm.old_logprobs": "engine"}, "needs untruncated sampling"),
    ({"rollout.top_k": 5, "algorithm.old_logprobs": "engine"}, "needs untruncated sampling"),
    ({"algorithm.entropy": {"top_rho": 1.5}}, "top_rho must be in"),
    ({"algorithm.shaping": {"reward_clip": -1.0}}, "reward_clip must be > 0"),
    ({"algorithm.shaping": {"overlong": {"factor": 1.0}}}, "overlong needs buffer"),
    (
        {"algorithm.shaping": {"dynamic_sampling": {"enabled": False, "max_draws": 3}}},
        "dynamic sampling is disabled",
    ),
    (
        {
            "algorithm.advantage.estimator": "reinforce_pp",
            "rollout.n": 1,
            "algorithm.shaping": {"dynamic_sampling": {"enabled": True}},
        },
        "dynamic sampling needs",
    ),
    ({"engine": {"backend": "vllm", "max_kv_tokens": 64}}, "does not apply"),
    ({"engine": {"backend": "sglang"}}, "engine.backend=sglang runs on CUDA GPUs only"),
    (
        {"engine": {"backend": "sglang", "tensor_parallel_size": 2}},
        "engine.tensor_parallel_size does not apply to engine.backend=sglang",
    ),
    ({"eval_dataset": None}, "needs an eval_dataset"),
    ({"eval.accuracy_reward": "acc"}, "is not a reward function"),
    ({"rollout.temperature": 0.0}, "rollout.temperature must be > 0"),
    ({"train.micro_batch_size": 0}, "train.micro_batch_size must be >= 1"),
    ({"train.mini_batch_size": 0}, "train.mini_batch_size must be >= 1"),
    ({"rollout.max_tokens": 0}, "rollout.max_tokens must be >= 1"),
    ({"log_every": 0}, "log_every must be >= 1"),
    ({"lr_scheduler": {"min_lr_ratio": 2.0}}, "lr_scheduler.min_lr_ratio must be in"),
    ({"lr_scheduler": {"warmup_steps": 50}}, "lr_scheduler.warmup_steps=50 is more than max_steps"),
    ({"resume": True}, "no checkpoint found"),
    # What a user supplies: component arguments, paths, the device, names, override syntax.
    ({"optimizer.lr": -1e-3}, "optimizer.lr must be >= 0, got -0.001"),
    ({"optimizer.weight_decay": -0.1}, "optimizer.weight_decay must be >= 0, got -0.1"),
    ({"optimizer.betas": [0.9, 1.5]}, "torch.optim.AdamW refuses its arguments: Invalid beta"),
    (
        {
            "algorithm.advantage.estimator": "gae",
            "critic": {"optimizer": {"_component_": "torch.optim.AdamW", "lr": -1.0}},
        },
        "critic.optimizer.lr must be >= 0, got -1.0",
    ),
    ({"model.path": "/etc"}, "model.path='/etc' is not a model directory: it has no config.json"),
    ({"model.path": "/no_such_model"}, "model.path='/no_such_model' does not exist"),
    (
        {"algorithm.advantage.estimator": "gae", "critic": {"path": "/etc", "optimizer": _ADAM}},
        "critic.path='/etc' is not a model directory",
    ),
    ({"dataset.max_prompt_length": 0}, "dataset.max_prompt_length must be >= 1, got 0"),
    ({"sequence_parallel": 2}, "sequence_parallel=2 does not divide the world size 1"),
    (
        {"trajectory_tokens": True},
        "trajectory_tokens: true adds to the trajectory files: set trajectories: true",
    ),
    ({"reward.weights": {"acc": 1.0}}, "reward.weights.acc: no reward function named 'acc'"),
    ({"reward.routes": {"math": ["acc"]}}, "reward.routes.math: no reward function named 'acc'"),
    ({"reward.weights": {"digits": ".5"}}, "reward.weights.digits must be a finite number"),
    pytest.param(
        {"device": "cuda"},
        "device=cuda but CUDA is not available on this machine; use device=cpu",
        marks=pytest.mark.skipif(_torch_cuda(), reason="CUDA is available here"),
        id="device=cuda without CUDA",
    ),
    # key=value overrides on the command line (a string row: given to both commands).
    ("optimizer.betas=[0.9", "override 'optimizer.betas=[0.9': the value of optimizer.betas is"),
    ("optimizer.lr=-1", "override 'optimizer.lr=-1': optimizer.lr must be >= 0, got -1"),
    ("model.path=/etc", "override 'model.path=/etc': model.path='/etc' is not a model directory"),
]


@pytest.mark.parametrize(
    "over,msg", BAD_CONFIGS, ids=[r[1] if len(r) == 2 else r.id for r in BAD_CONFIGS]
)
def test_validate_and_run_refuse_the_same_configs(tmp_path, assets, capsys, over, msg):
    args = over.split() if isinstance(over, str) else []
    cfg = _config(tmp_path, assets, **({} if args else over))
    assert cli.main(["validate", str(cfg), *args]) == 2
    validate_err = capsys.readouterr().err
    assert msg in validate_err, validate_err
    assert cli.main(["run", "grpo", "--config", str(cfg), *args]) == 2
    run_err = capsys.readouterr().err
    assert run_err == validate_err
    assert "Traceback" not in run_err and len(run_err.strip().splitlines()) <= 2, run_err
    assert not (tmp_path / "out").exists()  # refused before any side effect


def test_sequence_parallel_refuses_a_critic(tmp_path, assets, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: SP 2 fits the launch
    over = {"algorithm.advantage.estimator": "gae", "critic": {"optimizer": _ADAM}}
    cfg = _config(tmp_path, assets, sequence_parallel=2, **over)
    assert cli.main(["validate", str(cfg)]) == 2
    assert "sequence_parallel=2 does not support a GAE critic" in capsys.readouterr().err


def test_validate_and_run_refuse_the_same_names(tmp_path, assets, capsys):
    """A misspelled recipe or config name: one line with the close names, exit 2 (as argparse
    and config errors), the same from `validate` and `run`."""
    cfg = str(_config(tmp_path, assets))
    for validate, run, msg in [
        (["--recipe", "grpp", cfg], ["grpp", "--config", cfg], "unknown recipe 'grpp'"),
        (["tiny/add_grpp"], ["grpo", "--config", "tiny/add_grpp"], "did you mean tiny/add_grpo"),
        (["nope.yaml"], ["grpo", "--config", "nope.yaml"], "config file not found: nope.yaml"),
    ]:
        assert cli.main(["validate", *validate]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.splitlines()) == 1, err
        assert cli.main(["run", *run]) == 2
        assert capsys.readouterr().err == err


def test_a_model_path_a_prepare_step_did_not_write_is_refused_before_loading(
    tmp_path, assets, capsys
):
    """A local model path whose parent is not there either validates (an earlier run of a
    pipeline writes it); the run refuses it after its prepare steps, in the same words."""
    cfg = _config(tmp_path, assets, **{"model.path": str(tmp_path / "sft" / "final")})
    assert cli.main(["validate", str(cfg)]) == 0
    capsys.readouterr()
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"model.path='{tmp_path / 'sft' / 'final'}' does not exist" in err, err
    assert "Traceback" not in err and err.startswith(f"lightrft: {cfg}:"), err


def test_null_means_default(tmp_path, assets):
    """Every optional key may be null and then takes its default (seed, log_every, dtype,
    warmup, ...): the run equals one without those keys."""
    nulls = [
        "seed=null",
        "log_every=null",
        "model.dtype=null",
        "lr_scheduler.warmup_steps=null",
        "lr_scheduler.min_lr_ratio=null",
        "keep_last=null",
        "train.ppo_epochs=null",
        "train.packing=null",
        "rollout.temperature=null",
        "engine.sleep_level=null",
        "algorithm.policy_loss.objective=null",
        "metrics.tensorboard=null",
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base = _train_rows(_run(tmp_path / "a", assets, max_steps=1, eval=None, eval_dataset=None))
    nulled = _train_rows(
        _run(tmp_path / "b", assets, *nulls, max_steps=1, eval=None, eval_dataset=None)
    )
    for key in ("train/loss", "train/grad_norm", "reward/total/mean"):
        assert nulled[1][key] == base[1][key], key


NEW_OBJECTIVE = """
import torch as _torch
from lightrft.algorithms import OBJECTIVES as _OBJECTIVES, Objective as _Objective


def _reinforce(logprobs, old, log_ratio, adv, valid, *, clip_low, clip_high, dual_clip):
    flags = {"low": _torch.zeros_like(valid), "high": _torch.zeros_like(valid)}
    return -adv * logprobs, log_ratio.exp(), flags


_OBJECTIVES["reinforce"] = _Objective(
    _reinforce, {"clip_low": 0.0, "clip_high": 0.0, "agg": "token_mean"}
)
"""


def test_a_new_objective_is_one_registry_entry_in_a_copied_recipe(tmp_path, assets, capsys):
    """docs/grpo.md: an objective added near the imports of a copied recipe validates, runs and
    trains; the shipped recipe does not know it."""
    from lightrft.algorithms import OBJECTIVES
    from lightrft.cli import recipes_dir

    source = (recipes_dir() / "grpo.py").read_text()
    anchor = "# " + "-" * 82 + " config"
    copy = tmp_path / "my_grpo.py"
    copy.write_text(source.replace(anchor, NEW_OBJECTIVE + "\n" + anchor, 1))
    cfg = _config(tmp_path, assets, max_steps=1, eval=None, eval_dataset=None)
    over = "algorithm.policy_loss.objective=reinforce"
    try:
        assert cli.main(["run", str(copy), "--config", str(cfg), over]) == 0
        row = _train_rows(read_metrics(tmp_path / "out"))[1]
        _finite(row, "train/loss", "train/grad_norm", "train/policy_loss")
        assert row["train/clip_frac"] == 0.0
    finally:
        OBJECTIVES.pop("reinforce", None)
    assert cli.main(["run", "grpo", "--config", str(cfg), over]) == 2
    assert "reinforce" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override,msg",
    [
        ("reward.functions.accuracy.correctt=2", "takes no argument 'correctt'"),
        ("reward.functions.digits._component_=test_grpo.NoSuchReward", "cannot be imported"),
    ],
)
def test_nested_reward_components_are_checked_before_any_model_loads(
    tmp_path, assets, capsys, override, msg
):
    cfg = _config(tmp_path, assets)
    assert cli.main(["validate", str(cfg), override]) == 2
    err = capsys.readouterr().err
    assert msg in err and "reward.functions." in err, err
    assert cli.main(["run", "grpo", "--config", str(cfg), override]) == 2
    assert capsys.readouterr().err == err
    assert not (tmp_path / "out").exists()


def test_launcher_validates_once_before_starting_workers(tmp_path, assets, capsys):
    """`lightrft run --nproc_per_node 2`: a config error is one clean message and exit 2 from
    the launcher (no worker starts), including the world-size rule."""
    cfg = _config(tmp_path, assets, **{"rollout.prompts_per_step": 3})
    assert cli.main(["run", "--nproc_per_node", "2", "grpo", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("lightrft:") == 1 and "multiple of the number of processes (2)" in err
    assert "Traceback" not in err
    assert cli.main(["run", "--nproc_per_node=2", "grpo", "--config", str(cfg), "seed=x"]) == 2
    assert "'seed' expects" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dr_grpo_norm_len_defaults_to_the_generation_budget(tmp_path, assets):
    """Dr.GRPO divides by a constant: rollout.max_tokens unless norm_len is set (never the
    longest response of a micro-batch, which would make the loss depend on the split)."""
    import runpy

    from lightrft import config as lconfig
    from lightrft.cli import recipes_dir

    build_options = runpy.run_path(str(recipes_dir() / "grpo.py"))["build_options"]
    over = {"algorithm.policy_loss.agg": "seq_mean_token_sum_norm", "rollout.max_tokens": 7}
    cfg, _ = lconfig.load(_config(tmp_path, assets, **over))
    assert build_options(cfg).algorithm.policy_loss.norm_len == 7
    cfg, _ = lconfig.load(_config(tmp_path, assets, **over), ["algorithm.policy_loss.norm_len=5"])
    assert build_options(cfg).algorithm.policy_loss.norm_len == 5
    cfg, _ = lconfig.load(_config(tmp_path, assets))
    assert build_options(cfg).algorithm.policy_loss.norm_len is None  # token_mean has no divisor


def test_reward_heads_and_function_metrics_are_logged(tmp_path, assets):
    """Every head of a multi-head reward and a function's own metrics reach metrics.jsonl:
    head b = 2 x head a sample by sample, so its mean and std are exactly twice a's."""
    rows = _run(
        tmp_path,
        assets,
        **{"reward.functions.digits._component_": "test_grpo.TwoHeadReward"},
    )
    step = _train_rows(rows)[1]
    a, b = step["reward/digits/a/mean"], step["reward/digits/b/mean"]
    assert a == pytest.approx(step["reward/digits/mean"]) and b == pytest.approx(2 * a)
    assert step["reward/digits/b/std"] == pytest.approx(2 * step["reward/digits/a/std"])
    assert step["reward/digits/calls"] == 1.0
    assert step["reward/digits/size"] == 8.0  # 2 prompts x 4 samples, one call
    assert not any("digits/a" in k for k in rows[-1] if k.startswith("eval/"))


def _two_rank_grpo_lora(rank: int, world_size: int, cfg_path: str) -> None:

    import torch
    from torch.distributed.tensor import DTensor

    from lightrft import config as lconfig
    from lightrft.engine.sync import iter_weight_buckets

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("grpo", cfg)
    recipe.setup(cfg)
    assert recipe.ref is None  # the reference is the actor with its adapters off
    assert all(isinstance(p, DTensor) for p in recipe.model.parameters())
    recipe.train()
    recipe.logger.close()
    # The engine holds the merged weights under HF names.
    engine = dict(recipe.source.parts.engine.engine.model.named_parameters())
    merged = {n: t.clone() for b in iter_weight_buckets(recipe.model) for n, t in b}
    assert set(merged) == set(engine)
    for n, t in merged.items():
        assert torch.equal(engine[n].data, t.to(engine[n].dtype)), n
    if rank == 0:
        train = _train_rows(read_metrics(Path(cfg.output_dir)))
        # lora_B starts at 0: the first step's policy is the reference exactly; it moves after
        # the first step with a gradient (a step whose groups all score alike has none).
        assert train[1]["train/kl"] == 0.0
        moved = [s for s in (1, 2) if train[s]["train/grad_norm"] > 0]
        assert moved, "no step had a reward signal"
        assert all(train[s]["train/kl"] > 0.0 for s in range(moved[0] + 1, 4))


def test_lora_two_gloo_processes(two_rank_grpo):
    pytest.importorskip("peft")
    import torch.distributed.checkpoint as dcp

    out = two_rank_grpo["lora"] / "out"  # _two_rank_grpo_lora checked the weights and the kl
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert (out / "final_merged" / "model.safetensors").is_file()
    keys = dcp.FileSystemReader(str(out / "checkpoints" / "step_000002")).read_metadata()
    params = [k for k in keys.state_dict_metadata if k.startswith("model.model.model.")]
    assert params and all(".lora_" in k for k in params)  # trainable parameters only
