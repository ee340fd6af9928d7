"""The kernel and the GPUs: count them without a CUDA context, check the kernel holds none,
and, on request, hide them from the kernel process itself (never from the ranks)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

__all__ = ["KernelHoldsCUDA", "check_kernel", "hide_gpus_from_kernel", "ranks_environment", "visible_gpu_count"]

_UNSET = object()
_hidden_value: object = _UNSET  # the kernel's CUDA_VISIBLE_DEVICES before hide_gpus_from_kernel()


class KernelHoldsCUDA(UserWarning):
    """The kernel process has a CUDA context of its own."""


def visible_gpu_count(env: Mapping[str, str]) -> int:
    """GPUs a process with ``env`` would see, counted without creating a CUDA context.

    The driver lists one directory per GPU in /proc/driver/nvidia/gpus (where that is not
    mounted, as in some VMs and containers, one /dev/nvidiaN node per GPU);
    ``CUDA_VISIBLE_DEVICES`` narrows that down as CUDA would.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        return len(entries) if entries and entries[0] != "-1" else 0
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return sum(1 for _ in gpus.iterdir())
    return sum(1 for node in Path("/dev").glob("nvidia*") if node.name[len("nvidia"):].isdigit())


def ranks_environment(kernel_env: Mapping[str, str]) -> dict[str, str]:
    """The kernel's environment as ranks should inherit it: GPUs the kernel hid from itself come back."""
    env = dict(kernel_env)
    if _hidden_value is not _UNSET:
        if _hidden_value is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(_hidden_value)
    return env


def check_kernel() -> str | None:
    """Why the kernel holds a CUDA context, and what to do; None when it holds none.

    It asks only what is already known: torch's ``cuda.is_initialized()`` when
    the kernel imported torch. It never creates a context itself.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return (
        "This kernel holds a CUDA context of its own: a cell used torch.cuda (a tensor .cuda(), "
        "torch.cuda.* calls). nbshard still launches, since its ranks are fresh processes, but that "
        "context keeps some hundreds of MB on the GPU for as long as the kernel lives. To free it, "
        "restart the kernel and keep GPU work inside jobs; for a hard guarantee call "
        "nbshard.hide_gpus_from_kernel() first thing after the restart."
    )


def warn_if_kernel_holds_cuda() -> None:
    message = check_kernel()
    if message is not None:
        warnings.warn(message, KernelHoldsCUDA, stacklevel=3)


def hide_gpus_from_kernel() -> None:
    """Make every GPU invisible to this kernel process; the ranks still get theirs.

    Sets the kernel's own ``CUDA_VISIBLE_DEVICES`` to empty, the one change
    nbshard ever makes to the kernel's environment, and only when asked.
    Ranks keep what the kernel had before (or what a job's ``gpus=`` says).
    Call it before anything in the kernel uses CUDA.
    """
    global _hidden_value
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(
            "too late to hide the GPUs: this kernel has already initialized CUDA. Restart the "
            "kernel and call nbshard.hide_gpus_from_kernel() before any cell uses the GPU."
        )
    if _hidden_value is _UNSET:
        _hidden_value = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
