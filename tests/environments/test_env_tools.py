"""Tools: schemas, argument validation, the calculator, the sandboxed python tool, and every way
a call can fail becoming an error result (never an exception)."""

import gc
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightrft.environments import ErrorKind, Tool, calculator, calculator_tool, python_tool
from lightrft.environments.tools import validate_arguments


def scale(x: int, factor: float, unit: str = "m", exact: bool = False) -> str:
    """Scale a length.

    Args:
        x: the length.
        factor: the factor.
        unit: the unit (choices: ["m", "km"])
        exact: whether to keep all digits.
    """
    return f"{x * factor}{unit}{'!' if exact else ''}"


def test_schema_is_transformers_and_drives_the_call():
    tool = Tool(scale)
    fn = tool.schema["function"]
    assert tool.name == "scale" and fn["description"] == "Scale a length."
    assert fn["parameters"]["required"] == ["x", "factor"]
    assert fn["parameters"]["properties"]["unit"]["enum"] == ["m", "km"]
    result = tool.run({"x": 3, "factor": 2.5, "unit": "km"})
    assert (result.text, result.error) == ("7.5km", None)
    assert tool.run({"x": 3, "factor": 2}).text == "6m"  # an int is a JSON number


def test_a_function_without_a_schema_is_refused_naming_it():
    def untyped(a):
        """No hints.

        Args:
            a: something.
        """

    def undocumented(a: int) -> str:
        return str(a)

    with pytest.raises(
        ValueError, match=r"tool .*untyped: cannot generate its JSON schema.*type hint"
    ):
        Tool(untyped)
    with pytest.raises(ValueError, match=r"tool .*undocumented: cannot generate"):
        Tool(undocumented)


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({"factor": 1.0}, "misses required key(s) ['x']"),
        ({"x": 1, "factor": 1.0, "speed": 2}, "unknown key(s) ['speed']"),
        ({"x": 1.5, "factor": 1.0}, "arguments.x must be integer, got number 1.5"),
        ({"x": True, "factor": 1.0}, "arguments.x must be integer, got boolean true"),
        ({"x": 1, "factor": False}, "arguments.factor must be number, got boolean false"),
        ({"x": 1, "factor": "2"}, "arguments.factor must be number, got string"),
        ({"x": 1, "factor": 1.0, "unit": "mile"}, "arguments.unit must be one of ['m', 'km']"),
        ({"x": 1, "factor": 1.0, "exact": 1}, "arguments.exact must be boolean, got integer 1"),
        ([1, 2], "arguments must be a JSON object, got array"),
    ],
)
def test_bad_arguments_are_an_error_result(arguments, problem):
    result = Tool(scale).run(arguments)
    assert result.error is ErrorKind.bad_arguments
    assert result.text.startswith("Error: bad arguments for tool 'scale': ")
    assert problem in result.text


def test_validation_of_nested_and_nullable_types():
    def f(
        xs: list[int], pair: tuple[int, str], table: dict[str, float], note: str | None = None
    ) -> str:
        """F.

        Args:
            xs: numbers.
            pair: a pair.
            table: a table.
            note: a note.
        """
        return "ok"

    params = Tool(f).schema["function"]["parameters"]
    good = {"xs": [1, 2], "pair": [1, "a"], "table": {"a": 1.5}, "note": None}
    assert validate_arguments(params, good) is None
    assert "arguments.xs[1] must be integer" in validate_arguments(params, {**good, "xs": [1, "2"]})
    assert "arguments.pair must have 2 items" in validate_arguments(params, {**good, "pair": [1]})
    assert "arguments.table.a must be number" in validate_arguments(
        params, {**good, "table": {"a": "x"}}
    )


def test_results_text_json_data_and_non_text():
    def returns(kind: str) -> str:
        """Return something.

        Args:
            kind: what.
        """
        return {"str": "plain", "data": {"a": [1, 2.5, True, None]}, "none": None, "bytes": b"x"}[
            kind
        ]

    tool = Tool(returns)
    assert tool.run({"kind": "str"}).text == "plain"
    data = tool.run({"kind": "data"})
    assert (data.text, data.error) == ('{"a": [1, 2.5, true, null]}', None)
    for kind, what in (("none", "NoneType"), ("bytes", "bytes")):
        bad = tool.run({"kind": kind})
        assert bad.error is ErrorKind.non_text_result
        assert bad.text == f"Error: tool 'returns' returned a {what}, not text"


def test_raising_tool_is_an_error_result():
    def boom(x: int) -> str:
        """Fail.

        Args:
            x: ignored.
        """
        raise RuntimeError("the disk is full")

    result = Tool(boom).run({"x": 1})
    assert result.error is ErrorKind.tool_exception
    assert result.text == "Error: tool 'boom' failed: RuntimeError: the disk is full"


