"""CodeVerifier: test formats, rewards, and hostile programs in the sandbox (each must end within
its limit, score 0 and leave no process or file behind)."""

import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from lightrft.rewards import Sample, code
from lightrft.rewards.base import RewardInputError
from lightrft.rewards.code import CodeVerifier, extract_code, parse_tests

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = {"inputs": ["1 2\n", "3 4\n", "10 -10\n"], "outputs": ["3\n", "7\n", "0\n"]}


@pytest.fixture(scope="module")
def verifier():
    return CodeVerifier(timeout=2.0, memory_mb=512, max_output_bytes=1 << 16, workers=2)


def _score(v, responses, refs):
    return v(
        Sample.batch(
            ["q"] * len(responses), responses, references=refs, labels=[None] * len(responses)
        )
    )


def test_formats_and_rewards(verifier):
    lcb = json.dumps([{"input": "5 5", "output": "10", "testtype": "stdin"}])
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]
    fn = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\nprint(0)\n```"
    out = _score(
        verifier, [ADD, ADD, fn, fn, wrong], [TESTS, lcb, asserts, "assert add(1,1)==2", TESTS]
    )
    assert out == [1.0, 1.0, 0.5, 1.0, pytest.approx(1 / 3)]
    assert _score(CodeVerifier(mode="all", timeout=2.0), [fn], [asserts]) == [0.0]


def test_parse_and_extract():
    assert extract_code("a\n```py\nx=1\n```\nb\n```python\nx=2\n```") == "x=2\n"
    assert extract_code("print(1)") == "print(1)"
    assert len(parse_tests(json.dumps(TESTS))) == 3
    with pytest.raises(ValueError, match="fn_name"):
        parse_tests({"inputs": [[1]], "outputs": [2], "fn_name": "f"})
    for ref, why in (
        ({"nope": 1}, "unknown test format"),
        ({"inputs": 5, "outputs": [1]}, "int"),
        (["assert f(1) == 2", "assert f(1) =="], "not valid Python"),
        (["assert __lightrft_report__ == 2"], "reserved name"),
    ):
        with pytest.raises(RewardInputError, match=f"sample 1: bad test cases: .*{why}"):
            CodeVerifier()(
                Sample.batch(["q", "q"], ["x", "x"], references=[TESTS, ref], labels=[None, None])
            )


def test_correct_programs_pass_every_format(verifier):
    fn = (
        "```python\nimport math\ndef f(x):\n    return x * x\ndef g(n):\n    return (i for i in range(n))\n"
        "def h(x):\n    return None if x < 0 else {'sq': f(x), 'pair': (x, -x)}\n```"
    )
    block = (
        "import math\nvals = [1, 2, 3]\nfor v in vals:\n    assert f(v) == v * v\n"
        "def check(candidate):\n    assert candidate(4) == 16\n    assert candidate(-2) > 0\n"
        "check(f)\nassert list(g(3)) == [0, 1, 2]\nassert sorted(set(g(4)), reverse=True) == [3, 2, 1, 0]\n"
        "assert math.isclose(f(0.1), 0.01, rel_tol=1e-9)\nassert abs(f(1.5) - 2.25) < 1e-12\n"
        "assert h(-1) is None and h(2) == {'sq': 4, 'pair': (2, -2)}\n"
        "assert h(-1) is None or h(-1)['sq'] == 0\nassert len(h(3)) == 2 and h(3)['pair'][1] == -3\n"
    )
    refs = [block, {"asserts": ["assert f(2) == 4", "assert not f(0)"]}, ["assert f(3) == 9"]]
    assert _score(verifier, [fn] * 3, refs) == [1.0, 1.0, 1.0]
    wrong = fn.replace("return x * x", "return x * x + (x == 3)")
    assert _score(verifier, [wrong] * 3, refs) == [0.0, 1.0, 0.0]


def test_require_isolation_refuses_before_any_run(monkeypatch):
    monkeypatch.setattr(code, "_isolation_problem", lambda: "user namespaces are off (test)")
    monkeypatch.setattr(code.subprocess, "Popen", lambda *a, **k: pytest.fail("a run started"))
    strict = CodeVerifier(require_isolation=True)
    with pytest.raises(RuntimeError, match="require_isolation=True.*user namespaces are off"):
        strict(Sample.batch(["q"], [ADD], references=[TESTS], labels=[None]))


