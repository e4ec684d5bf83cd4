"""The code sandbox against a hostile tester: each attack below scored 1.0, leaked a secret or
escaped on the previous sandbox; each must fail now, run as root (this process) and as the
unprivileged user nobody (uid 65534, a subprocess that runs the same checks).

Every check performs the attack for real and raises ``AssertionError`` when it succeeds."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightrft.rewards import Sample, code
from lightrft.rewards.code import CodeVerifier
from lightrft.rewards.code import TestCase as Case

ADD_TESTS = {"inputs": ["1 2"], "outputs": ["3"]}
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SQUARE_PLUS_ONE = ["assert f(3) == 10", "assert f(4) == 17"]
NOBODY = 65534
HARNESS_MARK = b"# lightrft-sandbox-harness"


@dataclass
class Context:
    verifier: CodeVerifier
    outside: Path  # a directory the verifier's user may write, visible on the host, not /tmp
    tmp: Path  # a directory under /tmp the verifier's user may write


def _score(ctx: Context, program: str, ref) -> float:
    return ctx.verifier(
        Sample.batch(["q"], ["```python\n" + program + "\n```"], references=[ref], labels=[None])
    )[0]


def _sandbox_processes(token: str = "") -> set[int]:
    """Processes that run the sandbox harness, or (with ``token``) any process that holds a file
    whose name contains ``token`` (whatever sandbox started it)."""
    found = set()
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            if token:
                if any(
                    token in os.readlink(f"/proc/{e}/fd/{fd}") for fd in os.listdir(f"/proc/{e}/fd")
                ):
                    found.add(int(e))
            elif HARNESS_MARK in Path(f"/proc/{e}/cmdline").read_bytes():
                found.add(int(e))
        except OSError:
            continue
    return found


# ------------------------------------------------------------------ fake passes


def check_nonce_from_stdin_file(ctx: Context) -> None:
    body = (
        "import os, sys\nif os.path.exists('stdin.txt'):\n"
        "    print(open('stdin.txt').read().strip(), flush=True)\n    os._exit(0)"
    )
    assert _score(ctx, body, ["assert False"]) == 0.0


def check_nonce_from_proc_fd0(ctx: Context) -> None:
    body = "import os\nprint(open('/proc/self/fd/0').read().strip(), flush=True)\nos._exit(0)"
    assert _score(ctx, body, ["assert False"]) == 0.0


def check_patch_builtins_exec(ctx: Context) -> None:
    body = "import builtins\nbuiltins.exec = lambda *a, **k: None"
    assert _score(ctx, body, ["assert False"]) == 0.0


def check_patch_builtins_compile(ctx: Context) -> None:
    body = (
        "import builtins\nreal = builtins.compile\n"
        "builtins.compile = lambda *a, **k: real('pass', 'x', 'exec')"
    )
    assert _score(ctx, body, ["assert False"]) == 0.0


# Reads the tests (test.py, or any string on the harness's stack) and hard-codes the answers.
READ_TESTS = """
import ast, os, sys
sources = [open('test.py').read()] if os.path.exists('test.py') else []
frame = sys._getframe(0)
while frame is not None:
    for d in (frame.f_locals, frame.f_globals):
        for v in list(d.values()):
            if isinstance(v, str):
                sources.append(v)
            elif isinstance(v, dict):
                sources += [x for x in v.values() if isinstance(x, str)]
    frame = frame.f_back
table = {}
for src in sources:
    try:
        tree = ast.parse(src)
    except SyntaxError:
        continue
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Call) and n.left.args:
            try:
                table[ast.literal_eval(n.left.args[0])] = ast.literal_eval(n.comparators[0])
            except ValueError:
                pass
def f(x):
    return table.get(x, -1)
"""


def check_hard_codes_the_tests(ctx: Context) -> None:
    assert _score(ctx, READ_TESTS, SQUARE_PLUS_ONE) == 0.0
    honest = "def f(x):\n    return x * x + 1"
    assert _score(ctx, honest, SQUARE_PLUS_ONE) == 1.0


def check_stack_inspection(ctx: Context) -> None:
    body = """
