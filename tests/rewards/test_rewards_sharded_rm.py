"""Reward models sharded over the ranks (FSDP2) and scored collectively: the scores equal the
whole model's in one process, with unequal sample counts per rank and ranks without samples."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import torch
from _dist import run_distributed
from safetensors.torch import save_file

from lightrft.rewards import CombinedReward, RewardModel, Sample
from lightrft.rewards.reward_model import collective_plan

PROMPTS = ["What is 2+2?", "Name a colour.", "x", "Count to five.", "Hi", "?", "Why?"]
RESPONSES = ["4", "Blue, or maybe a deep red.", "yz", "1 2 3 4 5", "Hello there!", "no", "ok"]
SPLIT = 5  # rank 0 scores samples [0, 5), rank 1 [5, 7)


def test_collective_plan_gives_every_rank_the_same_media_kinds_at_each_forward():
    lengths = [5, 3, 9, 1, 4, 2, 8]
    kinds = [(), ("image",), (), (), ("image",), (), ()]
    plan = collective_plan(lengths, kinds, 2, 2)
    # Text first (sorted by length, 2 at a time), then the images; each group rounded up to a
    # multiple of 2 forwards with a filler (the group's shortest sample again, not real).
    assert plan == [
        ([3, 5], True),
        ([0, 6], True),
        ([2], True),
        ([3], False),
        ([1, 4], True),
        ([1], False),
    ]
    real = sorted(i for chunk, ok in plan if ok for i in chunk)
    assert real == list(range(len(lengths)))  # each sample scored once
    for step in range(0, len(plan), 2):  # what ranks 0 and 1 run side by side
        assert len({tuple(kinds[i] for i in plan[step + r][0])[0] for r in range(2)}) == 1
    assert collective_plan([], [], 4, 2) == []
    assert collective_plan([3], [()], 4, 4) == [([0], True)] + [([0], False)] * 3


def _attention_export(tiny: str, out) -> str:
    """A two-head, attention-pooled export of recipes/reward_model.py's layout (config block,
    ``pooler.*`` weights), with heads large enough that scores differ visibly."""
    from lightrft.models.export import export_hf
    from lightrft.models.loading import load_tokenizer
    from lightrft.models.reward import build_reward_net, set_reward_config

    torch.manual_seed(0)
    net = build_reward_net(tiny, heads=("helpful", "cost"), pooling="attention")
    with torch.no_grad():
        net.head.weight.normal_(0.0, 1.0)
        net.pooler.proj.weight.normal_(0.0, 1.0)
    set_reward_config(net, net.reward_config())
    export_hf(net, load_tokenizer(tiny), out)
    return str(out)


def _value_head_dir(tiny: str, out) -> str:
    shutil.copytree(tiny, out)
    g = torch.Generator().manual_seed(1)
    save_file(
        {"value_head.weight": torch.randn(1, 64, generator=g), "value_head.bias": torch.ones(1)},
        str(out / "value_head.safetensors"),
    )
    return str(out)


def _check_sharded(rm: RewardModel, world: int) -> None:
    """Every parameter is a DTensor and no rank holds a whole weight with more than one row;
    the vocabulary tables are out of FSDP2's groups (never gathered, :func:`_tables_seen`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    assert rm.collective
    for n, p in rm.net.named_parameters():
        assert isinstance(p, DTensor), n
        if p.shape[0] >= world:
            assert p.to_local().shape[0] < p.shape[0], n
    head = rm.net.get_output_embeddings()
    assert head is None or not isinstance(head, FSDPModule)
    assert not isinstance(rm.net.base.get_input_embeddings(), FSDPModule)


