"""GenerativeReward: verdict parsing, counted parse failures with the fallback, both-order
averaging; a real HTTP judge on 127.0.0.1 and a local judge through the native engine."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightrft.rewards import CombinedReward, GenerativeReward, Sample
from lightrft.rewards.generative import parse_verdict


def _judge_server(judge_fn):
    """An OpenAI-style /v1/completions server whose verdicts come from ``judge_fn(prompt)``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions" and body["temperature"] == 0.0
            out = {
                "choices": [{"index": i, "text": judge_fn(p)} for i, p in enumerate(body["prompt"])]
            }
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/completions"


@pytest.fixture
def serve():
    servers = []

    def start(fn):
        server, url = _judge_server(fn)
        servers.append(server)
        return url

    yield start
    for s in servers:
        s.shutdown()


def test_parse_verdict():
    num = re.compile(r"(-?\d+(?:\.\d+)?)")
    assert parse_verdict("I think 3, no: final score 7.5", num) == "7.5"  # the last match
    assert parse_verdict("no number", num) is None
    assert parse_verdict("Better: B", re.compile(r"\b(A|B)\b")) == "B"


def test_score_mode_counts_parse_failures_and_uses_the_fallback(serve):
    def judge(prompt):
        response = prompt.split("Response: ")[1].split("\n")[0]
        return " 9" if "good" in response else " I cannot judge this."

    rm = GenerativeReward(url=serve(judge), fallback=-1.0, scale=0.1)
    out = rm(Sample.batch(["q1", "q2", "q3"], ["good answer", "bad answer", "good too"]))
    assert torch.allclose(out, torch.tensor([0.9, -1.0, 0.9]))
    assert rm.last_metrics == {"parse_failures": 1.0, "parse_failure_rate": 1 / 3}
    assert rm.parse_failures == 1 and rm.judged == 3
    combined = CombinedReward({"judge": rm})(Sample.batch(["q"], ["meh"]))
    assert combined.total.tolist() == [-1.0]
    m = combined.metrics()
    assert m["reward/judge/parse_failures"] == 1.0 and m["reward/judge/parse_failure_rate"] == 1.0
    with pytest.raises(TypeError):
        GenerativeReward(url="http://x")  # no fallback: never a silent default


def test_choice_mode_both_orders_cancel_position_bias(serve):
    always_a = serve(lambda prompt: " A")
    biased = GenerativeReward(url=always_a, mode="choice", fallback=0.5)
    assert biased(Sample.batch(["q", "q"], ["x", "y"], references=["r", "r"])).tolist() == [
        1.0,
        1.0,
    ]
    fair = GenerativeReward(url=always_a, mode="choice", both_orders=True, fallback=0.5)
    assert fair(Sample.batch(["q", "q"], ["x", "y"], references=["r", "r"])).tolist() == [0.5, 0.5]

    def prefers_good(prompt):
        a = prompt.split("A: ")[1].split("\n")[0]
        b = prompt.split("B: ")[1].split("\n")[0]
        return " A" if "good" in a else (" B" if "good" in b else " neither")

    judge = GenerativeReward(
        url=serve(prefers_good), mode="choice", both_orders=True, fallback=0.25
    )
    out = judge(Sample.batch(["q"] * 2, ["good one", "plain"], references=["plain ref", "ref"]))
    assert out.tolist() == [1.0, 0.25]  # wins both orders; both verdicts unparsable
    assert judge.last_metrics["parse_failures"] == 2.0
    with pytest.raises(ValueError, match="no reference"):
        judge(Sample.batch(["q"], ["x"], references=[None]))


def test_parse_verdict_reads_the_named_verdict_group():
    pat = re.compile(r"(\d+) vs (?P<echo>[^:\n]*): (?P<verdict>yes|no)")
    assert parse_verdict("3 vs 4: no", pat) == "no"  # the named group, not the first one
    assert parse_verdict("3 vs 4 no", pat) is None


def test_an_echo_that_differs_from_the_response_gets_the_fallback(serve):
    # The judge copies the answer it judges before its verdict. It reads "4." as "4" and "44"
    # as "4" (a misread that says yes): only verdicts about the response itself count.
    def judge(prompt):
        answer = prompt.split("Answer: ")[1].split("\n")[0]
        copied = answer.strip(".")[:1]
        return f"4 vs {copied}: {'yes' if copied == '4' else 'no'}"

    pattern = r"(\d+) vs (?P<echo>[^:\n]*): (?P<verdict>yes|no)"
    rm = GenerativeReward(
        url=serve(judge),
        template="{prompt}\nAnswer: {response}\nRight?",
        verdicts={"yes": 1.0, "no": 0.0},
        pattern=pattern,
        fallback=-1.0,
        max_parse_failures=1,  # a mismatch is no parse failure: this must not refuse
    )
    out = rm(Sample.batch(["q"] * 4, ["4", "3", "4.", "44"]))
    assert out.tolist() == [1.0, 0.0, -1.0, -1.0]
    assert rm.last_metrics == {
        "parse_failures": 0.0,
        "parse_failure_rate": 0.0,
        "echo_mismatches": 2.0,
    }
    assert rm.echo_mismatches == 2 and rm.parse_failures == 0
    m = CombinedReward({"judge": rm})(Sample.batch(["q"], ["44"])).metrics()
    assert m["reward/judge/echo_mismatches"] == 1.0
    plain = GenerativeReward(
        url=serve(judge),
        template="{prompt}\nAnswer: {response}\nRight?",
        verdicts={"yes": 1.0, "no": 0.0},
        fallback=-1.0,
    )
    assert plain(Sample.batch(["q"] * 2, ["4.", "44"])).tolist() == [
        1.0,
        1.0,
    ]  # without the echo: paid


def test_config_errors():
    with pytest.raises(ValueError, match="exactly one of judge"):
        GenerativeReward(fallback=0.0)
    with pytest.raises(ValueError, match="both_orders applies"):
        GenerativeReward(url="http://x", fallback=0.0, both_orders=True)
    with pytest.raises(ValueError, match="no {response} field"):
        GenerativeReward(url="http://x", fallback=0.0, template="Rate: {prompt}")
    # a field of the other mode (or a typo) is refused when the judge is built, not at a step
    with pytest.raises(
        ValueError, match=r"template field \{response_b\} is not one of mode='score'"
    ):
        GenerativeReward(url="http://x", fallback=0.0, template="{response} vs {response_b}")
    with pytest.raises(ValueError, match=r"template field \{answer\} is not one of mode='choice'"):
        GenerativeReward(
            url="http://x", fallback=0.0, mode="choice", template="{response_a}{response_b}{answer}"
        )
    with pytest.raises(ValueError, match="not a valid regex"):
        GenerativeReward(url="http://x", fallback=0.0, pattern="(")
    with pytest.raises(ValueError, match="'echo' group applies to mode='score'"):
        GenerativeReward(url="http://x", fallback=0.0, mode="choice", pattern="(?P<echo>A)")


def test_local_judge_through_the_native_engine(tiny_model_dir):
    # A random tiny judge writes no digits it was asked for, or some: every verdict is either
    # parsed or counted as a failure with the fallback, never silently 0.
    rm = GenerativeReward(judge=str(tiny_model_dir), fallback=-5.0, max_tokens=4, device="cpu")
    out = rm(Sample.batch(["2+2?", "3+3?"], ["4", "6"]))
    fails = int(rm.last_metrics["parse_failures"])
    assert out.shape == (2,) and (out == -5.0).sum().item() == fails
    assert rm.judged == 2