def test_fallback_warns_once_and_still_scores(monkeypatch):
    monkeypatch.setattr(code, "_isolation_problem", lambda: "user namespaces are off (test)")
    monkeypatch.setattr(code, "_warned", set())
    v = CodeVerifier(timeout=2.0)
    with pytest.warns(RuntimeWarning) as got:
        assert _score(v, [ADD, ADD], [TESTS, TESTS]) == [1.0, 1.0]
    msgs = [str(w.message) for w in got if "NOT isolated" in str(w.message)]
    assert len(msgs) == 1
    for part in (
        "user namespaces are off (test)",
        "read every file",
        "environ",
        "daemons",
        "require_isolation=True",
    ):
        assert part in msgs[0]


def test_early_exit_cannot_fake_asserts(verifier):
    cheat = "```python\nimport os\nprint('ok')\nos._exit(0)\n```"
    assert _score(verifier, [cheat], [["assert False"]]) == [0.0]


def _run_hostile(v, body, ref=None):
    before = _session_members_all()
    start = time.monotonic()
    out = _score(v, ["```python\n" + body + "\n```"], [ref or TESTS])
    took = time.monotonic() - start
    time.sleep(0.2)
    left = _session_members_all() - before
    return out, took, left


def _session_members_all():
    """Processes running the sandbox launcher or a sandboxed program now."""
    found = set()
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                cmd = Path(f"/proc/{e}/cmdline").read_bytes()
            except OSError:
                continue
            if b"_sandbox_child.py" in cmd or b"# lightrft-sandbox-harness" in cmd:
                found.add(int(e))
    return found


HOSTILE = {
    "infinite_loop": "while True:\n    pass",
    "sleep_forever": "import time\ntime.sleep(1000)",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "alloc_10gb": "x = bytearray(10 * 1024**3)\nprint(3)",
    "print_1gb": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)",
    "detached_child": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
        "a, b = map(int, input().split())\nprint(a + b)"
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs(verifier, name):
    out, took, left = _run_hostile(verifier, HOSTILE[name], {"inputs": ["1 2"], "outputs": ["3"]})
    assert took < 2.0 + 0.5 + 3  # the limit, the launcher's start, cleanup

    if name == "detached_child":  # it answers right, but its escaped child must be gone
        assert out == [1.0]
    else:
        assert out == [0.0]
    assert left == set()
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("lightrft-code-*/program.py"))


def test_no_network(verifier):
    if os.getuid() != 0 and code._isolation_problem() is not None:
        pytest.skip("neither root nor user namespaces: no network namespace here")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    got = []
    t = threading.Thread(target=lambda: got.append(_accept(server)))
    t.start()
    body = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint(3)"
    out, _, left = _run_hostile(verifier, body, {"inputs": ["1 2"], "outputs": ["3"]})
    t.join()
    server.close()
    assert out == [0.0] and got == [None] and left == set()


def _accept(server):
    try:
        conn, _ = server.accept()
        conn.close()
        return "connected"
    except OSError:
        return None


def test_write_outside_tmp(verifier, tmp_path):
    target = tmp_path / "pwned.txt"
    body = f"open({str(target)!r}, 'w').write('x')\nprint(3)"
    out, _, left = _run_hostile(verifier, body, {"inputs": ["1 2"], "outputs": ["3"]})
    assert left == set()
    assert out == [0.0] and not target.exists()
    body = f"import os\nos.system('touch {target}')\nprint(3)"
    out, _, _ = _run_hostile(verifier, body, {"inputs": ["1 2"], "outputs": ["3"]})
    assert out == [0.0] and not target.exists()
    # Writing inside its own directory is fine.
    body = "open('scratch.txt', 'w').write('3')\nprint(open('scratch.txt').read())"
    out, _, _ = _run_hostile(verifier, body, {"inputs": ["1 2"], "outputs": ["3"]})
    assert out == [1.0]


def test_isolation_probe_leaves_the_host_alone():
    """The probe runs the real setup once; it must not touch the directory it starts in (it
    once chowned /tmp to nobody) nor leave a directory behind."""
    tmp = Path(tempfile.gettempdir())
    before = os.stat(tmp)
    probes_before = set(tmp.glob("lightrft-probe-*"))
    code._isolation_problem.__wrapped__()  # a fresh probe, not the cached verdict
    after = os.stat(tmp)
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert set(tmp.glob("lightrft-probe-*")) == probes_before
