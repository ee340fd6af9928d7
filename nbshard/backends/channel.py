"""The kernel's end of a launcher's stdin: one end of a Unix socket pair, not a pipe.

The kernel writes its command lines on it (``job.CANCEL``, a session's ``run ...``), and its
end closing, however the kernel dies, tells the launcher to stop every rank, as a pipe's
would. A socket also carries words back: a session's launcher that was sent ``replies``
answers each call's end on it (one JSON line), a hop shorter than the wire, whose ZeroMQ
threads add about 70 us to a call that takes a millisecond (``benchmarks/session_cells.py``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import Any

__all__ = ["Channel", "REPLY_WAIT"]

REPLY_WAIT = 2.0  # seconds a reply waits at most for the wire's messages sent before it (lost only with their sender)


class Channel:
    """Made before the launcher starts: ``launcher_end`` is passed to it (as its stdin), then
    closed here with ``launcher_started``."""

    def __init__(self) -> None:
        self.socket, self.launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buffer = b""
        self._pending: list[tuple[dict[str, Any], float]] = []  # replies waiting for the wire's earlier messages
        self.open = True  # until the launcher's end closed (its exit)

    def launcher_started(self) -> None:
        self.launcher_end.close()

    def request(self, command: bytes) -> None:
        with contextlib.suppress(OSError):
            self.socket.sendall(command)

    def end_input(self) -> None:
        """The launcher reads end-of-file, as at the kernel's death; replies can still arrive."""
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.socket.close()
        self.open = False

    def fileno(self) -> int | None:
        """What to wait on for replies; None once the launcher's end closed."""
        return self.socket.fileno() if self.open else None

    def replies(self, seen: Any) -> list[dict[str, Any]]:
        """The launcher's replies that are due, in order: read what arrived, and hand out each
        one once the wire's messages its launcher sent before it arrived (``seen(sender)``: the
        last count the wire has from that sender), so a call's last lines come before its end."""
        if self.open:
            try:
                while data := self.socket.recv(1 << 16, socket.MSG_DONTWAIT):
                    self._buffer += data
                else:
                    self.open = False  # the launcher exited; what it wrote was read
            except BlockingIOError:
                pass
            except OSError:
                self.open = False
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if isinstance(message, dict):
                        self._pending.append((message, time.monotonic() + REPLY_WAIT))
        due = []
        while self._pending:
            message, deadline = self._pending[0]
            if seen(message.get("from")) < message.get("after", 0) and time.monotonic() < deadline:
                break
            self._pending.pop(0)
            due.append({k: v for k, v in message.items() if k not in ("from", "after")})
        return due

    def waiting(self) -> bool:
        """Whether a reply waits for the wire (the caller looks again soon)."""
        return bool(self._pending)
