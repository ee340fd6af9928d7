"""One rank process as its launcher sees it: the process, its two pipes, its log, how it ended."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from nbshard.files import open_private
from nbshard.process.forking import ForkedProcess
from nbshard.process.lines import LineSplitter
from nbshard.stacks import THREAD_NAME_HEADER

_THREAD_NAME = THREAD_NAME_HEADER.encode()

__all__ = ["CallLog", "Rank"]


class Rank:
    """One rank process, its pipes and its log."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes] | ForkedProcess, log_path: Path) -> None:
        self.rank = rank
        self.popen = popen
        self.log = open_private(log_path, "ab", buffering=0)  # noqa: SIM115 - closed in close(); unbuffered: a full disk shows at once
        if popen.stdout is None or popen.stderr is None:
            raise ValueError(f"rank {rank} was started without its stdout and stderr piped to the launcher")
        self.pipes = (popen.stdout, popen.stderr)
        self.splitters = {pipe.fileno(): LineSplitter(name) for pipe, name in zip(self.pipes, ("out", "err"))}
        self.open_fds = set(self.splitters)
        self.returncode: int | None = None
        self.ended_at = 0.0
        self.ok = False
        self.stopped = False
        self.stacks_asked = False
        self.stacks = ""
        self.stacks_from = 0  # where the newest dump starts in its stacks file (0: the whole file)
        self.debug: socket.socket | None = None  # the launcher's end of its debug socket
        self.pidfd: int | None = None

    @property
    def running(self) -> bool:
        return self.returncode is None

    def catches(self, signum: int) -> bool:
        """Whether the rank handles ``signum`` yet: its kernel-side mask of caught signals.
        A rank still starting Python has the default action, which for SIGUSR1 kills."""
        try:
            with open(f"/proc/{self.popen.pid}/status") as status:
                caught = next(line for line in status if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            return False
        return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)

    def ask_stacks(self, path: Path) -> bool:
        """SIGUSR1: the rank appends every thread's stack to ``path`` (its faulthandler), where
        ``read_stacks`` finds it. False when it cannot answer (ended, or still starting)."""
        if not self.running or not self.catches(signal.SIGUSR1):
            return False
        with contextlib.suppress(OSError):
            self.stacks_from = path.stat().st_size
        self.signal(signal.SIGUSR1)
        return True

    def read_stacks(self, path: Path) -> str:
        """The file's header (which thread is the main one), the names of the threads the rank
        waits for at its exit, and the newest dump; "" when the rank wrote none since it was asked."""
        with contextlib.suppress(OSError):
            data = path.read_bytes()
            header, _, rest = data.partition(b"\n")
            dump = data[self.stacks_from:] if self.stacks_from else rest
            if dump.strip():
                earlier = data[len(header) + 1:self.stacks_from] if self.stacks_from else b""
                names = b"".join(line + b"\n" for line in earlier.splitlines() if line.startswith(_THREAD_NAME))
                return (header + b"\n" + names + dump).decode(errors="replace")
        return ""

    def signal(self, signum: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()
        if self.debug is not None:
            self.debug.close()
        self.close_pidfd()
        self.log.close()

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class CallLog:
    """A rank's log for one call, made when the rank first writes in it: a call that prints
    nothing costs no file (``handle.logs(rank)`` reads a missing log as empty)."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self._file: Any = None

    def write(self, data: bytes) -> int:
        if self._file is None:
            self._file = open_private(self.name, "ab", buffering=0)  # unbuffered: a full disk shows at once
        return self._file.write(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
