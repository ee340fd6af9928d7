"""Messages between the launcher (and ranks) and the kernel.

Every message is a JSON object sent as one frame, its signature (an HMAC-SHA256 of the
payload under a per-run key that lives only in the run directory, 64 hex digits) followed by
the payload. One frame, so that a send queues all of a message or none of it, even when the
stop button's ``KeyboardInterrupt`` lands in the middle of the send (between two frames it
left half a message, which spoiled the next one). A frame with a bad or missing signature is
dropped and counted, never decoded. Nothing is ever unpickled from a socket:
results and errors travel as files.

Each sender (the launcher, each rank's sampler) stamps its messages with its own
random id and a count that only goes up (``from``, ``seq``); the receiver drops
and counts a message whose count is not above the last one seen from that sender,
so a captured frame replayed or reordered is never shown twice. The kernel's
socket refuses frames over ``MAX_FRAME_BYTES`` (ZeroMQ closes such a peer before
holding its frame), and senders drop their own messages over ``MAX_MESSAGE_BYTES``.

Every socket that receives (the kernel's, a node's relay) is an ``ipc://`` path inside a
directory only this user can enter (``bind_private``), never a TCP port: another local user
cannot connect at all, so cannot queue frames in the receiver's memory before their signature
is checked.

Message kinds:

- ``lines``: ``{"rank", "time", "stream", "open", "text"}``: one or more lines of one
  stream (``out``, ``err``), their texts joined by ``\\n`` (a line holds none); ``open`` marks
  a rank's unfinished current line (a ``\\r`` rewrite of a progress bar, or a line still
  waiting for its newline), sent alone.
- ``dropped``: ``{"rank", "count", "log"}``: lines not streamed live because the
  kernel read too slowly; the log file still holds them.
- ``event``: ``{"event", ...}``: lifecycle news from the launcher.
- ``sample``: ``{"rank", "time", "rss", "peak_rss", "gpus": [...]}`` (and ``"pss", "peak_pss"`` from a warm rank): a rank's memory.
- ``metrics``: ``{"rank", "time", "step", "values": {name: number}}``: from ``log_metrics``.
- ``debug``: ``{"rank", "ask", "text", "others"}``: a rank's pdb asks (its output, its prompt
  last; ``others``: the other ranks' stacks when it stopped), or ``{"rank", "resumed": true}``.
- ``end``: the launcher's last message.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import zmq

from nbshard.leftovers import hold_alive

__all__ = [
    "KEY_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "Receiver",
    "Sender",
    "bind_private",
    "decode",
    "encode",
    "new_key",
]

KEY_BYTES = 32
SEND_HWM = 1000  # messages queued per peer before sends start to drop
LINGER_MS = 2000  # how long a closing sender may spend flushing
MAX_MESSAGE_BYTES = 1 << 22  # 4 MiB: a sender drops a larger message of its own (lines come in 64 KiB reads)
MAX_FRAME_BYTES = 2 * MAX_MESSAGE_BYTES  # what the kernel's socket takes from any peer
RECEIVE_BATCH = 32  # messages decoded per receive() call
SOCKET_NAME = "wire.sock"
SIGNATURE_BYTES = 64  # an HMAC-SHA256 in hex, at the start of each frame
IPC_PATH_MAX = 100  # bytes: a Unix socket's path must fit sun_path (108 with its NUL)


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _sign(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).hexdigest().encode()


def encode(key: bytes, message: dict[str, Any]) -> list[bytes]:
    """``message`` as the frames to send: one, its signature and its payload."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    return [_sign(key, payload) + payload]


def decode(key: bytes, frames: list[bytes]) -> dict[str, Any] | None:
    """The message, or None when the frames are not a message signed with ``key``."""
    if len(frames) != 1:
        return None
    signature, payload = frames[0][:SIGNATURE_BYTES], frames[0][SIGNATURE_BYTES:]
    if not hmac.compare_digest(signature, _sign(key, payload)):
        return None
    try:
        message = json.loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


