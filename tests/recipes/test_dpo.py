"""The DPO recipe through the real CLI, in-process: learning, metrics, the reference (frozen copy,
LoRA adapters off, precomputed cache), resume, 2 gloo ranks, and bad input refused by name."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _dist import build_recipe, run_distributed

from lightrft import cli
from lightrft.training import read_metrics

WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "quiet", "lamp", "north", "tiger"]


def _pairs(n: int, seed: int) -> list[dict]:
    """The chosen answer ends in 'yes', the rejected one in 'no'."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(WORDS, 2)
        out.append({"prompt": f"{a} {b}?", "chosen": f"{b} {a} yes", "rejected": f"{b} {a} no"})
    return out


def _config(tmp: Path, *, pairs: list[dict] | None = None, **overrides) -> Path:
    data = tmp / "data"
    data.mkdir(parents=True, exist_ok=True)
    train = pairs if pairs is not None else _pairs(64, 0)
    for split, rows in (("train", train), ("test", _pairs(16, 1))):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "output_dir": str(tmp / "out"),
        "seed": 0,
        "device": "cpu",
        "prepare": [
            {
                "_component_": "lightrft.tasks.ensure_tiny_model",
                "out_dir": str(tmp.parent / "model"),
                "layers": 2,
                "hidden": 32,
                "heads": 2,
                "kv_heads": 1,
                "max_positions": 128,
            }
        ],
        "model": {"path": str(tmp.parent / "model")},
        "dataset": {
            "_component_": "lightrft.data.PreferenceDataset",
            "path": str(data / "train.jsonl"),
            "max_length": 64,
        },
        "eval_dataset": {
            "_component_": "lightrft.data.PreferenceDataset",
            "path": str(data / "test.jsonl"),
        },
        "loss": {"type": "dpo", "beta": 0.5},
        "batch_size": 8,
        "gradient_accumulation_steps": 2,
        "epochs": 1,
        "max_steps": 4,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 1},
        "clip_grad_norm": 1.0,
        "log_every": 1,
        "eval_every": 2,
        "metrics": {"tensorboard": False},
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    path = tmp / "dpo.yaml"
    path.write_text("# lightrft run dpo --config dpo.yaml\n" + yaml.safe_dump(cfg))
    return path


def _train(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "train/loss" in r]


def _run(tmp: Path, **overrides) -> list[dict]:
    cfg = _config(tmp, **overrides)
    assert cli.main(["run", "dpo", "--config", str(cfg)]) == 0
    return read_metrics(tmp / "out")


