"""The default process group on CUDA carries CPU tensors too: the rollout gathers its row
counts and per-sample metadata as CPU tensors and objects, which NCCL alone refuses ("No backend
type associated with device type cpu"). One GPU is enough to see it: a world of one still
dispatches each collective by the tensor's device."""

import pytest
import torch
import torch.distributed as dist
from _dist import free_port


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_cuda_group_takes_cpu_and_cuda_tensors(monkeypatch):
    from lightrft.distributed import init_distributed
    from lightrft.training import reduce_metrics

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    info = init_distributed("cuda")
    try:
        assert info.device.type == "cuda"
        sizes = [torch.zeros(3, dtype=torch.long)]
        dist.all_gather(sizes, torch.tensor([4, 7, 9]))  # CPU: gloo
        assert sizes[0].tolist() == [4, 7, 9]
        total = torch.ones(2, device="cuda")
        dist.all_reduce(total)  # CUDA: nccl
        assert total.tolist() == [1.0, 1.0]
        metas = [None]
        dist.all_gather_object(metas, {"prompt": "2+2"})
        assert metas == [{"prompt": "2+2"}]
        # The backend reads "cpu:gloo,cuda:nccl": the step metrics still reduce on the GPU.
        assert "nccl" in dist.get_backend()
        assert reduce_metrics({"train/loss": 0.5}) == {"train/loss": 0.5}
    finally:
        dist.destroy_process_group()
