"""Episodes: the environment side of a multi-turn generate call, driven by hand-made engine
turns and completions (the engine's Turn / Completion) on the character-level tokenizer with the Qwen2.5-style
tool template: first prompts with the tools, observation ids, final answers, conversations,
metrics and the trajectory record."""

from __future__ import annotations

import json

import pytest
import torch

from lightrft.engine.protocol import Completion, Turn
from lightrft.environments import (
    Environment,
    Episodes,
    Step,
    ToolEnvironment,
    calculator_tool,
    episode_metrics,
    initial_prompt_ids,
    observation_ids,
)
from lightrft.rollout import RolloutBatch
from lightrft.rollout.metrics import write_trajectories

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
QUESTION = "What is 12 * 34?"


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _turn(tok, request: int, sample: int, index: int, text: str, so_far: list[int], room=1000):
    ids = _ids(tok, text + "<|im_end|>")
    return Turn(
        request_index=request,
        sample_index=sample,
        turn_index=index,
        token_ids=ids,
        logprobs=[-0.5] * len(ids),
        response_token_ids=so_far + ids,
        max_observation_tokens=room,
    )


def _factory():
    return ToolEnvironment([calculator_tool()], max_turns=3)


def _play(tok):
    """Two trajectories of one prompt: sample 0 calls the calculator then answers, sample 1
    answers at once. Returns the episodes and the engine's completions."""
    eps = Episodes(_factory, [{"prompt": QUESTION}], 2, tok)
    t0 = _turn(tok, 0, 0, 0, CALL, [])
    obs = eps.continuation(t0)
    assert obs == observation_ids(
        tok, [{"role": "tool", "name": "calculator", "content": "408"}], _factory().schemas
    )
    t1 = _turn(tok, 0, 0, 1, "It is 408.", t0.token_ids + obs)
    assert eps.continuation(t1) is None
    s1 = _turn(tok, 0, 1, 0, "408", [])
    assert eps.continuation(s1) is None
    response = t0.token_ids + obs + t1.token_ids
    completions = [
        Completion(
            request_index=0,
            sample_index=0,
            prompt_token_ids=eps.prompt_ids[0],
            token_ids=response,
            logprobs=[-0.5] * len(t0.token_ids) + [0.0] * len(obs) + [-0.5] * len(t1.token_ids),
            finish_reason="stop",
            text=tok.decode(response, skip_special_tokens=True),
            sampled_mask=[True] * len(t0.token_ids)
            + [False] * len(obs)
            + [True] * len(t1.token_ids),
            turn_spans=[(0, len(t0.token_ids)), (len(t0.token_ids) + len(obs), len(response))],
        ),
        Completion(
            request_index=0,
            sample_index=1,
            prompt_token_ids=eps.prompt_ids[0],
            token_ids=s1.token_ids,
            logprobs=[-0.5] * len(s1.token_ids),
            finish_reason="stop",
            text="408",
            sampled_mask=[True] * len(s1.token_ids),
            turn_spans=[(0, len(s1.token_ids))],
        ),
    ]
    return eps, completions, len(obs)


def test_prompts_name_the_tools_and_turns_step_the_environment(qwen_tok):
    eps, completions, n_obs = _play(qwen_tok)
    messages = [{"role": "user", "content": QUESTION}]
    assert eps.prompt_ids == [initial_prompt_ids(qwen_tok, messages, _factory().schemas)]
    assert "calculator" in qwen_tok.decode(eps.prompt_ids[0])
    done = eps.finish(completions)
    assert [e.final_text for e in done] == ["It is 408.", "408"]  # the last turn, decoded
    assert done[0].conversation() == [
        *messages,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculator", "content": "408"},
    ]
    assert done[1].conversation() == messages
    assert [e.stats.turns for e in done] == [2, 1] and [e.stats.tool_calls for e in done] == [1, 0]
    assert done[0].turns[0].tool_calls == 1 and done[0].turns[0].observation_ids

    total = sum(len(c.token_ids) for c in completions)
    m = episode_metrics(done, total, total - n_obs)
    assert m["env/turns"] == 1.5 and m["env/tool_calls"] == 0.5
    assert m["env/errors/tool_exception"] == 0.0 and m["env/truncated"] == 0.0
    assert m["env/observation_token_frac"] == n_obs / total


def test_trajectory_files_record_every_turn(qwen_tok, tmp_path):
    eps, completions, n_obs = _play(qwen_tok)
    done = eps.finish(completions)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    batch = RolloutBatch.from_completions(
        completions,
        {k: [QUESTION] for k in ("prompt", "reference", "label", "where")},
        groups=[(0,), (0,)],
        reward_raw=rewards,
        rewards=rewards,
        reward_parts={},
        reward_applied={},
    )
    batch.episodes = done
    batch.kept = torch.ones(2, dtype=torch.bool)
    write_trajectories(tmp_path, 1, batch, batch.select([0, 1]))
    rows = [json.loads(x) for x in (tmp_path / "step_000001.jsonl").read_text().splitlines()]
    first = rows[0]
    assert first["response_ids"] == completions[0].token_ids
    assert first["sampled_mask"] == completions[0].sampled_mask
    assert sum(not m for m in first["sampled_mask"]) == n_obs
    turns = first["episode"]["turns"]
    assert [t["text"] for t in turns] == [CALL, "It is 408."]
    assert turns[0]["observation"][0]["content"] == "408" and turns[1]["observation"] == []
    assert first["episode"]["final_text"] == "It is 408."
    assert rows[1]["episode"]["stats"]["turns"] == 1

    # trajectory_tokens: one piece per response token, observations included, the engine's
    # log-probs; no trainer values without token_stats and advantages.
    def decode(id_rows):
        return qwen_tok.batch_decode(id_rows, skip_special_tokens=False)

    write_trajectories(tmp_path, 2, batch, batch.select([0, 1]), decode=decode)
    rows = [json.loads(x) for x in (tmp_path / "step_000002.jsonl").read_text().splitlines()]
    tokens = rows[0]["tokens"]
    assert len(tokens["text"]) == len(first["response_ids"]) == len(tokens["engine_logprob"])
    assert "".join(tokens["text"]) == qwen_tok.decode(first["response_ids"])
    assert tokens["logprob"] is tokens["entropy"] is tokens["advantage"] is None
    assert {k: v for k, v in rows[0].items() if k != "tokens"} == {**first, "step": 2}


def test_an_observation_past_the_budget_is_marked_dropped(qwen_tok):
    eps = Episodes(_factory, [{"prompt": QUESTION}], 1, qwen_tok)
    ids = eps.continuation(_turn(qwen_tok, 0, 0, 0, CALL, [], room=3))
    assert len(ids) > 3  # returned: the engine drops it and ends the row "length"
    record = eps.episodes[0, 0].turns[0]
    assert record.observation_dropped and record.observation_ids == []


def test_a_factory_that_builds_no_environment_and_a_reset_that_varies_are_refused(qwen_tok):
    with pytest.raises(TypeError, match="built a dict, not an"):
        Episodes(dict, [{"prompt": QUESTION}], 1, qwen_tok)

    class Coin(Environment):
        flips = iter(range(100))

        def reset(self, item):
            return [{"role": "user", "content": str(next(self.flips))}]

        def step(self, text):
            return Step(done=True)

    with pytest.raises(ValueError, match="GRPO group must share their prompt"):
        Episodes(Coin, [{"prompt": QUESTION}], 2, qwen_tok)
