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
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, **kwargs)
    return backend


def device() -> Any:
    """This rank's ``torch.device``: its GPU (by ``LOCAL_RANK``) when there are GPUs, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
