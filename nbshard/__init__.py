"""nbshard: run FSDP and DDP training from a Jupyter notebook in fresh torchrun-style processes.

``import nbshard`` imports no torch: the kernel never needs a GPU.
"""

from __future__ import annotations

import sys

from nbshard.kernel.client import (
    JobHandle, Settings, TooManyRanks, cancel_all, jobs, restart_warm, run, settings, submit, warm_status,
)
from nbshard.rank.dist import device, init_process_group
from nbshard.errors import (
    JobCancelled, JobError, JobFailed, JobInterrupted, JobTimedOut, RankFailure, SessionLost,
    script_excepthook,
)
from nbshard.kernel.gpus import KernelHoldsCUDA, check_kernel, hide_gpus_from_kernel
from nbshard.kernel.payload import LargeJob
from nbshard.kernel.remote import RemoteError
from nbshard.job import Job
from nbshard.rank.monitor import log_metrics
from nbshard.kernel.persistent import Session, SessionBusy, session, sessions

__all__ = [
    "Job",
    "JobCancelled",
    "JobError",
    "JobFailed",
    "JobHandle",
    "JobInterrupted",
    "JobTimedOut",
    "KernelHoldsCUDA",
    "LargeJob",
    "RankFailure",
    "RemoteError",
    "Session",
    "SessionBusy",
    "SessionLost",
    "Settings",
    "TooManyRanks",
    "cancel_all",
    "check_kernel",
    "device",
    "hide_gpus_from_kernel",
    "init_process_group",
    "jobs",
    "log_metrics",
    "restart_warm",
    "run",
    "session",
    "sessions",
    "settings",
    "submit",
    "warm_status",
]

__version__ = "0.1.0"

if sys.excepthook is sys.__excepthook__:  # a plain script: its tracebacks skip nbshard's waiting frames
    sys.excepthook = script_excepthook(sys.excepthook)


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext nbshard``: register the ``%%shard_train`` cell magic."""
    from nbshard.kernel.magic import load_ipython_extension as register

    register(ipython)