import os, re, sys
frame, found = sys._getframe(1), []
while frame is not None:
    for d in (frame.f_locals, frame.f_globals):
        found += [v for v in d.values() if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v)]
    frame = frame.f_back
print('\\n'.join(found))
sys.stdout.flush()
os._exit(0)
"""
    assert _score(ctx, body, ["assert False"]) == 0.0


def check_always_equal_object(ctx: Context) -> None:
    body = "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()"
    assert _score(ctx, body, SQUARE_PLUS_ONE) == 0.0
    sub = "class I(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return I(0)"
    assert _score(ctx, sub, SQUARE_PLUS_ONE) == 0.0


def check_shadowed_builtins(ctx: Context) -> None:
    """The test's own loop and ``all`` cannot be redefined by the program into a pass."""
    test = [
        "assert all(f(x) == x * x + 1 for x in range(1, 5))",
        "assert sum(f(x) for x in [1, 2]) == 7",
        "assert any(v == 10 for v in g())",
        "for x in range(1, 50):\n    assert f(x) == x * x + 1",
        "for y in range(1, 50):\n    assert f2(y) == y * y + 1",
    ]
    body = (
        "import builtins\nall = any = lambda *a: True\nrange = lambda *a: [0]\n"
        "sum = lambda *a: 7\nbuiltins.all, builtins.range = all, range\n"
        "def f(x):\n    return 1\ndef g():\n    return [0]\n"
        "def f2(y):  # rebinds the test's loop variable before the assert reads it\n"
        "    import sys\n    sys._getframe(1).f_globals['y'] = 0\n    return 1"
    )
    assert _score(ctx, body, test) == 0.0
    honest = "def f(x):\n    return x * x + 1\nf2 = f\ndef g():\n    return iter([1, 10])"
    assert _score(ctx, honest, test) == 1.0


FORGED = [
    b"[0, []]",
    b'[0, [["x", "AssertionError"]]]',
    b'[0, [["?", 1]]]',
    b"[7, []]",
    b'[0, [["f", "nan"]]]',
    b"not json",
    b'[0, [["n", null]]]',
]


def check_forged_reports(ctx: Context) -> None:
    """Anything written to the report channel only claims values of the asked expressions."""
    lines = b"\n".join(FORGED) + b"\n"
    body = (
        f"import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, {lines!r})\n"
        "    except OSError:\n        pass\ndef f(x):\n    return -1"
    )
    assert _score(ctx, body, SQUARE_PLUS_ONE) == 0.0


# ------------------------------------------------------------------ secrets and escapes


ONE_CHECK = """
import sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import test_rewards_code_sandbox as t
t.ATTACKS[sys.argv[3]](t.Context(t.make_verifier(), Path(sys.argv[4]), Path(sys.argv[5])))
"""


def check_parent_environ(ctx: Context) -> None:
    """A reward server started with its token: the program looks for it in every process's
    environment (/proc/<pid>/environ: the parent's shows the variables it was started with)."""
    initial = Path("/proc/self/environ").read_bytes().split(b"\0")
    tokens = [
        kv.split(b"=", 1)[1].decode() for kv in initial if kv.startswith(b"LIGHTRFT_REWARD_TOKEN=")
    ]
    if not tokens:  # run this check again in a process started with a token
        env = {**os.environ, "LIGHTRFT_REWARD_TOKEN": "tok-" + secrets.token_hex(12)}
        lib = str(Path(code.__file__).parents[2])
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                ONE_CHECK,
                lib,
                str(Path(__file__).parent),
                "parent_environ",
                str(ctx.outside),
                str(ctx.tmp),
            ],
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return
    secret = tokens[0]
    leak = ctx.outside / "leak.txt"
    body = f"""
import os
found = []
for pid in os.listdir('/proc'):
    try:
        env = open(f'/proc/{{pid}}/environ', 'rb').read()
    except OSError:
        continue
    found += [kv for kv in env.split(b'\\0') if kv.startswith(b'LIGHTRFT_REWARD_TOKEN=')]
for kv in found:
    print(kv.decode())
    try:
        open({str(leak)!r}, 'ab').write(kv)
    except OSError:
        pass
{ADD}"""
    got = ctx.verifier.run(body, Case(stdin="1 2", stdout="3"))
    assert secret not in got.stdout and not leak.exists(), "the token leaked"
    assert got.passed  # it still answers: only the leak is stopped


