"""The new verifiers served by the reward server give the same rewards as in-process."""

import contextlib
import threading

import pytest

from lightrft.rewards import CodeVerifier, MathVerifier, RemoteReward, RemoteRewardError, Sample
from lightrft.rewards.server import load_reward_fn, make_server


@contextlib.contextmanager
def serving(reward_fn):
    server = make_server(reward_fn)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield RemoteReward(f"http://{host}:{port}/score", timeout=60)
    finally:
        server.shutdown()
        server.server_close()


def _same(local, remote, responses, refs):
    n = len(responses)
    samples = Sample.batch(["q"] * n, responses, refs)
    want = local(samples)
    got = remote(samples)
    assert [float(x) for x in got] == [float(x) for x in want]
    return want


def test_math_verifier_served():
    responses = [r"\boxed{(1, 2]}", r"\boxed{\frac{1}{2}}", "so x = 3", r"\boxed{\{1,3\}}"]
    refs = ["(1,2]", "0.5", "3", r"\{1,2\}"]
    local = MathVerifier()
    served = load_reward_fn("math")
    try:
        with serving(served) as remote:
            assert _same(local, remote, responses, refs) == [1.0, 1.0, 1.0, 0.0]
    finally:
        local.close()
        served.close()


def test_code_verifier_served():
    add = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    loop = "```python\nwhile True: pass\n```"
    refs = [{"inputs": ["1 2", "2 2"], "outputs": ["3", "4"]}] * 2 + [["assert 1 == 2"]]
    local = CodeVerifier(timeout=1.0)
    with serving(load_reward_fn("code", kwargs={"timeout": 1.0})) as remote:
        assert _same(local, remote, [add, loop, add], refs) == [1.0, 0.0, 0.0]


def test_code_verifier_bad_tests_are_the_callers_mistake():
    """Unreadable test cases answer HTTP 422 naming the sample (not 500), and are not retried."""
    add = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    good = {"inputs": ["1 2"], "outputs": ["3"]}
    with serving(load_reward_fn("code", kwargs={"timeout": 1.0})) as remote:
        for bad, why in (
            ({"nope": 1}, "unknown test format"),
            (["assert f(1) =="], "not valid Python"),
        ):
            with pytest.raises(RemoteRewardError, match=f"HTTP 422 .*sample 1: .*{why}"):
                remote(
                    Sample.batch(
                        ["q", "q"], [add, add], references=[good, bad], labels=[None, None]
                    )
                )
        assert [
            float(x) for x in remote(Sample.batch(["q"], [add], references=[good], labels=[None]))
        ] == [1.0]
