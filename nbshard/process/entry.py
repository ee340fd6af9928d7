"""Every launcher's entry: ``main(run_dir)`` runs a job's launcher or a session's, writes the
outcome and says the last words. ``python -m nbshard.launcher`` and the warm process call it."""

from __future__ import annotations

import os
from pathlib import Path

from nbshard.contracts import LaunchSpec
from nbshard.files import write_atomic
from nbshard.run_dir import RunDir
from nbshard.limits import raise_open_files
from nbshard.process.launcher import JobLauncher
from nbshard.process.reaper import adopt_orphans
from nbshard.process.session_launcher import SessionLauncher

__all__ = ["main"]

END_SEND_WAIT = 1.0  # how long the final messages may wait for room in the queue when nobody reads them
FINAL_FLUSH = 10.0  # how long they may wait, and be flushed, while the kernel lives (a slow one, after a flood)


def main(run_dir: str, *, kernel_pidfd: int | None = None, fork_ranks: bool = False) -> int:
    """Supervise the run in ``run_dir`` to its end; returns the exit code."""
    paths = RunDir(Path(run_dir))
    adopt_orphans()
    write_atomic(paths.path / "launcher.pid", str(os.getpid()).encode())
    spec = LaunchSpec.read(paths.launch)
    raise_open_files(spec.nproc_per_node)  # before the ranks' pipes: past the limit, ZeroMQ aborts the launcher
    launcher = (SessionLauncher if spec.session else JobLauncher)(paths, spec, kernel_pidfd=kernel_pidfd, fork_ranks=fork_ranks)
    group = launcher.group
    try:
        outcome = launcher.run()
        try:
            outcome.write(paths.outcome)
        except OSError as error:  # the kernel learns why from the last message instead
            outcome.storage_error = outcome.storage_error or f"{error.strerror} while writing {paths.outcome}"
        # The last words may wait for a slow kernel while it lives, never long: the files hold the truth.
        wait = FINAL_FLUSH if group.kernel_alive() else END_SEND_WAIT
        for rank in list(group.stream.dropped):
            group.stream.send_dropped_notice(rank, wait=wait)
        # One node of many: the kernel's side of the nodes says when the whole run ended.
        kind = "end" if spec.nnodes == 1 else "node_end"
        group.stream.send({"kind": kind, "status": outcome.status, "storage_error": outcome.storage_error}, wait=wait)
    finally:
        group.close(FINAL_FLUSH)
    return 0
