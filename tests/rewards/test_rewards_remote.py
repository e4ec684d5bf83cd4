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
    Sample,
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
        rewards = fast_client(url)(Sample.batch(PROMPTS, RESPONSES, references=REFS, labels=LABELS))
    assert rewards == [1.0, 0.0, 1.0]


def test_request_fields_and_batching():
    seen = []

    def record(samples):
        prompts = [s.prompt for s in samples]
        responses = [s.response for s in samples]
        references = [s.reference for s in samples]
        labels = [s.label for s in samples]
        seen.append((prompts, responses, references, labels))
        return [float(len(r)) for r in responses]

    with running(make_server(record)) as url:
        rewards = fast_client(url, batch_size=2)(
            Sample.batch(PROMPTS, RESPONSES, references=REFS, labels=LABELS)
        )
    assert rewards == [float(len(r)) for r in RESPONSES]
    assert len(seen) == 2  # 3 samples in requests of at most 2
    assert seen[0] == (PROMPTS[:2], RESPONSES[:2], REFS[:2], LABELS[:2])
    assert seen[1] == (PROMPTS[2:], RESPONSES[2:], REFS[2:], LABELS[2:])


def test_wire_format():
    s = Scripted([ok([1.0, 2.0])])
    conv = [{"role": "user", "content": "Hi"}]
    with running(s.server) as url:
        assert fast_client(url)(
            Sample.batch(["Q: ", conv], ["a", "b"], references=None, labels=["x", None])
        ) == [1.0, 2.0]
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
        rewards = fast_client(url, timeout=0.3)(Sample.batch(["q"], ["r"]))
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
            fast_client(url, timeout=0.2, max_retries=1)(Sample.batch(["q"], ["r"]))
        assert time.perf_counter() - start < 2.0
    assert len(s.requests) == 2


def test_server_down_fails_fast_with_a_clear_error():
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/get_reward"
    start = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=rf"{url} failed 3 attempts.*ConnectionRefused"):
        RemoteReward(url, timeout=1.0, max_retries=2, backoff=0.1)(Sample.batch(["q"], ["r"]))
    elapsed = time.perf_counter() - start
    assert 0.3 <= elapsed < 5.0  # two backoffs: 0.1 s + 0.2 s


def test_retryable_http_errors_are_retried():
    s = Scripted([(0.0, 503, b"busy"), (0.0, 500, b"oops"), ok([1.0])])
    with running(s.server) as url:
        assert fast_client(url)(Sample.batch(["q"], ["r"])) == [1.0]
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
        # a 400-digit integer overflows a float: refused like any other bad value
        (200, b'{"rewards": [1.0, 1' + b"0" * 400 + b"]}", r"returned 10+ for query 1"),
    ],
)
def test_malformed_answers_fail_at_once_naming_the_url(status, body, match):
    s = Scripted([(0.0, status, body)])
    with running(s.server) as url:
        with pytest.raises(RemoteRewardError, match=rf"reward server {url} .*{match}"):
            fast_client(url)(Sample.batch(["q", "q"], ["a", "b"]))
    assert len(s.requests) == 1  # a malformed answer is not retried


def test_remote_error_inside_combined_reward_names_both():
    s = Scripted([(0.0, 200, b'{"rewards": [NaN]}')])
    with running(s.server) as url:
        fn = CombinedReward({"judge": fast_client(url)})
        with pytest.raises(RewardError, match=rf"'judge' \(RemoteReward\).*{url}"):
            fn(Sample.batch(["q"], ["r"]))