def test_megabyte_output_is_truncated_and_says_so():
    def spew(n: int) -> str:
        """Print a lot.

        Args:
            n: characters.
        """
        return "y" * n

    result = Tool(spew, max_output_chars=100).run({"n": 3_000_000})
    assert result.error is ErrorKind.tool_output_truncated
    assert (
        result.text == "y" * 100 + "\n[output truncated: 3000000 characters, the first 100 shown]"
    )
    assert Tool(spew, max_output_chars=100).run({"n": 100}).error is None


def test_hanging_tool_times_out_without_waiting():
    release = threading.Event()

    def hang(x: int) -> str:
        """Block.

        Args:
            x: ignored.
        """
        release.wait(60)
        return "late"

    try:
        start = time.monotonic()
        result = Tool(hang, timeout=0.3).run({"x": 1})
        assert time.monotonic() - start < 2.0
        assert result.error is ErrorKind.tool_timeout
        assert result.text == "Error: tool 'hang' did not finish within 0.3 s"
    finally:
        release.set()  # the abandoned thread ends; Python cannot kill it (tools.py docstring)


def test_cpu_bound_hang_returns_at_the_deadline():
    def spin(seconds: float) -> str:
        """Busy-loop in pure Python.

        Args:
            seconds: how long.
        """
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "done"

    start = time.monotonic()
    result = Tool(spin, timeout=0.2).run({"seconds": 1.0})
    assert result.error is ErrorKind.tool_timeout and time.monotonic() - start < 0.9


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", "14"),
        ("(12345 * 678) / 4", "2092477.5"),
        ("-(7) // 2", "-4"),
        ("-7 % 3", "2"),
        ("0.1 + 0.2", "0.3"),  # exact: the literals' own digits, not binary floats
        ("2 ** -2", "0.25"),
        ("1 / 3", "1/3 (about 0.333333333333)"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("-1 ** 1000001", "-1"),
    ],
)
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, error",
    [
        ("9**9**9", "too large"),
        ("10 ** 10 ** 5", "too large"),
        ("1 / 0", "ZeroDivisionError: division by zero"),
        ("5 % (2 - 2)", "ZeroDivisionError: division by zero"),
        ("2 ** 0.5", "whole-number exponents"),
        ("__import__('os')", "unsupported in an arithmetic expression"),
        ("x + 1", "unsupported in an arithmetic expression: 'x'"),
        ("2 +", "not an arithmetic expression"),
        ("1" * 2000, "longer than 1000 characters"),
    ],
)
def test_calculator_refuses_quickly(expression, error):
    tool = calculator_tool()
    start = time.monotonic()
    result = tool.run({"expression": expression})
    assert time.monotonic() - start < 0.5
    assert result.error is ErrorKind.tool_exception and error in result.text


# Hostile expressions: each is answered or refused in under 100 ms, before any huge number is
# built (the work holds the GIL, so the tool's timeout thread could never interrupt it).
HOSTILE_EXPRESSIONS = [
    "1e999999999",
    "1e2000000",
    "1e8000000",
    "1e-3000000",
    "-1e-999999999999999999999",
    "1.5e+0000000000000000000000000000000000000000009999",
    "2**8000 * 2**7000",  # passed the old 16384-bit bound, then failed str()'s 4300 digits
    "3**8380",  # 3998 digits: answered in full
    "1/2**13000",  # a terminating decimal of 13000 places: written p/q
    "0.5**13000",
    "(2**13000 + 1) / 2**13000",
    "1/5**5000",
    "2**13000 / 3",  # too large for a float: the approximation is a Decimal
    "-1 ** 10**900",
    "(1/3)**4000",
    "9**9**9**9",
    "1" + "*9" * 499,
    "+".join(["9" * 8] * 110),
    "-" * 998 + "1",
    "(" * 200 + "1" + ")" * 200,
]


@pytest.mark.parametrize("expression", HOSTILE_EXPRESSIONS)
def test_calculator_bounds_every_expression(expression):
    # this thread's CPU time: a spinning tool thread another test left behind shares the GIL;
    # a collection first, so a garbage collection of other tests' objects is not timed
    gc.collect()
    start = time.thread_time()
    try:
        text = calculator(expression)
    except (ValueError, ZeroDivisionError) as e:
        text = str(e)
    seconds = time.thread_time() - start
    assert seconds < 0.1, f"{expression[:40]!r} took {seconds:.3f} s"
    assert len(text) < 2 * 4000 + 100


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1e999999999", "too large (more than 4000 digits)"),
        ("1e-3000000", "too large (more than 4000 digits)"),
        ("2**8000 * 2**7000", "too large (more than 4000 digits)"),
        ("0e99999999999", "0"),
        ("1_000.5e3", "1000500"),
        ("0**0", "1"),
        ("(-1)**-3", "-1"),
        ("2**13000 / 3", "(about 8.18130111038e+3912)"),
        ("(2**13000 + 1) / 2**13000", "(about 1)"),
        ("1/5**50", "0." + "0" * 34 + "1125899906842624"),
        ("3**8380", str(3**8380)),
    ],
)
def test_calculator_huge_literals_and_results(expression, value):
    try:
        text = calculator(expression)
    except ValueError as e:
        text = str(e)
    assert text.endswith(value) if value.startswith("(") else value in text


