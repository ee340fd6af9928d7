"""A launcher forked ahead of the next job: the warm process keeps one waiting.

Forking the warm process (hundreds of MiB with torch and lightning imported) and
making the child fresh cost milliseconds on every launch's path. A spare is forked
while the warm process is idle, does the part of becoming fresh that needs no job
(``prepare_fresh``: a session of its own, nothing inherited open, default signals,
its own seeds, import caches to be listed anew), then waits on a socket pair. The
job comes as the request the warm process checked (run directory, environment,
cwd) with the launcher's three descriptors; the spare finishes becoming fresh and
runs the launcher, as a launcher forked at the request would. It imports nothing
while it waits, so its caches see the disk as of the job's arrival.

A waiting spare ends when the warm process closes its end of the socket pair, or dies
(only the warm process holds that end: every other child closes what it inherited);
once it has a job, it runs on as any launcher does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any

from nbshard.process.forking import fork_child
from nbshard.process.fresh import finish_fresh, install_stdio, prepare_fresh

__all__ = ["Spare", "fork_spare"]

SPARE_END_FD = 4  # the spare's end of its socket pair, beside the kernel's pidfd at 3
MAX_JOB_BYTES = 1 << 20
TAKEN = b"taken"  # the spare's answer once it holds the job
TAKE_WAIT = 2.0  # seconds a spare may take to answer (one just forked is still preparing)


class Spare:
    """The warm process's handle on its waiting spare."""

    def __init__(self, pid: int, connection: socket.socket) -> None:
        self.pid = pid
        self.connection = connection
        self.pidfd = os.pidfd_open(pid)

    def hand_over(self, job: dict[str, Any], fds: Sequence[int]) -> bool:
        """Give the spare its job; False (the spare ended) if it did not take it within
        ``TAKE_WAIT`` (killed or stopped while it waited), and then the caller forks a launcher."""
        try:
            socket.send_fds(self.connection, [json.dumps(job).encode()], list(fds))
            self.connection.settimeout(TAKE_WAIT)
            if self.connection.recv(len(TAKEN)) == TAKEN:
                return True
        except OSError:  # gone (EPIPE), or silent past the wait
            pass
        finally:
            self.connection.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # one stopped may not take it later
        return False

    def discard(self) -> None:
        """End a spare that will get no job, and reap it."""
        self.connection.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.reap()

    def reap(self) -> None:
        """Wait for the (ended) spare, and close its pidfd."""
        os.close(self.pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def fork_spare(module: str, keep: dict[int, int], run: Callable[[str], int]) -> Spare:
    """Fork a spare that becomes ``python -m module RUN_DIR`` with the job it is handed and
    then runs ``run(RUN_DIR)``. ``keep``: fds it keeps open (target -> source)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def wait_for_job() -> int:
        ours.close()
        prepare_fresh({**keep, SPARE_END_FD: theirs.detach()})
        connection = socket.socket(fileno=SPARE_END_FD)
        data, fds, _, _ = socket.recv_fds(connection, MAX_JOB_BYTES, 3)
        if not data:  # the warm process closed its end, or died: no job will come
            return 0
        connection.send(TAKEN)
        connection.close()
        job = json.loads(data)
        install_stdio(fds)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        finish_fresh(module=module, run_dir=job["run_dir"], env=job["env"], cwd=job["cwd"])
        return run(job["run_dir"])

    try:
        pid = fork_child(wait_for_job, new_session=True)
    finally:
        theirs.close()
    return Spare(pid, ours)