def test_reference_server_errors():
    def broken(samples):
        raise RuntimeError("model on fire")

    def short(samples):
        return [1.0]

    for fn, match in (
        (broken, "RuntimeError: model on fire"),
        (short, "returned 1 rewards for 2 samples"),
    ):
        with running(make_server(fn)) as url:
            with pytest.raises(RemoteRewardError, match=rf"HTTP 500 .*{match}"):
                fast_client(url)(Sample.batch(["q", "q"], ["a", "b"]))
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
        RemoteReward("http://x")(Sample.batch(["a", "b"], ["a", "b"], references=["r"]))


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
        rewards = fast_client(url)(
            Sample.batch(["q", "q"], ["#### 1,000", "#### 7"], references=["1000", "8"])
        )
        assert rewards == [1.0, 0.0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def length_reward(samples, scale=1.0):
    responses = [s.response for s in samples]
    return [scale * len(r) for r in responses]


def test_load_reward_fn():
    from lightrft.rewards import ThinkFormatReward
    from lightrft.rewards.server import load_reward_fn

    assert isinstance(load_reward_fn("format"), ThinkFormatReward)
    assert load_reward_fn("math", kwargs={"incorrect": -1.0}).incorrect == -1.0
    fn = load_reward_fn(component=f"{__name__}.length_reward", kwargs={"scale": 2.0})
    assert fn(Sample.batch(["q"], ["abc"], references=[None], labels=[None])) == [6.0]
    assert load_reward_fn(component=f"{__name__}.length_reward") is length_reward
    with pytest.raises(ValueError, match="unknown verifier 'maths'"):
        load_reward_fn("maths")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_reward_fn(component="lightrft.rewards.Nope")
    with pytest.raises(ValueError, match="exactly one"):
        load_reward_fn()


# --- security and robustness of the server / client (issue 16, items 2 and 3) -------------------


def _raw(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    """Send raw bytes, return (status, body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _post(length: int | str, body: bytes, extra: str = "") -> bytes:
    return f"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{extra}\r\n".encode() + body


def test_server_token_auth_and_client_token(monkeypatch):
    with running(make_server(MathVerifier(), token="s3cret")) as url:
        with pytest.raises(RemoteRewardError, match="HTTP 401"):
            fast_client(url)(Sample.batch(["q"], [r"\boxed{1}"], references=["1"]))
        with pytest.raises(RemoteRewardError, match="HTTP 401"):
            fast_client(url, token="wrong")(Sample.batch(["q"], [r"\boxed{1}"], references=["1"]))
        assert fast_client(url, token="s3cret")(
            Sample.batch(["q"], [r"\boxed{1}"], references=["1"])
        ) == [1.0]
        monkeypatch.setenv("LIGHTRFT_REWARD_TOKEN", "s3cret")
        assert fast_client(url)(Sample.batch(["q"], [r"\boxed{1}"], references=["1"])) == [1.0]
        with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/health", timeout=5) as r:
            assert r.status == 200  # the health probe needs no token


def test_server_refuses_oversized_and_slow_bodies_quickly():
    with running(make_server(MathVerifier(), max_body_bytes=1000, read_timeout=0.5)) as url:
        port = int(url.split(":")[2].split("/")[0])
        start = time.perf_counter()
        status, body = _raw(port, _post(50 * 2**20, b"{}"))  # announces 50 MB, sends 2 bytes
        assert status == 413 and b"exceeds the limit of 1000 bytes" in body
        assert time.perf_counter() - start < 0.4  # refused before reading
        # Within the limit but never completed: released at the read deadline with a 408.
        start = time.perf_counter()
        status, body = _raw(port, _post(900, b"{}"))
        assert status == 408 and b"within 0.5s" in body
        assert 0.4 < time.perf_counter() - start < 2.0
        # A client trickling one byte every 0.2 s is cut off at the deadline, not per read.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(_post(50, b""))
            start = time.perf_counter()
            for _ in range(20):
                try:
                    s.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.2)
                s.setblocking(False)
                try:
                    if s.recv(65536):
                        break
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
            assert time.perf_counter() - start < 1.5


def test_server_bounds_concurrent_connections():
    server = make_server(MathVerifier(), max_connections=2, read_timeout=5.0)
    with running(server) as url:
        port = int(url.split(":")[2].split("/")[0])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            time.sleep(0.2)  # both are accepted and hold their slots
            start = time.perf_counter()
            status, body = _raw(port, _post(2, b"{}"))
            assert status == 503 and b"too many open connections" in body
            assert time.perf_counter() - start < 1.0
        finally:
            for s in idle:
                s.close()
        time.sleep(0.2)  # closed connections give their slots back
        assert fast_client(url)(Sample.batch(["q"], [r"\boxed{1}"], references=["1"])) == [1.0]


@pytest.mark.parametrize(
    "length,body,code,match",
    [
        (None, b'{"queries": [1, 2]}', 400, b"'queries'[0] is a int"),
        (None, b'{"queries": [[1]]}', 400, b"must be a list of messages"),
        (None, b'{"queries": [[{"content": 5}]]}', 400, b"must be a list of messages"),
        (None, b'{"responses": [1]}', 400, b"must hold strings"),
        (None, b"[" * 100_000 + b"]" * 100_000, 400, b"bad request"),
        (None, b'{"queries": ["\xff"]}', 400, b"bad request"),
        ("abc", b"", 400, b"bad Content-Length"),
        ("-5", b"", 400, b"bad Content-Length"),
        ("99999999999999999999", b"", 413, b"exceeds the limit"),
        (10, b"{}", 400, b"body ended after 2 of 10 bytes"),
    ],
)
def test_every_malformed_body_gets_an_http_error(length, body, code, match):
    with running(make_server(MathVerifier(), max_body_bytes=2**20, read_timeout=2.0)) as url:
        port = int(url.split(":")[2].split("/")[0])
        data = _post(len(body) if length is None else length, body)
        if length == 10:  # send 2 of 10 bytes, then close our side
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                buf = b""
                while chunk := s.recv(65536):
                    buf += chunk
            status, got = int(buf.split()[1]), buf.partition(b"\r\n\r\n")[2]
        else:
            status, got = _raw(port, data)
    assert status == code and match in got, (status, got)


def test_remote_timeout_bounds_the_whole_request_against_a_trickling_server():
    """Issue 16 item 3: 1 byte every 0.5 s, timeout=1.0, max_retries=2 took 16 s before."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def trickle(conn):
        with conn:
            conn.recv(65536)
            for b in b'HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{"rewards": [1.0]}  ':
                if stop.is_set():
                    return
                try:
                    conn.sendall(bytes([b]))
                except OSError:
                    return
                time.sleep(0.5)

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/r"
    try:
        start = time.perf_counter()
        with pytest.raises(
            RemoteRewardError, match=r"failed 3 attempts.*no answer within timeout=1.0s"
        ):
            RemoteReward(url, timeout=1.0, max_retries=2, backoff=0.1)(Sample.batch(["q"], ["r"]))
        elapsed = time.perf_counter() - start
        assert elapsed < 3 * 1.0 + 0.1 + 0.2 + 1.0, elapsed  # the documented bound + slack
    finally:
        stop.set()
        listener.close()
