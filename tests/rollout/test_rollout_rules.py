"""The rollout modes' rules (lightrft.rollout.rules), checked on plain config objects: each
refusal names its key, as the GRPO bad-config tables see them through the CLI."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from lightrft.rollout.rules import check_rollout


def _opts(
    *, asynchronous=False, budget=None, backend="native", tp=None, environment=None, sp=1, **alg
):
    algorithm = NS(
        old_logprobs=alg.get("old_logprobs", "engine"),
        tis=NS(mode=alg.get("tis")),
        shaping=NS(dynamic=alg.get("dynamic", False)),
    )
    return NS(
        rollout=NS(asynchronous=asynchronous, partial=NS(token_budget=budget)),
        engine=NS(backend=backend, tensor_parallel_size=tp),
        environment=environment,
        algorithm=algorithm,
        strategy=NS(sequence_parallel=sp),
    )


def test_the_default_modes_pass():
    check_rollout(_opts(old_logprobs="trainer"))  # on-policy: no rule applies
    check_rollout(_opts(asynchronous=True))
    check_rollout(_opts(budget=64))
    check_rollout(_opts(asynchronous=True, backend="vllm"))
    check_rollout(_opts(budget=64, backend="vllm", tp=1))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"asynchronous": True, "backend": "sglang"}, "asynchronous=true needs engine.backend="),
        ({"asynchronous": True, "backend": "vllm", "tp": 2}, "got engine.backend=vllm, tensor_p"),
        ({"asynchronous": True, "environment": "env"}, "does not play multi-turn episodes"),
        ({"asynchronous": True, "old_logprobs": "trainer"}, "samples of an older policy"),
        ({"asynchronous": True, "budget": 64}, "rollout.partial.token_budget: the generating"),
        ({"asynchronous": True, "sp": 2}, "sequence_parallel=2: the sequence-parallel"),
        ({"budget": 64, "backend": "vllm", "tp": 2}, "rollout.partial.token_budget needs engine"),
        ({"budget": 64, "environment": "env"}, "a multi-turn row cannot be cut"),
        ({"budget": 64, "old_logprobs": "trainer"}, "carried tokens were sampled by older"),
        ({"budget": 64, "dynamic": True}, "both decide which groups a step trains on"),
    ],
)
def test_each_refusal_names_its_key(kw, message):
    with pytest.raises(ValueError, match=message):
        check_rollout(_opts(**kw))


def test_trainer_log_probs_with_tis_are_an_importance_correction():
    check_rollout(_opts(asynchronous=True, old_logprobs="trainer", tis="token"))
