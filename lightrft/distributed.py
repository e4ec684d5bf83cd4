"""Process-group set-up shared by the recipes: one process, torchrun on CPU (gloo) or GPU (nccl);
the one barrier, the main-rank test, scalar all-reduces, and leaving the group."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# The bound on one collective's wait that init_distributed gave the default group (None: torch's
# default, 30 min on gloo, 10 min on nccl); build_mesh gives the HSDP sub-groups the same.
_collective_timeout: timedelta | None = None


def collective_timeout() -> timedelta | None:
    """The ``collective_timeout_s`` the process group was made with (None: torch's default)."""
    return _collective_timeout


def init_distributed(device: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the default process group when launched by torchrun; otherwise stay single.

    ``device``: "cpu", "cuda" or None (CUDA when available). Backend: gloo on CPU; on CUDA, nccl
    for CUDA tensors and gloo for CPU ones (the rollout's row counts and metadata, step metrics),
    which NCCL alone refuses.
    ``timeout_s``: how long one collective waits for its peers before it raises (a peer that
    died or hangs then ends this rank with an error instead of a wait forever); None keeps
    torch's default (30 min on gloo, 10 min on nccl).
    """
    global _collective_timeout
    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device=cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()  # a torchrun worker: do not outlive the launcher
    if want.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        _collective_timeout = timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo",
            device_id=dev if dev.type == "cuda" else None,
            timeout=_collective_timeout,
        )
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev)
    return DistInfo(0, 1, 0, dev)


_PR_SET_PDEATHSIG = 1


def exit_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (the torchrun launcher)
    dies, so a ``kill -9`` of the launcher leaves no workers training on (and colliding with a
    relaunch). SIGKILL, because a rank blocked in a collective whose peer is gone would never
    act on a gentler signal; the last complete checkpoint is intact either way. Linux only
    (``prctl(PR_SET_PDEATHSIG)``); returns whether it is armed."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl: the kernel would not tell us
        os.kill(os.getpid(), sig)
    return True


def is_main() -> bool:
    """Whether this process is rank 0 (or runs alone)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every rank (a no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(value: float | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Sum a scalar over ranks (identity in a single process); returns a tensor."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device or "cpu").clone()
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def all_reduce_max(value: float | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The largest value of a scalar over ranks (identity in a single process); a tensor."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device or "cpu").clone()
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def even_micro_batches(micro: list, device: torch.device | None = None) -> tuple[list, int]:
    """``micro`` (this rank's micro-batches of one step) extended to the largest count over ranks
    with copies of its last one, and the number of real ones. Every rank then runs as many
    forward/backward passes, so FSDP's collectives pair up; the caller gives the copies no
    weight (a loss times zero, or no loss tokens)."""
    count = int(all_reduce_max(len(micro), device).item())
    return micro + [micro[-1]] * (count - len(micro)), len(micro)


def comm_device(t: torch.Tensor) -> torch.device:
    """Where a DTensor's collectives run: its local shard's device, or its mesh's device for a
    shard that FSDP2 offloads to CPU memory under a GPU mesh (NCCL gathers no CPU tensors)."""
    local = t.to_local().device
    kind = t.device_mesh.device_type
    if local.type == kind:
        return local
    return torch.device(kind, torch.get_device_module(kind).current_device())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``DTensor.full_tensor()`` (a collective) on :func:`comm_device`: the whole tensor there,
    also for an offloaded shard in CPU memory."""
    from torch.distributed.tensor import DTensor

    local = t.to_local().to(comm_device(t))  # the shard itself where it is already there
    moved = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return moved.full_tensor()


def destroy(clean: bool = True) -> None:
    """Leave the process group. After a clean run (``clean``) the ranks first meet at a barrier:
    a rank that tears its gloo connections down while a peer is still finishing its last
    collectives aborts that peer ("terminate called without an active exception", seen in about
    one 2-rank run in ten). After an error there is no barrier: a peer may be stuck or gone."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def all_gather_objects(obj):
    """Every rank's picklable ``obj`` in rank order; ``[obj]`` in one process. Pickled whole
    through the default group (gloo for CPU objects under ``cpu:gloo,cuda:nccl``): a rollout
    batch of CPU tensors is fine; keep device tensors and model states out of it."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Every rank filled its own rows of ``t`` (zeros elsewhere): the whole tensor on every
    rank, in place (identity in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
