"""A launcher forked by the warm process, seen from the kernel: the verbs of ``LauncherProcess``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess

from nbshard.backends.channel import Channel
from nbshard.procfs import stat_fields

__all__ = ["WarmLauncher", "process_state"]


class WarmLauncher:
    """A launcher forked by the warm process, with the verbs of ``LauncherProcess``.

    Its stdin is a socket whose other end only the kernel holds (``Channel``: commands,
    a session's replies and, at its end, the kernel's death); its exit code comes from the
    warm process.
    """

    note: str | None = None

    def __init__(self, pid: int, connection: socket.socket, channel: Channel) -> None:
        self.pid = pid
        self._connection = connection
        self.channel = channel
        self._returncode: int | None = None

    def poll(self) -> int | None:
        if self._returncode is None:
            self._read_exit(0)
        return self._returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._returncode is None:
            self._read_exit(timeout)
        if self._returncode is None:
            raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout or 0)
        return self._returncode

    def _read_exit(self, timeout: float | None) -> None:
        self._connection.settimeout(timeout)
        try:
            data = self._connection.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            data = b""
        if data:
            self._returncode = int(json.loads(data)["exit"])
        elif not _alive(self.pid):  # the warm process went away first: the exit code is lost
            self._returncode = -signal.SIGKILL

    def request(self, command: bytes) -> None:
        self.channel.request(command)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """The run is over: SIGKILL whatever its ranks left in the process group, drop the channels."""
        self.kill()
        self.channel.close()
        self._connection.close()


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, D, T, Z, ...), None when it is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) not in (None, "Z")  # a zombie waiting for the warm process counts as gone