class PrivateEndpoint:
    """A PULL socket's ``ipc://`` address inside ``directory`` (mode 0700, this user's), or,
    where that path is too long for a Unix socket, inside a short private directory of the temp
    directory that ``close`` removes (and, if this process dies, the next nbshard start)."""

    def __init__(self, socket: zmq.Socket, directory: Path) -> None:
        path = Path(directory) / SOCKET_NAME
        self.spare: Path | None = None
        self._alive: int | None = None
        if len(os.fsencode(path)) > IPC_PATH_MAX:
            self.spare = Path(tempfile.mkdtemp(prefix="nbshard-wire-"))  # 0700
            self._alive = hold_alive(self.spare)
            path = self.spare / SOCKET_NAME
        socket.bind(f"ipc://{path}")
        os.chmod(path, 0o600)
        self.address = f"ipc://{path}"

    def close(self) -> None:
        if self._alive is not None:
            os.close(self._alive)
            self._alive = None
        if self.spare is not None:
            shutil.rmtree(self.spare, ignore_errors=True)


def bind_private(socket: zmq.Socket, directory: Path) -> PrivateEndpoint:
    """Bind a receiving ``socket`` where only this user's processes can reach it; a frame over
    ``MAX_FRAME_BYTES`` closes its sender."""
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return PrivateEndpoint(socket, directory)


class Receiver:
    """The kernel's end: one PULL socket for one run, bound inside the run's private directory."""

    def __init__(self, key: bytes, directory: Path) -> None:
        self.key = key
        self.rejected = 0  # frames dropped: unsigned, badly signed, replayed or out of order
        self.replayed = 0  # of those, signed ones whose count was not new
        self._last_seq: dict[str, int] = {}
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._endpoint = bind_private(self._socket, directory)
        self.address = self._endpoint.address

    def receive(self, timeout: float, most: int = RECEIVE_BATCH, also: int | None = None) -> list[dict[str, Any]]:
        """Wait up to ``timeout`` seconds for a message, then take up to ``most`` already queued
        (the rest stay in the socket as bytes, not decoded all at once in a flood). ``also``: a
        file descriptor whose data ends the wait too (the caller reads it)."""
        messages: list[dict[str, Any]] = []
        if also is None:
            if not self._socket.poll(int(timeout * 1000)):
                return messages
        elif self._socket not in zmq.select([self._socket, also], [], [], timeout)[0]:
            return messages
        for _ in range(most):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            message = self._fresh(decode(self.key, frames))
            if message is None:
                self.rejected += 1
            else:
                messages.append(message)
        return messages

    def seen(self, sender: Any) -> int:
        """The count of the last message taken from ``sender`` (0 before any)."""
        return self._last_seq.get(sender, 0)

    def _fresh(self, message: dict[str, Any] | None) -> dict[str, Any] | None:
        """The message without its stamp, if it is the next one of its sender; else None."""
        if message is None:
            return None
        sender, seq = message.pop("from", None), message.pop("seq", None)
        if not isinstance(sender, str) or not isinstance(seq, int):
            return None
        if seq <= self._last_seq.get(sender, -1):
            self.replayed += 1
            return None
        self._last_seq[sender] = seq
        return message

    def close(self) -> None:
        self._socket.close()
        self._endpoint.close()


class Sender:
    """The launcher's (or a rank's) end. Never blocks: a full queue drops and says so."""

    def __init__(self, address: str, key: bytes, linger_ms: int = LINGER_MS) -> None:
        self.key = key
        self.id = secrets.token_hex(8)
        self._seq = 0
        self.sent = 0  # the count of the last message queued (a dropped one's is skipped)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, linger_ms)
        self._socket.connect(address)

    def send(self, message: dict[str, Any], wait: float = 0.0) -> bool:
        """Queue ``message``, waiting at most ``wait`` seconds for room; False if dropped."""
        if wait and not self._socket.poll(int(wait * 1000), zmq.POLLOUT):
            return False
        self._seq += 1
        [frame] = encode(self.key, {**message, "from": self.id, "seq": self._seq})
        if len(frame) - SIGNATURE_BYTES > MAX_MESSAGE_BYTES:
            return False
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.sent = self._seq
        return True

    def close(self, linger_ms: int | None = None) -> None:
        """Flush for at most the linger time (``linger_ms``, else the one it was made with), so
        an exiting process never hangs on the kernel."""
        if linger_ms is not None:
            self._socket.setsockopt(zmq.LINGER, linger_ms)
        self._socket.close()
        self._context.term()