def check_root_only_file(ctx: Context) -> None:
    if os.getuid() != 0:
        return  # a file only root may read needs root to create
    secret = secrets.token_hex(8)
    path = ctx.outside / "root-only.txt"
    path.write_text(secret)
    path.chmod(0o600)
    try:
        got = ctx.verifier.run(f"print(open({str(path)!r}).read())", Case(stdin="", stdout=""))
        assert secret not in got.stdout
    finally:
        path.unlink()


def _write_attempts(targets: list[Path]) -> str:
    return "".join(
        f"try:\n    open({str(t)!r}, 'w').write('pwned')\nexcept OSError:\n    pass\n"
        for t in targets
    )


def check_getframe_guard_lift(ctx: Context) -> None:
    targets = [ctx.outside / "lifted.txt", ctx.tmp / "lifted.txt"]
    body = "import sys\nsys._getframe(1).f_globals['_root'] = '/'\n" + _write_attempts(targets)
    _score(ctx, body + ADD, ADD_TESTS)
    assert not any(t.exists() for t in targets)


def check_posixsubprocess_shell(ctx: Context) -> None:
    targets = [ctx.outside / "shell.txt", ctx.tmp / "shell.txt"]
    cmd = "; ".join(f"echo pwned > {t}" for t in targets)
    body = f"""
import os, _posixsubprocess
r, w = os.pipe()
pid = _posixsubprocess.fork_exec([b"/bin/sh", b"-c", {cmd.encode()!r}], [b"/bin/sh"], True, (w,),
    None, None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
os.close(w)
os.read(r, 100)
os.waitpid(pid, 0)
{ADD}"""
    _score(ctx, body, ADD_TESTS)
    assert not any(t.exists() for t in targets)


def check_ctypes_write(ctx: Context) -> None:
    targets = [ctx.outside / "ctypes.txt", ctx.tmp / "ctypes.txt"]
    body = "import ctypes\nlibc = ctypes.CDLL(None)\n" + "".join(
        f"fd = libc.open({str(t).encode()!r}, 0o101, 0o644)\nlibc.write(fd, b'x', 1)\n"
        for t in targets
    )
    _score(ctx, body + ADD, ADD_TESTS)
    assert not any(t.exists() for t in targets)


def check_setsid_daemon(ctx: Context) -> None:
    token = "beat-" + secrets.token_hex(6)
    beat = ctx.outside / token
    body = f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        files = [open({token!r}, 'a')]  # named so the test can find this process
        try:
            files.append(open({str(beat)!r}, 'a'))  # outside, where the host can see it grow
        except OSError:
            pass
        while True:
            for f in files:
                f.write('.')
                f.flush()
            time.sleep(0.05)
    os._exit(0)