def test_dpo_learns_logs_trl_metrics_and_exports(tmp_path):
    rows = _run(tmp_path / "a")
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    first = train[0]
    # Step 1: the policy is the reference, every implicit reward 0, the loss log 2.
    assert first["train/loss"] == pytest.approx(0.693147, abs=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[f"train/{k}"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/logps/chosen"] < 0 and first["train/logps/rejected"] < 0
    last = train[-1]
    assert last["train/loss"] < 0.5 and last["train/rewards/margins"] > 0.5
    assert last["train/rewards/accuracies"] == 1.0
    evals = [r for r in rows if "eval/rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert evals[-1]["eval/rewards/accuracies"] == 1.0 > evals[0]["eval/rewards/accuracies"]
    assert any(r.get("data/pairs") == 64 for r in rows)
    assert (tmp_path / "a" / "out" / "final" / "config.json").is_file()


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in _train(out)}


def test_resume_gives_the_uninterrupted_loss_curve(tmp_path):
    full = tmp_path / "full"
    over = dict(save_every=2, keep_last=5, eval_every=None)
    assert cli.main(["run", "dpo", "--config", str(_config(full, **over))]) == 0
    reference = _losses(full / "out")
    assert sorted(reference) == [1, 2, 3, 4]
    crashed = tmp_path / "crashed"
    ckpts = crashed / "out" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(full / "out" / "checkpoints" / "step_000002", ckpts / "step_000002")
    (ckpts / "latest").write_text("step_000002")
    cfg = _config(full, output_dir=str(crashed / "out"), resume=True, **over)
    assert cli.main(["run", "dpo", "--config", str(cfg)]) == 0
    resumed = _losses(crashed / "out")
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == reference[s] for s in (3, 4)), (resumed, reference)


@pytest.mark.parametrize(
    ("loss", "first"),
    [
        # At step 1 the policy is the reference: h = 0, so IPO's loss is (1 / (2 beta))^2 = 1,
        # cDPO's log 2 whatever the smoothing, KTO's (z = 0) 1 - sigmoid(0) = 0.5.
        ({"type": "ipo", "beta": 0.5}, 1.0),
        ({"type": "cdpo", "beta": 0.5, "label_smoothing": 0.2}, 0.693147),
        ({"type": "rdpo", "beta": 0.5, "label_smoothing": 0.2}, 0.693147),
        ({"type": "kto", "beta": 0.5}, 0.5),
        ({"type": "simpo", "beta": 2.0, "gamma": 0.5}, None),
        ({"type": "orpo", "beta": 0.1}, None),
    ],
)
def test_every_loss_trains_and_separates_the_pairs(tmp_path, loss, first):
    rows = _run(tmp_path / "x", loss=loss, max_steps=6, eval_every=6)
    train = [r for r in rows if "train/loss" in r]
    if first is not None:
        assert train[0]["train/pref_loss"] == pytest.approx(first, abs=1e-5)
    if loss["type"] == "orpo":  # ORPO adds the chosen NLL with weight 1
        assert train[0]["train/loss"] == pytest.approx(
            train[0]["train/pref_loss"] + train[0]["train/nll"], rel=1e-5
        )
    assert train[-1]["train/pref_loss"] < train[0]["train/pref_loss"]
    assert train[-1]["train/rewards/margins"] > train[0]["train/rewards/margins"]
    evals = [r for r in rows if "eval/rewards/margins" in r]
    assert evals[-1]["eval/rewards/margins"] > evals[0]["eval/rewards/margins"]
    if loss["type"] != "kto":  # KTO has no pairs to count (TRL logs none either)
        assert evals[-1]["eval/rewards/accuracies"] == 1.0


def test_kto_on_unpaired_rows_and_a_row_without_label_is_refused(tmp_path, capsys):
    rows = []
    for p in _pairs(64, 0):
        rows.append({"prompt": p["prompt"], "completion": p["chosen"], "label": True})
        rows.append({"prompt": p["prompt"], "completion": p["rejected"], "label": False})
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[::2] + rows[1::2][:40]))
    ds = {"_component_": "lightrft.data.UnpairedPreferenceDataset", "path": str(data)}
    out = _run(tmp_path / "k", loss={"type": "kto", "beta": 0.5}, dataset=ds, eval_dataset=ds,
               max_steps=6, eval_every=6)  # fmt: skip
    assert any(r.get("data/desirable") == 64 and r.get("data/undesirable") == 40 for r in out)
    train = [r for r in out if "train/loss" in r]
    assert train[0]["train/loss"] == pytest.approx(0.5, abs=1e-5)  # 1 - sigmoid(0) at the start
    assert train[-1]["train/rewards/margins"] > 0.1
    rows[3].pop("label")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(tmp_path / "k2", loss={"type": "kto"}, dataset=ds)
    assert cli.main(["run", "dpo", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "kto.jsonl line 4: field 'label' must be true (desirable) or false" in err


def test_precomputed_reference_gives_the_same_run_and_its_key_catches_changes(tmp_path):
    base = _losses_of(_run(tmp_path / "live", eval_every=None))
    rows = _run(tmp_path / "pre", reference={"precompute": True}, eval_every=None)
    cache = tmp_path / "pre" / "out" / "reference_logps.train.pt"
    saved = torch.load(cache, weights_only=True)
    torch.testing.assert_close(_losses_of(rows), base, rtol=1e-5, atol=1e-6)
    # A second run reads the cache (the same key); a changed model or data makes a new one.
    from lightrft.training.preference import IndexedPreferences, reference_cache_key

    class _Items:
        def __init__(self, seqs):
            self._items = [{"sequences": s, "starts": [1] * len(s)} for s in seqs]

        def __len__(self):
            return len(self._items)

    model = tmp_path / "model"
    a = IndexedPreferences(_Items([[torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])]]))
    b = IndexedPreferences(_Items([[torch.tensor([1, 2, 3]), torch.tensor([1, 2, 5])]]))
    key = reference_cache_key(model, a, "float32")
    assert key == reference_cache_key(model, a, "float32")
    assert key != reference_cache_key(model, b, "float32")  # other data
    assert key != reference_cache_key(model, a, "bfloat16")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0")  # another model
    assert key != reference_cache_key(model, a, "float32")
    assert saved["key"] and saved["table"].shape == (64, 2, 2)


def _losses_of(rows: list[dict]) -> torch.Tensor:
    return torch.tensor([r["train/loss"] for r in rows if "train/loss" in r])


_LORA = {"rank": 4, "alpha": 8}


def test_lora_reference_is_the_base_model_with_adapters_off(tmp_path):
    from omegaconf import OmegaConf

    from lightrft import config as lconfig
    from lightrft.training.preference import sequence_logprobs

    cfg_path = _config(tmp_path / "lora", lora=_LORA, max_steps=3, eval_every=None)
    cfg, _ = lconfig.load(str(cfg_path))
    recipe = build_recipe("dpo", cfg)
    recipe.setup(cfg)
    assert recipe.ref is None  # no frozen copy: the policy with its adapters off
    recipe.train()
    recipe.logger.close()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(OmegaConf.select(cfg, "model.path")).eval()
    batch = next(iter(recipe.pairs.eval_loader))
    ref_sums, _ = recipe.ref_logps(batch)
    with torch.no_grad():
        base_sums, _ = sequence_logprobs(base, batch, "cpu")
        policy_sums, _ = sequence_logprobs(recipe.model, batch, "cpu")
    torch.testing.assert_close(ref_sums, base_sums, atol=1e-5, rtol=0)
    assert (policy_sums - base_sums).abs().max() > 1e-3  # the adapters trained