def _rows(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a vocab-row table that rank holds (torch.chunk's split)."""
    size = -(-vocab // world)
    return min(rank * size, vocab), min((rank + 1) * size, vocab)


def _tables_seen(rm: RewardModel, score: Callable[[RewardModel], object]) -> dict:
    """Run ``score(rm)`` and record the input embedding's and the LM head's
    weight (this rank's part: a plain tensor as the forward reads it) as they are while the
    model runs. Under FSDP2 the forward sees the whole, gathered tables."""
    from lightrft.models import reward as reward_mod

    seen: dict[str, torch.Tensor] = {}

    def record(name, weight):
        seen[name] = (weight.to_local() if hasattr(weight, "to_local") else weight).clone()

    embedding = rm.net.base.get_input_embeddings()
    hook = embedding.register_forward_pre_hook(lambda m, a: record("embedding", m.weight))
    original = reward_mod.likelihood_scores

    def spy(hidden, lm_head, *args):
        record("lm_head", lm_head.weight)
        return original(hidden, lm_head, *args)

    reward_mod.likelihood_scores = spy
    try:
        score(rm)
    finally:
        hook.remove()
        reward_mod.likelihood_scores = original
    return seen


def _text_worker(rank: int, world: int, attn: str, vhead: str, ref_file: str) -> None:
    refs = torch.load(ref_file)
    mine = slice(0, SPLIT) if rank == 0 else slice(SPLIT, len(PROMPTS))
    models = {"attn": RewardModel(attn, micro_batch_size=3), "vhead": RewardModel(vhead)}
    for name, rm in models.items():
        _check_sharded(rm, world)
        got = rm(Sample.batch(PROMPTS[mine], RESPONSES[mine]))  # 5 and 2 samples
        torch.testing.assert_close(got, refs[name]["all"][mine], rtol=0, atol=1e-6)
        for head, scores in rm.last_head_scores.items():
            torch.testing.assert_close(scores, refs[name][head][mine], rtol=0, atol=1e-6)
        # A rank without samples joins the other's forwards (3 and 0 samples).
        got = (
            rm(Sample.batch(PROMPTS[:3], RESPONSES[:3])) if rank == 0 else rm(Sample.batch([], []))
        )
        want = refs[name]["all"][:3] if rank == 0 else torch.empty(0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="give the device type only"):
        RewardModel(attn, device="cpu:0")  # refused before loading: ranks have their own device
    # Through CombinedReward, as the recipes call it: rank 1's samples all route to the
    # length reward, and it still calls the sharded model (with none of its own).
    reward = CombinedReward(
        {"rm": models["attn"], "len": lambda samples: [float(len(s.response)) for s in samples]},
        routes={"judged": ["rm"], "*": ["len"]},
    )
    assert reward.collective
    labels = ["judged"] * SPLIT if rank == 0 else ["plain"] * (len(PROMPTS) - SPLIT)
    out = reward(Sample.batch(PROMPTS[mine], RESPONSES[mine], labels=labels))
    want = refs["attn"]["all"][mine] if rank == 0 else torch.zeros(len(PROMPTS) - SPLIT)
    torch.testing.assert_close(out.parts["rm"], want, rtol=0, atol=1e-6)
    assert out.applied["rm"].all() == (rank == 0)
    # Eval with fewer prompts than ranks: rank 1 has no item and still joins the scoring.
    from types import SimpleNamespace

    from lightrft.evaluation import evaluate_items

    items = [{"prompt_ids": [1], "prompt": p} for p in PROMPTS[:2]] if rank == 0 else []
    done = [SimpleNamespace(text=r, token_ids=[1]) for r in RESPONSES[:2]] if rank == 0 else []
    records = evaluate_items(
        items,
        list(range(len(items))),
        lambda ids, c: done,
        CombinedReward({"rm": models["attn"]}),
        1,
    )
    want = refs["attn"]["all"][:2].tolist() if rank == 0 else []
    torch.testing.assert_close([r.rewards[0] for r in records], want, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sharded_text_reward_models_score_as_the_whole_model(tmp_path, tiny_model_dir):
    """An attention-pooled two-head classifier and a value-head model on 2 gloo processes with
    5 and 2 samples: every head's scores equal the one-process model's (fp32, 1e-6)."""
    attn = _attention_export(str(tiny_model_dir), tmp_path / "attn")
    vhead = _value_head_dir(str(tiny_model_dir), tmp_path / "vhead")
    refs = {}
    for name, rm in (
        ("attn", RewardModel(attn, micro_batch_size=3)),
        ("vhead", RewardModel(vhead)),
    ):
        assert not rm.collective  # one process: the whole model
        refs[name] = {"all": rm(Sample.batch(PROMPTS, RESPONSES)), **rm.last_head_scores}
        assert refs[name]["all"].std() > 1e-3
    torch.save(refs, tmp_path / "refs.pt")
    run_distributed(_text_worker, attn, vhead, str(tmp_path / "refs.pt"))


def _odd_vocab_lm(out, *, tie: bool) -> str:
    """A tiny qwen2 causal LM whose vocabulary (3 rows more than the tiny one's multiple of 16)
    divides by neither 2 nor 4 ranks, its LM head tied to the embedding or not."""
    from transformers import AutoModelForCausalLM

    from lightrft.tasks import make_tiny_model

    path = make_tiny_model(out, layers=2, hidden=64, tie_embeddings=tie)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(2)
    model.resize_token_embeddings(model.config.vocab_size + 3, mean_resizing=False)
    assert model.config.vocab_size % 2 and model.config.tie_word_embeddings == tie
    model.save_pretrained(path)
    return str(path)


def _tables(rm: RewardModel) -> dict[str, torch.Tensor]:
    """The whole model's input embedding and LM head (likelihood pooling only; the embedding
    itself when tied)."""
    head = rm.net.get_output_embeddings()
    tables = {"embedding": rm.net.base.get_input_embeddings().weight}
    return tables if head is None else {**tables, "lm_head": head.weight}


def _check_rows(seen: dict, tables: dict, rank: int, world: int) -> None:
    """Each table the forward read is exactly this rank's rows of the whole model's."""
    assert sorted(seen) == sorted(tables)
    for name, got in seen.items():
        start, stop = _rows(tables[name].shape[0], world, rank)
        torch.testing.assert_close(got, tables[name][start:stop], rtol=0, atol=0)


def _vocab_worker(rank: int, world: int, paths: dict, ref_file: str) -> None:
    refs = torch.load(ref_file)
    mine = list(range(rank, len(PROMPTS), world))  # 4 and 3, or 2, 2, 2 and 1 samples
    for name, path in paths.items():
        rm = RewardModel(path, micro_batch_size=2)
        _check_sharded(rm, world)
        # The tables as the forward reads them: this rank's rows of each, never the whole.
        seen = _tables_seen(
            rm,
            lambda m: (
                m(Sample.batch(PROMPTS[:2], RESPONSES[:2]))
                if rank == 0
                else m(Sample.batch([], []))
            ),
        )
        _check_rows(seen, refs[name]["tables"], rank, world)
        got = rm(Sample.batch([PROMPTS[i] for i in mine], [RESPONSES[i] for i in mine]))
        torch.testing.assert_close(got, refs[name]["scores"][mine], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_reward_models_keep_only_their_rows_of_the_vocabulary(tmp_path, world):
    """On 2 and 4 gloo processes a classifier and two likelihood models (LM head untied and
    tied), with a vocabulary that divides by neither world size, hold only their rows of the
    input embedding and LM head while they score (no gathered table), and score as the whole
    model in one process (fp32, 1e-6)."""
    from _exports import likelihood_reward_model

    untied = _odd_vocab_lm(tmp_path / "untied", tie=False)
    tied = _odd_vocab_lm(tmp_path / "tied", tie=True)
    paths = {
        "classifier": _attention_export(untied, tmp_path / "classifier"),
        "likelihood": likelihood_reward_model(untied, tmp_path / "likelihood"),
        "likelihood_tied": likelihood_reward_model(tied, tmp_path / "likelihood_tied"),
    }
    refs = {}
    for name, path in paths.items():
        rm = RewardModel(path, micro_batch_size=2)
        assert not rm.collective
        refs[name] = {"scores": rm(Sample.batch(PROMPTS, RESPONSES)), "tables": _tables(rm)}
        assert refs[name]["scores"].std() > 1e-3
    emb = refs["likelihood_tied"]["tables"]
    assert emb["embedding"] is emb["lm_head"] and emb["embedding"].shape[0] % world
    torch.save(refs, tmp_path / "refs.pt")
    run_distributed(_vocab_worker, paths, str(tmp_path / "refs.pt"), world_size=world)


def _chats() -> tuple[list, list[str]]:
    """Conversations with a picture each (three colours, two sizes) and one without."""
    from PIL import Image

    def ask(colour, size=(56, 56)):
        picture = {"type": "image", "image": Image.new("RGB", size, colour)}
        return [{"role": "user", "content": [picture, {"type": "text", "text": "Colour?"}]}]

    chats = [
        ask((255, 0, 0)),
        [{"role": "user", "content": "Name a colour."}],
        ask((0, 200, 0), (84, 56)),
        ask((0, 0, 255)),
        ask((200, 200, 0), (40, 70)),
    ]
    return chats, ["red", "green", "green", "blue", "yellow"]


def _vlm_worker(rank: int, world: int, path: str, ref_file: str) -> None:
    refs = torch.load(ref_file)
    want = refs["scores"]
    chats, answers = _chats()
    # 2 ranks: 3 pictures; a picture and the text-only chat. 4: 2, 1, 1 and 1 samples.
    mine = list(range(rank, len(answers), world))
    rm = RewardModel(path, micro_batch_size=2)
    _check_sharded(rm, world)
    got = rm(
        Sample.batch(
            ["p"] * len(mine), [answers[i] for i in mine], conversations=[chats[i] for i in mine]
        )
    )
    torch.testing.assert_close(got, want[mine], rtol=0, atol=1e-6)
    # Only the last rank has samples: the others run the same forwards (the tower too) with
    # fillers; each forward reads only this rank's rows of the embedding and LM head.
    last = rank == world - 1
    out: list[torch.Tensor] = []

    def score(m: RewardModel) -> None:
        n = 1 if last else 0
        out.append(m(Sample.batch(["p"] * n, answers[:n], conversations=chats[:n])))

    _check_rows(_tables_seen(rm, score), refs["tables"], rank, world)
    torch.testing.assert_close(out[0], want[:1] if last else want[:0], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_vlm_reward_model_scores_as_the_whole_model(tmp_path, tiny_vlm, world):
    """A tiny Qwen2-VL likelihood reward model (its vision tower sharded too) on 2 and 4 gloo
    processes with unequal sample counts, one sample without a picture, and ranks without
    samples: the scores equal the one-process model's (fp32, 1e-6), and each rank's forward
    reads only its rows of the embedding and LM head."""
    from _exports import likelihood_reward_model

    path = likelihood_reward_model(tiny_vlm("qwen2_vl"), tmp_path / "rm")
    chats, answers = _chats()
    whole = RewardModel(path, micro_batch_size=2)
    want = whole(Sample.batch(["p"] * 5, answers, conversations=chats))
    assert len(set(want.tolist())) == 5
    torch.save({"scores": want, "tables": _tables(whole)}, tmp_path / "want.pt")
    run_distributed(_vlm_worker, path, str(tmp_path / "want.pt"), world_size=world)


def test_one_process_loads_whole_and_is_not_collective(tiny_model_dir, tmp_path):
    rm = RewardModel(_value_head_dir(str(tiny_model_dir), tmp_path / "vh"))
    assert not rm.collective and not CombinedReward({"rm": rm}).collective
    assert not any(type(p).__name__ == "DTensor" for p in rm.net.parameters())
    assert rm(Sample.batch([], [])).shape == (0,)


def _grpo_worker(rank: int, world: int, cfg_path: str) -> None:
    from _dist import build_recipe

    from lightrft import config as lconfig

    cfg, _ = lconfig.load(cfg_path)
    recipe = build_recipe("grpo", cfg)
    recipe.setup(cfg)
    assert (fn := recipe.source.parts.reward_fn).collective and fn.functions["rm"].collective
    recipe.train()
    recipe.logger.close()


@pytest.mark.slow
def test_grpo_on_two_processes_rewards_with_the_sharded_model(tmp_path):
    """GRPO on 2 gloo processes with a value-head reward model (sharded) beside a verifier, and
    an eval split of 7 prompts (4 and 3 per rank): every trained sample's logged reward-model
    reward equals the whole model's score of it in one process (1e-6)."""
    import json

    import yaml

    from lightrft.tasks import ensure_arith_dataset, make_tiny_model

    model = make_tiny_model(tmp_path / "model", layers=2, hidden=32, heads=2, kv_heads=1)
    ensure_arith_dataset(tmp_path / "data", n_train=40, n_test=7, digits=1)
    rm_dir = tmp_path / "rm"
    shutil.copytree(model, rm_dir)
    g = torch.Generator().manual_seed(1)
    save_file(
        {"value_head.weight": torch.randn(1, 32, generator=g)},
        str(rm_dir / "value_head.safetensors"),
    )
    rm = {
        "_component_": "lightrft.rewards.RewardModel",
        "path": str(rm_dir),
        "chat_template": False,
    }
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(model)},
        "dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(tmp_path / "data" / "train.jsonl"),
        },
        "eval_dataset": {
            "_component_": "lightrft.data.PromptDataset",
            "path": str(tmp_path / "data" / "test.jsonl"),
        },
        "reward": {
            "_component_": "lightrft.rewards.CombinedReward",
            "functions": {"accuracy": {"_component_": "lightrft.rewards.MathVerifier"}, "rm": rm},
        },
        "rollout": {"prompts_per_step": 2, "n": 4, "max_tokens": 4},
        "algorithm": {"advantage": {"estimator": "grpo"}},
        "train": {"micro_batch_size": 4, "ppo_epochs": 1},
        "max_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "eval": {"every": 2, "max_tokens": 3},
        "trajectories": True,
        "metrics": {"tensorboard": False},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text("# lightrft run grpo --config grpo.yaml\n" + yaml.safe_dump(cfg))
    run_distributed(_grpo_worker, str(path))
    lines = [
        json.loads(line)
        for f in sorted((tmp_path / "out" / "trajectories").glob("step_*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    assert len(lines) == 16  # 2 steps x 2 prompts x 4 samples
    whole = RewardModel(str(rm_dir), chat_template=False)
    want = whole(Sample.batch([r["prompt"] for r in lines], [r["response"] for r in lines]))
    got = torch.tensor([r["reward_parts"]["rm"] for r in lines])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
