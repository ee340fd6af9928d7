"""Small helpers for code that runs inside the ranks. They import torch when called, never before."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["device", "init_process_group"]


def init_process_group(backend: str | None = None, **kwargs: Any) -> str:
    """``torch.distributed.init_process_group`` with nccl on GPUs and gloo otherwise.

    On GPUs it first selects this rank's device (``LOCAL_RANK``). Calling it
    when the group exists already does nothing. Returns the backend name.
    """
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        torch.cuda.set_device(_local_gpu(torch))
    if not dist.is_initialized():
        dist.init_process_group(backend, **kwargs)
    return backend


def device() -> Any:
    """This rank's ``torch.device``: its GPU (by ``LOCAL_RANK``) when there are GPUs, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", _local_gpu(torch))
    return torch.device("cpu")


def _local_gpu(torch: Any) -> int:
    """This rank's GPU index (``LOCAL_RANK``), or a clear error where the node has too few GPUs."""
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local < count:
        return local
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "?")
    raise RuntimeError(
        f"local rank {local} has no GPU of its own: this node runs {ranks} ranks but shows {count} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}), and NCCL needs one GPU per rank. "
        f"Run with nproc={count} or fewer, or, to try more ranks than GPUs, use "
        "nbshard.init_process_group('gloo') and keep the tensors on the CPU."
    )
