"""The HTTP reward client against real servers on 127.0.0.1, and the reference server."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lightrft.rewards import (
    CombinedReward,
    MathVerifier,
    RemoteReward,
    RemoteRewardError,
    RewardError,
)
from lightrft.rewards.server import make_server

PROMPTS = ["What is 2+2?", "What is 3*3?", "Half of 1?"]
RESPONSES = [r"\boxed{4}", "The answer is 6.", "It is 0.5"]
REFS = ["4", "9", r"\frac12"]
LABELS = ["math"] * 3


@contextlib.contextmanager
def running(server):
    # A short poll interval keeps shutdown() (which waits for one poll) fast.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}/get_reward"
    finally:
        server.shutdown()
        server.server_close()


class Scripted:
    """A raw HTTP server whose i-th POST answers ``script[min(i, len - 1)]``:
    ``(delay_s, status, body_bytes)``."""

    def __init__(self, script):
        self.script = script
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                length = int(self.headers["Content-Length"])
                outer.requests.append(json.loads(self.rfile.read(length)))
                delay, status, body = outer.script[min(len(outer.requests), len(script)) - 1]
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timeout) and closed the connection

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def ok(rewards):
    return (0.0, 200, json.dumps({"rewards": rewards}).encode())


def fast_client(url, **kw):
    return RemoteReward(url, **{"timeout": 2.0, "max_retries": 2, "backoff": 0.05, **kw})


def test_happy_path_with_the_reference_server():
    with running(make_server(MathVerifier())) as url:
        rewards = fast_client(url)(PROMPTS, RESPONSES, REFS, LABELS)
    assert rewards == [1.0, 0.0, 1.0]


def test_request_fields_and_batching():
    seen = []

    def record(prompts, responses, references, labels):
        seen.append((prompts, responses, references, labels))
        return [float(len(r)) for r in responses]

    with running(make_server(record)) as url:
        rewards = fast_client(url, batch_size=2)(PROMPTS, RESPONSES, REFS, LABELS)
    assert rewards == [float(len(r)) for r in RESPONSES]
    assert len(seen) == 2  # 3 samples in requests of at most 2
    assert seen[0] == (PROMPTS[:2], RESPONSES[:2], REFS[:2], LABELS[:2])
    assert seen[1] == (PROMPTS[2:], RESPONSES[2:], REFS[2:], LABELS[2:])


def test_wire_format():
    s = Scripted([ok([1.0, 2.0])])
    conv = [{"role": "user", "content": "Hi"}]
    with running(s.server) as url:
        assert fast_client(url)(["Q: ", conv], ["a", "b"], None, ["x", None]) == [1.0, 2.0]
    body = s.requests[0]
    assert body["queries"] == ["Q: a", conv + [{"role": "assistant", "content": "b"}]]
    assert body["prompts"] == ["Q: ", conv] and body["responses"] == ["a", "b"]
    assert body["references"] == [None, None] and body["labels"] == ["x", None]


def test_server_splits_queries_without_responses():
    # Clients of OpenRLHF's protocol send queries = prompt + response, no responses field.
    with running(make_server(MathVerifier())) as url:
        body = {
            "queries": [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)],
            "prompts": PROMPTS,
            "references": REFS,
        }
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.loads(resp.read()) == {"rewards": [1.0, 0.0, 1.0]}


def test_slow_server_times_out_then_retry_succeeds():
    s = Scripted([(1.5, 200, b'{"rewards": [0.0]}'), ok([7.0])])
    with running(s.server) as url:
        start = time.perf_counter()
        rewards = fast_client(url, timeout=0.3)(["q"], ["r"])
        elapsed = time.perf_counter() - start
    assert rewards == [7.0]
    assert len(s.requests) == 2
    assert elapsed < 1.5  # the first answer was not waited for


def test_slow_server_fails_after_bounded_retries():
    s = Scripted([(1.0, 200, b'{"rewards": [0.0]}')])
    with running(s.server) as url:
        start = time.perf_counter()
        with pytest.raises(
            RemoteRewardError,
            match=rf"{url} failed 2 attempts .*no answer within "
            r"timeout=0.2s",
        ):
            fast_client(url, timeout=0.2, max_retries=1)(["q"], ["r"])
        assert time.perf_counter() - start < 2.0
    assert len(s.requests) == 2


def test_server_down_fails_fast_with_a_clear_error():
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/get_reward"
    start = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=rf"{url} failed 3 attempts.*ConnectionRefused"):
        RemoteReward(url, timeout=1.0, max_retries=2, backoff=0.1)(["q"], ["r"])
    elapsed = time.perf_counter() - start
    assert 0.3 <= elapsed < 5.0  # two backoffs: 0.1 s + 0.2 s


def test_retryable_http_errors_are_retried():
    s = Scripted([(0.0, 503, b"busy"), (0.0, 500, b"oops"), ok([1.0])])
    with running(s.server) as url:
        assert fast_client(url)(["q"], ["r"]) == [1.0]
    assert len(s.requests) == 3


@pytest.mark.parametrize(
    "status, body, match",
    [
        (404, b"no such route", r"answered HTTP 404 .*no such route"),
        (200, b"<html>hello</html>", r"answered something that is not JSON"),
        (200, b'{"scores": [1.0, 2.0]}', r"answered without a 'rewards' list"),
        (200, b"[1.0, 2.0]", r"answered without a 'rewards' list"),
        (200, b'{"rewards": [1.0]}', r"returned 1 rewards for 2 queries"),
        (200, b'{"rewards": [1.0, 2.0, 3.0]}', r"returned 3 rewards for 2 queries"),
        (200, b'{"rewards": [NaN, 1.0]}', r"returned nan for query 0; rewards must be finite"),
        (200, b'{"rewards": [1.0, Infinity]}', r"returned inf for query 1"),
        (200, b'{"rewards": [1.0, "2"]}', r"returned '2' for query 1"),
        (200, b'{"rewards": [true, 1.0]}', r"returned True for query 0"),
    ],
)
def test_malformed_answers_fail_at_once_naming_the_url(status, body, match):
    s = Scripted([(0.0, status, body)])
    with running(s.server) as url:
        with pytest.raises(RemoteRewardError, match=rf"reward server {url} .*{match}"):
            fast_client(url)(["q", "q"], ["a", "b"])
    assert len(s.requests) == 1  # a malformed answer is not retried


def test_remote_error_inside_combined_reward_names_both():
    s = Scripted([(0.0, 200, b'{"rewards": [NaN]}')])
    with running(s.server) as url:
        fn = CombinedReward({"judge": fast_client(url)})
        with pytest.raises(RewardError, match=rf"'judge' \(RemoteReward\).*{url}"):
            fn(["q"], ["r"])


def test_reference_server_errors():
    def broken(prompts, responses, references, labels):
        raise RuntimeError("model on fire")

    def short(prompts, responses, references, labels):
        return [1.0]

    for fn, match in (
        (broken, "RuntimeError: model on fire"),
        (short, "returned 1 rewards for 2 samples"),
    ):
        with running(make_server(fn)) as url:
            with pytest.raises(RemoteRewardError, match=rf"HTTP 500 .*{match}"):
                fast_client(url)(["q", "q"], ["a", "b"])
    with running(make_server(MathVerifier())) as url:
        for body, match in (
            (b"not json", "bad request"),
            (b'{"prompts": []}', "needs 'queries'"),
            (b'{"responses": ["a"], "labels": [1, 2]}', "'labels' must be a list"),
        ):
            req = urllib.request.Request(url, data=body, method="POST")
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=5)
            assert info.value.code == 400 and match in info.value.read().decode()
        health = url.rsplit("/", 1)[0] + "/health"
        with urllib.request.urlopen(health, timeout=5) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}


def test_client_argument_checks():
    with pytest.raises(ValueError, match="url must start with http"):
        RemoteReward("localhost:8000")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        RemoteReward("http://x", timeout=0)
    with pytest.raises(ValueError, match="max_retries must be >= 0"):
        RemoteReward("http://x", max_retries=-1)
    with pytest.raises(ValueError, match="references has 1 entries but responses has 2"):
        RemoteReward("http://x")(["a", "b"], ["a", "b"], ["r"])


def test_server_command_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightrft.rewards.server", "--port", "0", "--verifier", "gsm8k"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving gsm8k on http://127.0.0.1:"), line
        url = line.split()[-1] + "/get_reward"
        rewards = fast_client(url)(["q", "q"], ["#### 1,000", "#### 7"], ["1000", "8"])
        assert rewards == [1.0, 0.0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def length_reward(prompts, responses, references, labels, scale=1.0):
    return [scale * len(r) for r in responses]


def test_load_reward_fn():
    from lightrft.rewards import ThinkFormatReward
    from lightrft.rewards.server import load_reward_fn

    assert isinstance(load_reward_fn("format"), ThinkFormatReward)
    assert load_reward_fn("math", kwargs={"incorrect": -1.0}).incorrect == -1.0
    fn = load_reward_fn(component=f"{__name__}.length_reward", kwargs={"scale": 2.0})
    assert fn(["q"], ["abc"], [None], [None]) == [6.0]
    assert load_reward_fn(component=f"{__name__}.length_reward") is length_reward
    with pytest.raises(ValueError, match="unknown verifier 'maths'"):
        load_reward_fn("maths")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_reward_fn(component="lightrft.rewards.Nope")
    with pytest.raises(ValueError, match="exactly one"):
        load_reward_fn()