def test_calculator_environment_answers_a_huge_literal_at_once(tmp_path):
    """The issue's reproduction, in a child process: before the fix it had not returned after
    90 s (the Fraction of 10**999999999 holds the GIL, so the 2 s timeout never fired)."""
    script = (
        "import time\n"
        "from lightrft.environments import ToolEnvironment, calculator_tool\n"
        "env = ToolEnvironment([calculator_tool(timeout=2.0)])\n"
        "t = time.monotonic()\n"
        's = env.step(\'<tool_call>{"name":"calculator","arguments":'
        '{"expression":"1e999999999"}}</tool_call>\')\n'
        "print(round(time.monotonic() - t, 3), s.observation[0]['content'])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seconds, text = out.stdout.split(" ", 1)
    assert float(seconds) < 0.1
    assert text.strip() == (
        "Error: tool 'calculator' failed: ValueError: the result is too large "
        "(more than 4000 digits)"
    )


# The python tool runs each call in the code reward's sandbox: real subprocesses.


@pytest.fixture(scope="module")
def py():
    return python_tool(timeout=1.0, max_output_chars=200)


def test_python_tool_prints_and_shows_tracebacks(py):
    assert py.run({"code": "print(6 * 7)"}).text == "42\n"
    result = py.run({"code": "import sys\nprint('note', file=sys.stderr)\nx = 1 / 0"})
    assert result.error is None  # the program failed, the tool did not: the model reads why
    assert result.text.startswith("note\nTraceback (most recent call last):\n")
    assert 'File "<tool>", line 3, in <module>' in result.text
    assert result.text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "exec(compile(" not in result.text  # the wrapper's own frame is left out
    assert py.run({"code": "x = 1"}).text == "(no output)"


def test_python_tool_timeout_and_megabytes(py):
    hung = py.run({"code": "while True:\n    pass"})
    assert hung.error is ErrorKind.tool_timeout
    assert hung.text == "Error: tool 'python': the program did not finish within 1 s"
    loud = py.run({"code": "print('z' * 5_000_000)"})
    assert loud.error is ErrorKind.tool_output_truncated
    assert loud.text.startswith("z" * 200 + "\n[output truncated: ")


def test_python_tool_is_the_sandbox(py):
    # the same isolation as the code reward: no network, a private /tmp, no writes outside
    code = (
        "import os, socket\n"
        "print(sorted(p for p in os.listdir('/tmp') if not p.startswith('lightrft-code-')))\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
        "    print('network')\n"
        "except OSError:\n"
        "    print('no network')\n"
    )
    from lightrft.rewards._sandbox_child import _python_dirs  # noqa: PLC2701
    from lightrft.rewards.code import _isolation_problem  # noqa: PLC2701 - skip where not isolated

    if _isolation_problem() is not None:
        pytest.skip("no namespaces on this machine")
    # /tmp holds nothing but the interpreter's own directories (a venv there), read-only
    python = sorted({Path(d).parts[2] for d in _python_dirs() if Path(d).parts[1:2] == ("tmp",)})
    assert py.run({"code": code}).text == f"{python}\nno network\n"


_FORKS = """
import os, sys
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (100 << 20)  # touched: 100 MiB resident in each child
        import time; time.sleep(0.5)
        os._exit(0)
    pids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
print("children", codes)
"""


def _memory_cgroups() -> bool:
    import os

    return os.getuid() == 0 and os.path.isdir("/sys/fs/cgroup/memory")


@pytest.mark.skipif(not _memory_cgroups(), reason="needs root and cgroup v1's memory controller")
def test_python_tool_memory_bounds_the_call_not_each_process():
    """Before: memory_mb bounded each process, so a call forking 4 children used 4x it."""
    tool = python_tool(timeout=5.0, memory_mb=256)
    text = tool.run({"code": _FORKS}).text
    codes = [int(c) for c in text.split("[", 1)[1].split("]", 1)[0].split(",")]
    assert len(codes) == 4 and codes.count(0) < 4, text  # 400 MiB do not fit in 256


def test_python_tool_caps_sandboxes_at_once():
    """Before: nothing capped the sandboxes of a rollout's threads. Two calls per tool, three
    tools, a cap of 2: never more than 2 programs alive at once (each program records when it
    ran; the windows never overlap three deep)."""
    tools = [python_tool(timeout=5.0, max_concurrent=2) for _ in range(3)]
    code = "import time; a = time.time(); time.sleep(0.6); print(a, time.time())"
    results: list[str] = []

    def call(tool):
        results.append(tool.run({"code": code}).text)

    threads = [threading.Thread(target=call, args=(t,)) for t in tools for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    windows = [tuple(map(float, r.split())) for r in results]
    assert len(windows) == 6, results
    for a, _ in windows:
        assert sum(1 for s, e in windows if s <= a < e) <= 2, windows
    with pytest.raises(ValueError, match="max_concurrent must be >= 1"):
        python_tool(max_concurrent=0)
