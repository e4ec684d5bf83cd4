"""The DPO recipe on vision-language pairs: the same path as text, images in every sequence."""

from __future__ import annotations

import json

import torch
import yaml
from _dist import build_recipe

from lightrft import cli
from lightrft import config as lconfig
from lightrft.training import read_metrics


def _pairs(image_files, n: int, rejected: str | None = None) -> list[dict]:
    """The picture's colour over another colour's name (or over ``rejected``)."""
    names = ["red", "green", "blue"]
    return [
        {
            "prompt": "Which colour is the picture? <image>",
            "images": [image_files[k % 3].name],
            "chosen": names[k % 3],
            "rejected": rejected or names[(k + 1) % 3],
        }
        for k in range(n)
    ]


def _config(tmp_path, data: str, model: str, **over) -> str:
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "device": "cpu",
        "model": {"path": model},
        "loss": {"type": "dpo", "beta": 0.5},
        "dataset": {"_component_": "lightrft.data.PreferenceDataset", "path": data},
        "eval_dataset": {"_component_": "lightrft.data.PreferenceDataset", "path": data},
        "batch_size": 4,
        "epochs": 4,
        "max_steps": 4,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3},
        "eval_every": 4,
        "metrics": {"tensorboard": False},
        **over,
    }
    path = tmp_path / "dpo.yaml"
    path.write_text("# lightrft run dpo --config dpo.yaml\n" + yaml.safe_dump(cfg))
    return str(path)


def test_vlm_sequence_logprobs_are_the_vlm_forward_with_its_images(tiny_vlm, image_files, tmp_path):
    from lightrft.models.forward import media_forward_kwargs
    from lightrft.models.loading import load_model
    from lightrft.training.preference import sequence_logprobs

    model = str(tiny_vlm("qwen2_vl"))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _pairs(image_files, 4)))
    cfg, _ = lconfig.load(_config(tmp_path, str(data), model))
    recipe = build_recipe("dpo", cfg)
    recipe.setup(cfg)
    batch = next(iter(recipe.pairs.eval_loader))
    with torch.no_grad():
        sums, counts = sequence_logprobs(recipe.model, batch, "cpu")
    vlm = load_model(model).eval()
    want = []
    with torch.no_grad():
        for i in range(len(batch["index"])):
            it = recipe.pairs.eval_dataset[int(batch["index"][i])]
            for seq, start in zip(it["sequences"], it["starts"], strict=True):
                ids = seq[None]
                kw = media_forward_kwargs(vlm, ids, attention_mask=torch.ones_like(ids),
                                          position_ids=None, media=it["media"])  # fmt: skip
                logp = vlm(input_ids=ids, **kw).logits[0, :-1].log_softmax(-1)
                want.append(logp.gather(-1, ids[0, 1:, None])[start - 1 :, 0].sum())
    torch.testing.assert_close(sums, torch.stack(want), atol=1e-4, rtol=1e-5)
    assert (counts > 0).all()
    recipe.logger.close()


def test_dpo_recipe_trains_on_image_pairs(tiny_vlm, image_files, tmp_path):
    data = tmp_path / "train.jsonl"
    # A rejected answer a random model learns to dislike in a few steps: the run shows learning;
    # the test above shows that the images reach the log-probs.
    rows = _pairs(image_files, 12, rejected="no idea")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(tmp_path, str(data), str(tiny_vlm("qwen2_vl")), max_steps=6, eval_every=6)
    assert cli.main(["run", "dpo", "--config", cfg]) == 0
    rows = read_metrics(tmp_path / "out")
    train = [r for r in rows if "train/loss" in r]
    assert train[0]["train/loss"] > train[-1]["train/loss"]
    assert train[-1]["train/rewards/accuracies"] == 1.0
    evals = [r for r in rows if "eval/rewards/margins" in r]
    assert evals[-1]["eval/rewards/margins"] > evals[0]["eval/rewards/margins"]
    assert (tmp_path / "out" / "final" / "processor_config.json").is_file()