time.sleep(0.3)
{ADD}"""
    assert _score(ctx, body, ADD_TESTS) == 1.0
    size = beat.stat().st_size if beat.exists() else 0
    time.sleep(0.3)
    assert (beat.stat().st_size if beat.exists() else 0) == size, "the daemon still writes"
    assert _sandbox_processes(token) == set(), "the daemon outlived the check"


def check_tcp_to_local_port(ctx: Context) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        body = (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            f"    print('connected')\nexcept OSError as e:\n    print('refused', e)\n"
        )
        result = ctx.verifier.run(body, Case(stdin="", stdout="refused"))
        server.setblocking(False)
        try:  # a completed connection waits in the listen backlog
            server.accept()[0].close()
            connected = True
        except BlockingIOError:
            connected = False
    assert not connected and "connected" not in result.stdout, result.stdout


def check_no_capabilities(ctx: Context) -> None:
    body = "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])"
    got = ctx.verifier.run(body, Case(stdin="", stdout="0000000000000000"))
    assert got.passed, got.stdout


# ------------------------------------------------------------------ limits that already held


def _ends_scoring_zero(ctx: Context, body: str, ref=ADD_TESTS) -> None:
    start = time.monotonic()
    assert _score(ctx, body, ref) == 0.0
    assert time.monotonic() - start < ctx.verifier.timeout + 3
    time.sleep(0.1)


def check_fork_bomb(ctx: Context) -> None:
    ctx = Context(CodeVerifier(timeout=0.5, max_processes=16), ctx.outside, ctx.tmp)
    _ends_scoring_zero(
        ctx,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    )


def check_alloc_10gb(ctx: Context) -> None:
    _ends_scoring_zero(ctx, "x = bytearray(10 * 1024**3)\nprint(3)")


def check_print_1gb(ctx: Context) -> None:
    _ends_scoring_zero(
        ctx, "import sys\nc = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(c)"
    )


def check_os_exit(ctx: Context) -> None:
    _ends_scoring_zero(ctx, "import os\nprint('ok')\nos._exit(0)", ["assert False"])


def check_sys_exit(ctx: Context) -> None:
    _ends_scoring_zero(ctx, "import sys\nprint('ok')\nsys.exit(0)", ["assert False"])


FAKE_PASSES = {
    "nonce_from_stdin_file": check_nonce_from_stdin_file,
    "nonce_from_proc_fd0": check_nonce_from_proc_fd0,
    "patch_builtins_exec": check_patch_builtins_exec,
    "patch_builtins_compile": check_patch_builtins_compile,
    "hard_codes_the_tests": check_hard_codes_the_tests,
    "stack_inspection": check_stack_inspection,
    "always_equal_object": check_always_equal_object,
    "shadowed_builtins": check_shadowed_builtins,
    "forged_reports": check_forged_reports,
    "os_exit": check_os_exit,
    "sys_exit": check_sys_exit,
}
CONTAINMENT = {
    "parent_environ": check_parent_environ,
    "root_only_file": check_root_only_file,
    "getframe_guard_lift": check_getframe_guard_lift,
    "posixsubprocess_shell": check_posixsubprocess_shell,
    "ctypes_write": check_ctypes_write,
    "setsid_daemon": check_setsid_daemon,
    "tcp_to_local_port": check_tcp_to_local_port,
    "no_capabilities": check_no_capabilities,
    "fork_bomb": check_fork_bomb,
    "alloc_10gb": check_alloc_10gb,
    "print_1gb": check_print_1gb,
}
ATTACKS = {**FAKE_PASSES, **CONTAINMENT}


def make_verifier() -> CodeVerifier:
    return CodeVerifier(timeout=1.5, memory_mb=512, max_output_bytes=1 << 16, workers=1)


# ------------------------------------------------------------------ as this user (root here)


@pytest.fixture(scope="module")
def dirs():
    """``outside``: a fresh directory beside the repository (not under a masked directory);
    ``tmp``: one under /tmp; both writable by nobody too, removed afterwards."""
    outside = Path(tempfile.mkdtemp(prefix=".sandbox-target-", dir=Path(__file__).parents[2]))
    tmp = Path(tempfile.mkdtemp(prefix="sandbox-target-"))
    for d in (outside, tmp):
        d.chmod(0o777)
    yield outside, tmp
    shutil.rmtree(outside, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def isolated():
    problem = code._isolation_problem()
    if problem is not None:
        pytest.skip(f"this machine cannot create the sandbox's namespaces: {problem}")


def _ctx(dirs, sub: str) -> Context:
    outside, tmp = (d / sub for d in dirs)
    for d in (outside, tmp):
        d.mkdir(exist_ok=True)
        d.chmod(0o777)
    return Context(make_verifier(), outside, tmp)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_fails_as_this_user(name, dirs, isolated):
    before = _sandbox_processes()
    ATTACKS[name](_ctx(dirs, name))
    assert _sandbox_processes() - before == set()


@pytest.mark.parametrize("name", sorted(FAKE_PASSES))
def test_fake_pass_fails_without_isolation(name, dirs, monkeypatch):
    """The verdict does not depend on the namespaces: forced off, fake passes still fail."""
    monkeypatch.setattr(code, "_isolation_problem", lambda: "forced off by the test")
    monkeypatch.setattr(code, "_warned", set())
    with pytest.warns(RuntimeWarning, match="NOT isolated here"):
        FAKE_PASSES[name](_ctx(dirs, "fallback-" + name))


# ------------------------------------------------------------------ as nobody

# Runs as root: a private mount namespace where nobody can reach this interpreter (root's home
# is mode 700 here) and nothing else of root's home, then drops to nobody and runs RUNNER.
DROP = """
import os, sys
sys.path.insert(0, sys.argv[1])
import _sandbox_child as c
c._ok(c._libc.unshare(c.CLONE_NEWNS), "unshare")
c._mount(None, "/", None, c.MS_REC | c.MS_PRIVATE)
keep = [(p, os.open(p, os.O_PATH)) for p in c._python_dirs() if c._under(p, "/root")]
if keep:
    c._mount("tmpfs", "/root", "tmpfs", 0, "size=1m,mode=755")
    for p, fd in keep:
        os.makedirs(p, exist_ok=True)
        c._mount(f"/proc/self/fd/{fd}", p, None, c.MS_BIND)
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
if not os.access(sys.executable, os.X_OK):
    print('{"__skip__": "nobody cannot run this interpreter"}')
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2], *sys.argv[3:]])
"""
RUNNER = """
import json, os, sys, traceback
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import test_rewards_code_sandbox as t
from lightrft.rewards import code
from lightrft.rewards import Sample
assert os.getuid() == 65534
problem = code._isolation_problem()
if problem is not None:
    print(json.dumps({"__skip__": f"no namespaces for nobody here: {problem}"}))
    sys.exit(0)
