"""On GPUs with NCCL: the same jobs, and results that come back on the CPU.

Marked ``gpu``: skipped with a reason on a machine without one.
"""

from __future__ import annotations

import pytest

import nbshard
import programs
import sharded_models
from conftest import gpu_count
from test_fsdp import assert_same_state, reference

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


def imports_torch_without_cuda():
    import time

    import torch

    time.sleep(1.0)  # several samples happen meanwhile
    return torch.cuda.is_initialized()


def test_the_sampler_never_initializes_cuda_in_a_rank():
    handle = nbshard.submit(imports_torch_without_cuda, nproc=1, sample_interval=0.1)
    assert handle.result(timeout=120) is False
    assert len(handle.memory()) >= 5 and all(r["gpu"] is None for r in handle.memory())


def holds_device_memory():
    import time

    import torch

    import nbshard

    block = torch.ones(64, 1024, 1024, device=nbshard.device())  # 256 MiB
    time.sleep(1.0)
    return block.numel() * 4


def test_a_rank_using_cuda_reports_device_memory():
    handle = nbshard.submit(holds_device_memory, nproc=1, sample_interval=0.1)
    size = handle.result(timeout=120)
    peaks = handle.peak_memory()[0]
    assert peaks["gpu_peak_allocated"] >= size
    assert max(r["gpu_allocated"] or 0 for r in handle.memory()) >= size


def test_fsdp_helper_from_scratch_on_gpus_matches_one_process():
    nproc = min(gpu_count(), 2)
    result = nbshard.run(sharded_models.from_scratch, 0, nproc=nproc)
    assert_same_state(result["state"], reference(0).state_dict())
    assert result["tied"]


def cuda_processes() -> set[int] | None:
    """PIDs holding a CUDA context, from NVML (nvidia-smi); None where it cannot tell."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
    return {int(line) for line in out.stdout.split() if line.strip().isdigit()} if out.returncode == 0 else None


def warm_nccl_rank(hold_for):
    import time

    import torch

    backend = nbshard.init_process_group()
    tensor = torch.ones(2, device=nbshard.device())
    torch.distributed.all_reduce(tensor)
    time.sleep(hold_for)  # CUDA stays held while the test reads NVML's process list
    return {"backend": backend, "sum": tensor.sum().item(), "bad fork": torch.cuda._is_in_bad_fork(), "pid": __import__("os").getpid()}


def test_forked_ranks_initialize_cuda_and_nccl_themselves_and_the_warm_process_holds_no_context(monkeypatch):
    import time

    from test_warm import warm_ready

    monkeypatch.setattr(nbshard.settings, "warm", True)
    monkeypatch.setattr(nbshard.settings, "preload", ["torch"])
    warm_pid = warm_ready()["pid"]
    nproc = min(gpu_count(), 2)
    handle = nbshard.submit(warm_nccl_rank, 8.0, nproc=nproc, return_all=True)
    assert handle.warm, handle.launch_note
    time.sleep(5.0)
    holders = cuda_processes()
    results = handle.result(timeout=120)
    for result in results:
        assert result == {"backend": "nccl", "sum": 2.0 * nproc, "bad fork": False, "pid": result["pid"]}
    if holders is not None:  # NVML sees the ranks' contexts, never the warm process's
        assert {r["pid"] for r in results} <= holders and warm_pid not in holders, (holders, warm_pid)
    assert nbshard.warm_status()["state"] == "ready"


def test_a_preload_that_initializes_cuda_turns_warm_start_off(tmp_path, monkeypatch):
    import os

    from test_warm import warm_settled

    (tmp_path / "initializes_cuda.py").write_text("import torch\ntorch.cuda.init()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(nbshard.settings, "warm", True)
    monkeypatch.setattr(nbshard.settings, "preload", ["torch", "initializes_cuda"])
    nbshard.restart_warm()
    status = warm_settled()
    assert status["state"] == "failed" and "CUDA" in status["reason"], status
    handle = nbshard.submit(cuda_result, nproc=1)
    assert handle.result(timeout=120)["backend"] == "nccl" and not handle.warm


def test_a_session_keeps_cuda_memory_between_calls_counts_nccl_collectives_and_close_frees_it():
    import session_jobs
    from conftest import wait_until_gone

    nproc = min(gpu_count(), 2)
    session = nbshard.session("gpu", nproc=nproc)
    try:
        first = session.run(session_jobs.hold_cuda_tensor, return_all=True)
        assert all(r["backend"] == "nccl" and r["allocated"] >= 4 << 20 for r in first), first
        assert len({r["collectives"] for r in first}) == 1 and first[0]["collectives"] is not None, first
        assert session.run(session_jobs.cuda_tensor_sum) == float(nproc * nproc)  # the same tensor, reduced again
        assert all(view.device == "GPU" and view.current for view in session._telemetry.views())  # what it holds shows
    finally:
        session.close()
    assert not wait_until_gone(session.run_dir, within=5.0)


def test_more_ranks_than_gpus_is_a_clear_error_in_the_rank():
    nproc = gpu_count() + 1
    with pytest.raises(nbshard.JobFailed) as failure:
        nbshard.run(cuda_result, nproc=nproc)
    text = f"{failure.value}\n{failure.value.__cause__}"
    assert f"local rank {gpu_count()} has no GPU of its own" in text and f"nproc={gpu_count()} or fewer" in text, text
