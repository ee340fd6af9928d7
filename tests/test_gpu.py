"""On GPUs with NCCL: the same jobs, and results that come back on the CPU.

Marked ``gpu``: skipped with a reason on a machine without one.
"""

from __future__ import annotations

import pytest

import nbshard
import programs
from conftest import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def cuda_result():
    import torch

    import nbshard

    backend = nbshard.init_process_group()
    device = nbshard.device()
    tensor = torch.ones(4, device=device) * (torch.distributed.get_rank() + 1)
    torch.distributed.all_reduce(tensor)
    return {"backend": backend, "device": str(device), "tensor": tensor, "param": torch.nn.Parameter(tensor.clone())}


def test_nccl_job_returns_cuda_tensors_on_the_cpu():
    nproc = min(gpu_count(), 2)
    results = nbshard.run(cuda_result, nproc=nproc, return_all=True)
    total = sum(range(1, nproc + 1))
    for rank, result in enumerate(results):
        assert result["backend"] == "nccl" and result["device"] == f"cuda:{rank}"
        assert result["tensor"].device.type == "cpu" and result["tensor"].tolist() == [float(total)] * 4
        assert result["param"].device.type == "cpu" and isinstance(result["param"], type(result["param"]))


def test_fsdp2_step_on_gpus():
    result = nbshard.run(programs.fsdp2_step, nproc=min(gpu_count(), 2))
    assert result["full_weight"].device.type == "cpu"
    assert result["losses"][-1] < result["losses"][0]
