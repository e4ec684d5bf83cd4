"""On-policy distillation as an objective of the GRPO recipe, through the real CLI in-process."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_grpo import _config, _run, assets  # noqa: F401,F811  (the module's fixture)

from lightrft import cli

DISTILL = {
    "rollout.n": 1,  # no groups needed
    "rollout.prompts_per_step": 4,
    "rollout.temperature": 1.0,
    "algorithm.advantage.estimator": "reinforce_pp",
    "eval": None,
    "eval_dataset": None,
}


def _teacher(src, out, scale: float = 0.0):
    """A copy of the student's checkpoint, its weights moved by ``scale`` x noise."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src / "model", out)
    if scale:
        m = AutoModelForCausalLM.from_pretrained(out)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * torch.randn_like(p))
        m.save_pretrained(out)
    return str(out)


def _first_token_kl(student: str, teacher: str, tokenizer: str, prompts: list[str]) -> float:
    """Mean exact KL(student || teacher) of the first response token over ``prompts``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    s = AutoModelForCausalLM.from_pretrained(student).eval()
    t = AutoModelForCausalLM.from_pretrained(teacher).eval()
    total = 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
            ls, lt = s(ids).logits[0, -1].log_softmax(-1), t(ids).logits[0, -1].log_softmax(-1)
            total += float((ls.exp() * (ls - lt)).sum())
    return total / len(prompts)


def test_student_moves_towards_the_teacher(tmp_path, assets):  # noqa: F811
    """20 steps of 40 one-sample prompts against a perturbed copy: the exact reverse KL of the
    first answer token to the teacher falls (0.397 -> 0.341 when written; the per-step sampled
    estimate is too noisy over so few tokens to assert on)."""
    teacher = _teacher(assets, tmp_path / "teacher", scale=0.15)
    over = {**DISTILL, "rollout.prompts_per_step": 40, "train.micro_batch_size": 64}
    over.update({"optimizer.lr": 1e-2, "lr_scheduler.min_lr_ratio": 1.0, "max_steps": 20})
    rows = _run(tmp_path, assets, **over, **{"distillation.path": teacher})
    kl = [r["train/distill/reverse_kl"] for r in rows if "train/distill/reverse_kl" in r]
    assert len(kl) == 20 and all(k == k for k in kl)  # logged every step, finite
    prompts = [json.loads(x)["prompt"] for x in open(assets / "data" / "train.jsonl")]
    args = (teacher, str(assets / "model"), prompts)
    before = _first_token_kl(str(assets / "model"), *args)
    after = _first_token_kl(str(tmp_path / "out" / "final"), *args)
    assert after < 0.95 * before, (before, after)


def test_the_student_as_its_own_teacher_gives_zero_advantages(tmp_path, assets):  # noqa: F811
    teacher = _teacher(assets, tmp_path / "teacher")
    over = {**DISTILL, "max_steps": 1, "distillation.path": teacher}
    rows = _run(tmp_path, assets, **over)
    step = next(r for r in rows if "train/distill/reverse_kl" in r)
    assert abs(step["train/distill/reverse_kl"]) < 1e-4  # engine vs trainer log-probs only
    assert abs(step["train/advantage/abs_mean"]) < 1e-4


def test_a_teacher_with_another_tokenizer_is_refused_before_models_load(tmp_path, assets, capsys):  # noqa: F811
    from transformers import AutoTokenizer

    teacher = _teacher(assets, tmp_path / "teacher")
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(teacher)
    cfg = _config(tmp_path, assets, **DISTILL, **{"distillation.path": teacher})
    with pytest.raises(ValueError, match="distillation.path: the teacher's vocabulary differs"):
        cli.main(["run", "grpo", "--config", str(cfg)])
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_missing_teacher_is_refused_by_its_key(tmp_path, assets, capsys):  # noqa: F811
    cfg = _config(tmp_path, assets, **DISTILL, **{"distillation.path": str(tmp_path / "none")})
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 2
    assert "distillation.path" in capsys.readouterr().err


pytest.importorskip("transformers")


def test_a_distillation_section_without_a_teacher_is_refused(tmp_path, assets, capsys):  # noqa: F811
    cfg = _config(tmp_path, assets, **DISTILL, **{"distillation.reward_weight": 0.5})
    assert cli.main(["run", "grpo", "--config", str(cfg)]) == 2
    assert "distillation.path: the distillation section needs the teacher's path" in (
        capsys.readouterr().err
    )


def test_a_teacher_that_does_not_fit_is_refused_before_models_load(tmp_path, assets):  # noqa: F811
    """The planner's estimate with the teacher's frozen shard (as the reference's) exceeds this
    machine's memory while without it the run fits: refused by name, from config.json alone
    (the teacher here claims 200 layers of width 65,536; no weights are read)."""
    teacher = _teacher(assets, tmp_path / "teacher")
    config = json.loads((tmp_path / "teacher" / "config.json").read_text())
    big = {"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 200}
    (tmp_path / "teacher" / "config.json").write_text(json.dumps({**config, **big}))
    (tmp_path / "teacher" / "model.safetensors").unlink()  # nothing to load
    cfg = _config(tmp_path, assets, **DISTILL, **{"distillation.path": teacher})
    with pytest.raises(ValueError, match="distillation.path=.*the teacher does not fit: its froz"):
        cli.main(["run", "grpo", "--config", str(cfg)])
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_the_planner_holds_the_teacher_like_the_reference(tmp_path, assets):  # noqa: F811
    """`lightrft plan`'s terms: the teacher's frozen shard, computed as the reference's."""
    import runpy

    from lightrft import config as lconfig
    from lightrft.cli import recipes_dir
    from lightrft.training.plan import Cluster, inputs_from_options, plan

    build_options = runpy.run_path(str(recipes_dir() / "grpo.py"))["build_options"]
    over = {**DISTILL, "distillation.path": _teacher(assets, tmp_path / "teacher"),
            "algorithm.kl.coef": 0.1}  # fmt: skip
    cfg, _ = lconfig.load(_config(tmp_path, assets, **over))
    p = inputs_from_options(build_options(cfg), recipe="grpo", cluster=Cluster(1, 1, 1 << 40),
                            device="cpu")  # fmt: skip
    terms = {t.name: t.device_bytes for t in plan(p).phases[-1].terms}
    assert terms["teacher parameters"] == terms["reference parameters"] > 0