out = {}
for name in sorted(t.ATTACKS):
    ctx = t.Context(t.make_verifier(), Path(sys.argv[2]), Path(sys.argv[3]))
    before = t._sandbox_processes()
    try:
        t.ATTACKS[name](ctx)
        assert t._sandbox_processes() - before == set(), "sandbox processes left"
        out[name] = "ok"
    except BaseException:
        out[name] = traceback.format_exc()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def as_nobody(dirs):
    """The checks' results when the verifier runs as nobody (one subprocess for all)."""
    if os.getuid() != 0:
        pytest.skip("not root, so nobody cannot be switched to; this user's run covers non-root")
    outside, tmp = dirs[0] / "nobody", dirs[1] / "nobody"
    for d in (outside, tmp):
        d.mkdir()
        os.chown(d, NOBODY, NOBODY)
    repo = Path(__file__).parents[2]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp),
        "LIGHTRFT_REWARD_TOKEN": "tok-" + secrets.token_hex(12),
        "TMPDIR": str(tmp),
        "PYTHONPATH": str(repo),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            DROP,
            str(Path(code.__file__).parent),
            RUNNER,
            str(Path(__file__).parent),
            str(outside),
            str(tmp),
        ],
        capture_output=True,
        env=env,
        timeout=300,
        cwd=str(tmp),
    )
    lines = done.stdout.decode().strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr.decode()[-3000:]
    results = json.loads(lines[-1])
    if "__skip__" in results:
        pytest.skip(results["__skip__"])
    return results


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_fails_as_nobody(name, as_nobody):
    assert as_nobody[name] == "ok", as_nobody[name]


def test_require_isolation_runs_where_isolation_works(isolated):
    strict = CodeVerifier(timeout=2.0, require_isolation=True)
    fn = "```python\ndef f(x):\n    return x * x + 1\n```"
    refs = [ADD_TESTS, SQUARE_PLUS_ONE]
    assert strict(
        Sample.batch(
            ["q", "q"], ["```python\n" + ADD + "```", fn], references=refs, labels=[None, None]
        )
    ) == [1.0, 1.0]


def test_isolation_works_from_a_virtual_environment_under_a_masked_directory(tmp_path, isolated):
    """A venv in /tmp (or /home, /root: directories the sandbox masks) runs the sandbox under
    ``-S``, where ``sys.prefix`` no longer names the venv: its interpreter must stay visible,
    or every program of such a user runs unisolated."""
    venv = tmp_path / "venv"
    if not str(venv).startswith(("/tmp/", "/home/", "/root/")):
        pytest.skip(f"pytest's tmp_path {tmp_path} is not in a directory the sandbox masks")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-S", code._CHILD, "probe"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
