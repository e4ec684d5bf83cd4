"""`lightrft run --nproc_per_node N` on CPU forks its workers from the launcher, which imported the
recipe for its config check (lightrft._worker): they start with torch imported, with torchrun's
thread count, each on its own cores, join one process group, exit cleanly, and a failing rank
fails the launch instead of hanging it. The user's own start flags win."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork start: Linux only")

RECIPE = """# lightrft run --nproc_per_node 2 recipe.py --config cfg.yaml
import sys

PRELOADED = "torch" in sys.modules  # a fork of the launcher has imported torch already

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightrft import config  # noqa: E402

CONFIG_SCHEMA = None


@config.parse
def recipe_main(cfg):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    line = {"rank": rank, "world": dist.get_world_size(), "sum": total.item()}
    line.update(preloaded=PRELOADED, threads=torch.get_num_threads())
    line.update(cores=sorted(os.sched_getaffinity(0)))
    (Path(cfg.out) / f"rank{rank}.json").write_text(json.dumps(line))
    dist.destroy_process_group()
    print(f"rank {rank} done")
    return 3 if rank == cfg.fail_rank else 0


if __name__ == "__main__":
    sys.exit(recipe_main())
"""


def _launch(
    tmp_path: Path, *flags: str, fail_rank: int = -1
) -> tuple[subprocess.CompletedProcess, list]:
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"device: cpu\nout: {tmp_path}\nfail_rank: {fail_rank}\n")
    cmd = [sys.executable, "-m", "lightrft", "run", "--nproc_per_node", "2", *flags]
    cmd += [str(recipe), "--config", str(cfg)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun's default: 1
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    return proc, ranks


def test_cpu_workers_are_forks_that_start_imported_and_exit_cleanly(tmp_path):
    proc, ranks = _launch(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(r["rank"], r["world"], r["sum"]) for r in ranks] == [(0, 2, 1.0), (1, 2, 1.0)]
    assert all(r["preloaded"] for r in ranks)  # no worker imported torch again
    # torchrun's OMP_NUM_THREADS=1 holds in a fork too (its OpenMP was set up in the launcher).
    assert [r["threads"] for r in ranks] == [1, 1]
    if len(os.sched_getaffinity(0)) >= 2:  # each on its own share of the cores
        assert ranks[0]["cores"] and ranks[1]["cores"]
        assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"])
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout  # unbuffered, kept


def test_a_failing_fork_fails_the_launch(tmp_path):
    proc, ranks = _launch(tmp_path, fail_rank=1)
    assert proc.returncode != 0
    assert len(ranks) == 2
    assert "exitcode  : 3" in proc.stderr  # torchrun names the rank's own status


def test_the_users_start_method_wins(tmp_path):
    proc, ranks = _launch(tmp_path, "--start-method", "spawn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["sum"] for r in ranks] == [1.0, 1.0]
    assert not any(r["preloaded"] for r in ranks)  # fresh interpreters: torch imported anew


def test_validate_takes_the_world_size_run_would_launch_with(capsys):
    """Issue 42 item 7: the documented asynchronous command validates at 2 processes and is
    refused, naming the fix, at 1."""
    from lightrft.cli import main

    over = ["rollout.asynchronous=true", "algorithm.old_logprobs=engine"]
    assert main(["validate", "tiny/add_grpo", *over]) == 2
    assert "--nproc_per_node 2" in capsys.readouterr().err
    assert main(["validate", "--nproc_per_node", "2", "tiny/add_grpo", *over]) == 0
    assert "on 2 processes" in capsys.readouterr().out
    world = os.environ.get("WORLD_SIZE")
    assert main(["validate", "--nproc-per-node", "1", "--nnodes", "2", "tiny/add_grpo", *over]) == 0
    assert os.environ.get("WORLD_SIZE") == world  # restored