def _first_loss(rank: int, world_size: int, cfg_path: str, out: str) -> None:
    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("dpo", cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.logger.close()
    torch.distributed.barrier()


def test_two_gloo_processes_give_the_one_process_first_step_loss(tmp_path):
    """FSDP2 over 2 gloo ranks: each reads half of a step's pairs; the first step's loss (and
    its metrics) over the whole step equals 1 process reading all of them, to 1e-5. Step 1 is
    the reference itself (loss log 2), so a perturbed start (a few SFT-like steps would do; here
    a reference copy at another path) makes the number informative."""
    from transformers import AutoModelForCausalLM

    from lightrft.tasks import ensure_tiny_model

    one, two = tmp_path / "one", tmp_path / "two"
    ensure_tiny_model(tmp_path / "model", layers=2, hidden=32, heads=2, kv_heads=1,
                      max_positions=128)  # fmt: skip
    # A reference that differs from the start: the first loss is then not log 2.
    ref = tmp_path / "ref"
    shutil.copytree(tmp_path / "model", ref)
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(ref)
    over = dict(max_steps=1, eval_every=None, reference={"path": str(ref)})
    cfg1 = _config(one, **over)
    assert cli.main(["run", "dpo", "--config", str(cfg1)]) == 0
    cfg2 = _config(two, batch_size=4, **over)  # 4 pairs x 2 accum x 2 ranks = one step of 16
    run_distributed(_first_loss, str(cfg2), str(two))
    # The same on 2 ranks with the reference precomputed (each rank its share, summed).
    pre = tmp_path / "pre"
    over["reference"] = {"path": str(ref), "precompute": True}
    run_distributed(_first_loss, str(_config(pre, batch_size=4, **over)), str(pre))
    assert (pre / "out" / "reference_logps.train.pt").is_file()
    a = _train(one / "out")[0]
    assert abs(a["train/loss"] - 0.693147) > 1e-3
    for b in (_train(two / "out")[0], _train(pre / "out")[0]):
        for k in ("train/loss", "train/rewards/margins", "train/logps/chosen"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k


def test_bad_input_is_refused_by_name_before_models_load(tmp_path, capsys):
    def refused(match: str, **over) -> None:
        cfg = _config(tmp_path / "bad", **over)
        assert cli.main(["run", "dpo", "--config", str(cfg)]) == 2
        assert match in capsys.readouterr().err

    refused("loss.beta must be > 0", loss={"beta": 0.0})
    refused("reference: loss.type=simpo uses no reference", loss={"type": "simpo"},
            reference={"path": None})  # fmt: skip
    refused("reference: loss.type=orpo uses no reference", loss={"type": "orpo"},
            reference={"precompute": True})  # fmt: skip
    refused("reference.precompute: loss.type=kto", loss={"type": "kto"},
            reference={"precompute": True})  # fmt: skip
    refused("loss.gamma does not apply to loss 'dpo'", loss={"gamma": 1.0})
    assert not (tmp_path / "bad" / "out" / "checkpoints").exists()


def test_identical_pairs_are_counted_and_skipped(tmp_path):
    pairs = _pairs(64, 0)
    for p in pairs[:5]:
        p["rejected"] = p["chosen"]
    rows = _run(tmp_path / "same", pairs=pairs, max_steps=1, eval_every=None)
    assert any(r.get("data/identical") == 5 and r.get("data/pairs") == 59 for r in rows)


def test_pairs_labelled_for_a_reward_head_train(tmp_path):
    # A reward model's multi-head data: DPO reads every pair, whatever head it is labelled for.
    pairs = [{**p, "head": "helpful"} for p in _pairs(64, 0)]
    rows = _run(tmp_path / "heads", pairs=pairs, max_steps=1, eval_every=None)
    assert any("train/loss" in r for r in rows)


def test_lora_precomputed_reference_is_the_base_model(tmp_path):
    """Under LoRA the precomputed table comes from the policy with its adapters off: item 0's
    row equals the base model's summed log-probs and token counts of its pair."""
    from transformers import AutoModelForCausalLM

    from lightrft import config as lconfig
    from lightrft.training.preference import PairCollator, sequence_logprobs

    over = dict(lora=_LORA, max_steps=1, eval_every=None, reference={"precompute": True})
    cfg, _ = lconfig.load(str(_config(tmp_path / "lp", **over)))
    recipe = build_recipe("dpo", cfg)
    recipe.setup(cfg)
    recipe.logger.close()
    table = recipe.caches["train"]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    batch = PairCollator(recipe.tokenizer.pad_token_id)([recipe.pairs.dataset[0]])
    with torch.no_grad():
        sums, counts = sequence_logprobs(base, batch, "cpu")
    torch.testing.assert_close(table[0, :, 0], sums, atol=1e-5, rtol=0)
    torch.testing.assert_close(table[0, :, 1], counts)
