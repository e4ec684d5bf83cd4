"""The ``lightrft`` command makes OpenMP's idle threads sleep rather than spin (docs/performance.md)."""

import os
import subprocess
import sys

_PROBE = (
    "import time, lightrft.cli, torch\n"
    "torch.set_num_threads(2); a = torch.randn(256, 256)\n"
    "for _ in range(20): a @ a\n"
    "t = time.process_time(); time.sleep(1.0)\n"
    "print(__import__('os').environ['OMP_WAIT_POLICY'], time.process_time() - t)\n"
)


def _probe(**env: str) -> tuple[str, float]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], float(out[1])


def test_cli_defaults_to_passive_waits_and_the_runtime_obeys():
    policy, idle_cpu = _probe()
    assert policy == "PASSIVE"
    # Sleeping threads burn no CPU while the main thread sleeps; spinning ones would burn up to 1 s.
    assert idle_cpu < 0.05


def test_the_users_own_wait_policy_wins():
    policy, idle_cpu = _probe(OMP_WAIT_POLICY="ACTIVE")
    assert policy == "ACTIVE"
    assert idle_cpu > 0.15  # the spinning is real, so the PASSIVE test above can fail
