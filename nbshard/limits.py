"""What this machine lets one launcher start: its open files and its user's processes.

A launcher holds a few pipes per rank. Past its open-files limit (``ulimit -n``, often 1024)
ZeroMQ aborts the launcher mid-start (``Too many open files (src/epoll.cpp)``) with hundreds
of ranks already forked; past the process limits, forks fail. The launcher raises its own soft
limit as far as the hard one allows (``raise_open_files``), and the kernel refuses, before
anything starts, a job that no raise could hold (``check_can_start``).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

__all__ = ["check_can_start", "launcher_open_files", "raise_open_files"]

FILES_PER_RANK = 6  # a job's launcher holds 5 per rank (pipes, the rank's pidfd), a session's fewer
FILES_BASE = 64  # the launcher's own: its sockets, ZeroMQ's, logs


def launcher_open_files(nproc: int) -> int:
    """Open files a launcher of ``nproc`` ranks may need at most."""
    return FILES_BASE + FILES_PER_RANK * nproc


def _finite(limit: int) -> int | None:
    return None if limit == resource.RLIM_INFINITY else limit


def check_can_start(nproc: int, processes: int) -> None:
    """ValueError where this machine could not run ``processes`` ranks (launchers of ``nproc`` each)
    at all, saying which limit and what to do."""
    hard_files = _finite(resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    if hard_files is not None and launcher_open_files(nproc) > hard_files:
        raise ValueError(
            f"nproc={nproc} is more ranks than one launcher can hold here: it needs about {launcher_open_files(nproc)} "
            f"open files, and this process may open at most {hard_files} (ulimit -Hn). Use fewer ranks per node "
            "(more nodes through a backend), or raise the hard limit (limits.conf, or the container's nofile)."
        )
    # Linux does not hold root to RLIMIT_NPROC.
    user_processes = None if os.getuid() == 0 else _finite(resource.getrlimit(resource.RLIMIT_NPROC)[0])
    try:
        pid_max: int | None = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = None
    for limit, what in ((user_processes, "this user may run (ulimit -u)"), (pid_max, "Linux can number (kernel.pid_max)")):
        if limit is not None and processes > limit:
            raise ValueError(
                f"{processes} ranks are more processes than {what}: {limit}. Use fewer ranks on this machine, "
                "or spread them over machines with a backend (backend='ray' or 'slurm')."
            )


def raise_open_files(nproc: int) -> None:
    """Let this launcher open what ``nproc`` ranks need: its soft limit up to its hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = launcher_open_files(nproc)
    if _finite(soft) is not None and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if _finite(hard) is None else min(needed, hard), hard))
