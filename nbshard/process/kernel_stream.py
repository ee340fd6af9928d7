"""What a launcher sends the kernel: the ranks' lines, coalesced, and its events, never blocking.

``KernelStream`` owns the launcher's signed ZeroMQ socket (opened when first used: ZeroMQ's
threads must not exist when the launcher forks ranks) and counts, per rank, the lines it
queued for the kernel and the lines the kernel was too slow to take, so the kernel can tell
what never arrived and say where the whole log is. A session's launcher also answers each
call's end on the kernel's own channel (``reply``), after the lines before it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbshard.wire import Sender

__all__ = ["COALESCE", "COALESCE_BYTES", "REPLY_MAX", "KernelStream"]

# How long a rank's finished lines may wait to travel with the next ones, and how many bytes of
# them at most (the kernel may hold a thousand messages queued): a flood goes as a message a
# millisecond or 16 KiB, not one per pipe read, which the kernel (checking and decoding each
# message) could not keep up with, and lines would be dropped from the live view.
COALESCE = 0.001
COALESCE_BYTES = 1 << 14
REPLY_MAX = 1 << 16  # bytes: a larger end (stacks of a lost session) goes on the wire


def _lines_message(rank: int, now: float, stream: str, texts: list[str], is_open: bool) -> dict[str, Any]:
    """Lines of one stream of a rank, their texts joined into one string (the wire's ``lines``)."""
    return {"kind": "lines", "rank": rank, "time": now, "stream": stream, "open": is_open, "text": "\n".join(texts)}


class KernelStream:
    """``tag`` adds the driver's fields to each message (a session's call); ``log_of(rank)`` is
    where a rank's whole output is kept, named when lines were dropped."""

    def __init__(self, address: str, key_path: Path, tag: Callable[[dict[str, Any]], dict[str, Any]], log_of: Callable[[int], Path]) -> None:
        self.address, self.key_path, self.tag, self.log_of = address, key_path, tag, log_of
        self._sender: Sender | None = None
        self.pending: list[list[Any]] = []  # runs of finished lines not sent yet: [rank, time, stream, texts]
        self.pending_since = 0.0
        self.pending_bytes = 0
        self.dropped: dict[int, int] = {}  # lines not streamed and not yet reported, by rank
        self.dropped_total: dict[int, int] = {}
        self.lines_sent: dict[int, int] = {}  # queued for the kernel, by rank: it can tell what never arrived
        self.back: socket.socket | None = None  # the kernel's own channel, once it asked for replies on it

    @property
    def sender(self) -> Sender:
        if self._sender is None:
            self._sender = Sender(self.address, self.key_path.read_bytes())
        return self._sender

    def close(self, linger: float | None = None) -> None:
        """Flush (for ``linger`` seconds at most) and close the socket, ending ZeroMQ's threads
        (before forking ranks again)."""
        if self._sender is not None:
            self.flush_lines()
            self._sender.close(None if linger is None else int(linger * 1000))
            self._sender = None

    def send(self, message: dict[str, Any], rank: int | None = None, lines: int = 0, wait: float = 0.0) -> None:
        """Send without blocking (or ``wait`` at most), after the lines still waiting (they came
        first); count lines the kernel was too slow to take."""
        if self.pending:
            self.flush_lines()
        self._send(message, rank, lines, wait)

    def _send(self, message: dict[str, Any], rank: int | None = None, lines: int = 0, wait: float = 0.0) -> None:
        if rank is not None:
            self.send_dropped_notice(rank, wait)
        sent = self.sender.send(self.tag(message), wait)
        if rank is None or not lines:
            return
        if sent:
            self.lines_sent[rank] = self.lines_sent.get(rank, 0) + lines
        else:
            self.dropped[rank] = self.dropped.get(rank, 0) + lines
            self.dropped_total[rank] = self.dropped_total.get(rank, 0) + lines

    def send_dropped_notice(self, rank: int, wait: float = 0.0) -> None:
        if self.dropped.get(rank):
            notice = {"kind": "dropped", "rank": rank, "count": self.dropped[rank], "log": str(self.log_of(rank))}
            if self.sender.send(notice, wait):
                self.dropped[rank] = 0

    def send_lines(self, rank: int, lines: list[list[Any]]) -> None:
        """A few ``lines`` (each ``[time, stream, text, is_open]``: open lines, a call's last), now."""
        for time_, stream, text, is_open in lines:
            self.send(_lines_message(rank, time_, stream, [text], is_open), rank, 1)

    def send_texts(self, rank: int, now: float, stream: str, texts: list[str]) -> None:
        """Finished lines of one stream: sent within ``COALESCE`` seconds, with those that follow."""
        if not texts:
            return
        if not self.pending:
            self.pending_since = time.monotonic()
        last = self.pending[-1] if self.pending else None
        if last is not None and last[0] == rank and last[2] == stream:
            last[1] = now
            last[3].extend(texts)
        else:
            self.pending.append([rank, now, stream, texts])
        self.pending_bytes += sum(map(len, texts))
        if self.pending_bytes >= COALESCE_BYTES:
            self.flush_lines()

    def flush_lines(self) -> None:
        """Send the waiting lines, a message per run of one stream: its texts joined into one
        string, not a JSON list per line (whose encoding was most of a flood's cost)."""
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        for rank, now, stream, texts in pending:
            self._send(_lines_message(rank, now, stream, texts, False), rank, len(texts))

    def reply_on(self, fd: int) -> None:
        """Send each call's end on ``fd`` (a session's stdin: the kernel holds its other end, a hop
        shorter than the wire); where ``fd`` is not a socket (a pipe), ends keep to the wire."""
        copy = os.dup(fd)
        try:
            self.back = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)

    def reply(self, message: dict[str, Any]) -> bool:
        """``message`` on the kernel's channel, after the lines still waiting; False where it cannot
        go there at once and whole (the wire carries it): the launcher never waits for the kernel."""
        if self.back is None:
            return False
        self.flush_lines()
        sender = self.sender
        data = json.dumps({**self.tag(message), "from": sender.id, "after": sender.sent}, separators=(",", ":")).encode() + b"\n"
        if len(data) > REPLY_MAX:
            return False
        try:
            sent = self.back.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            sent = 0
        if sent < len(data):  # the kernel is gone, or its end is full: a torn line is never read as a reply
            self.back.close()
            self.back = None
            return False
        return True

    def wait_for_lines(self) -> float:
        """Seconds until the waiting lines are due (0: now; ``inf`` when none wait)."""
        return max(0.0, self.pending_since + COALESCE - time.monotonic()) if self.pending else float("inf")
