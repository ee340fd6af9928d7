"""pdb in a rank, answered from the notebook: the rank's side.

A rank's stdin is ``/dev/null``, so a plain ``breakpoint()`` would quit at once. Here
``pdb.Pdb`` itself is replaced by ``RankPdb``, whose stdin and stdout are a socket to the
launcher: ``breakpoint()``, ``pdb.set_trace()``, ``pdb.post_mortem()`` and
``torch.distributed.breakpoint()`` (which subclasses ``pdb.Pdb`` when it is called) all
use it. What pdb writes is kept until it reads a line; then the text goes to the kernel
(through the launcher, signed as every message) and the person's answer comes back.

On the socket, one JSON object per line. From the rank: ``{"seq", "text", "alone"}`` (pdb's
output, ending with its prompt; ``alone`` in a post-mortem, where no other rank waits for
this one) and ``{"resumed": true}`` (the rank runs again). To the rank: ``{"seq", "line"}``
(what the person typed) or ``{"seq", "detach": true}`` (nobody can answer here: go on, and
pass over later breakpoints).

``NBSHARD_DEBUG_RANKS`` (``"1"``, ``"0,2"``) names the ranks where a breakpoint stops; the
others pass over it. ``PYTHONBREAKPOINT=0`` turns ``breakpoint()`` off, as in any Python.
"""

from __future__ import annotations

import json
import os
import pdb
import socket
import sys
import types
from typing import Any

from nbshard.job import DEBUG_FD_ENV, DEBUG_RANKS_ENV

__all__ = ["RankPdb", "debug_ranks", "install", "post_mortem"]

_PlainPdb = pdb.Pdb


def debug_ranks(value: str | None) -> set[int] | None:
    """The ranks ``NBSHARD_DEBUG_RANKS`` names (None: every rank)."""
    if not value or not value.strip():
        return None
    try:
        return {int(part) for part in value.replace(" ", "").split(",") if part}
    except ValueError:
        raise ValueError(f"{DEBUG_RANKS_ENV}={value!r}: list rank numbers separated by commas, e.g. 1 or 0,2") from None


class _Link:
    """This rank's debug socket: one question out, its answer back."""

    channel: socket.socket | None = None
    rank = -1
    seq = 0
    detached = False  # nobody can answer (a notebook run without input): breakpoints are passed over
    buffer = b""

    alone = False  # a post-mortem: the other ranks are not held up, so not asked where they are

    @classmethod
    def ask(cls, text: str) -> str | None:
        """Send pdb's output (its prompt last) and wait for the person's line; None when nobody
        can answer."""
        if cls.channel is None or cls.detached:
            return None
        cls.seq += 1
        cls._send({"seq": cls.seq, "text": text, "alone": cls.alone})
        while True:
            while b"\n" not in cls.buffer:
                data = cls.channel.recv(1 << 16)
                if not data:  # the launcher is gone
                    cls.detached = True
                    return None
                cls.buffer += data
            raw, cls.buffer = cls.buffer.split(b"\n", 1)
            answer = json.loads(raw)
            if answer.get("seq") != cls.seq:
                continue  # for an earlier question
            if answer.get("detach"):
                cls.detached = True
                return None
            return str(answer.get("line", ""))

    @classmethod
    def resumed(cls) -> None:
        if cls.channel is not None and not cls.detached:
            cls._send({"resumed": True})

    @classmethod
    def _send(cls, message: dict[str, Any]) -> None:
        assert cls.channel is not None
        try:
            cls.channel.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            cls.detached = True


class _Console:
    """pdb's stdin and stdout: output waits for the next read, which asks the kernel."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def write(self, text: str) -> int:
        self.written.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        text, self.written = "".join(self.written), []
        line = _Link.ask(text)
        if line is None:  # nobody to ask: go on (pdb's own reaction to end of input would quit the job)
            return "continue\n"
        return line + "\n"


class RankPdb(_PlainPdb):
    """``pdb.Pdb`` in a rank: it talks to the notebook, and stops only on the ranks that
    ``NBSHARD_DEBUG_RANKS`` names."""

    def __init__(self, completekey: str = "tab", stdin: Any = None, stdout: Any = None, skip: Any = None,
                 nosigint: bool = False, readrc: bool = True, **kwargs: Any) -> None:
        console: Any = _Console()  # file-like: what pdb reads and writes
        # No SIGINT handler of pdb's own (a session's interrupt is nbshard's), no .pdbrc of the machine.
        super().__init__(completekey, stdin or console, stdout or console, skip, nosigint=True, readrc=False, **kwargs)
        self.prompt = f"(Pdb rank {_Link.rank}) "

    def set_trace(self, frame: types.FrameType | None = None, *args: Any, **kwargs: Any) -> None:
        if _stops_here():
            super().set_trace(frame or sys._getframe().f_back, *args, **kwargs)

    def interaction(self, frame: Any, traceback: Any) -> None:
        try:
            super().interaction(frame, traceback)
        finally:
            _Link.resumed()


def _stops_here() -> bool:
    if _Link.detached:
        return False
    chosen = debug_ranks(os.environ.get(DEBUG_RANKS_ENV))
    return chosen is None or _Link.rank in chosen


def install(rank: int) -> None:
    """Make pdb in this rank talk to the notebook, over the socket the launcher gave it."""
    fd = os.environ.pop(DEBUG_FD_ENV, None)
    if fd is None:
        return
    _Link.channel = socket.socket(fileno=int(fd))
    _Link.channel.set_inheritable(False)  # a rank's own children (DataLoader workers) have no debugger
    _Link.rank = rank
    pdb.Pdb = RankPdb  # type: ignore[misc]
    sys.breakpointhook = _breakpoint


def _breakpoint(*args: Any, **kwargs: Any) -> Any:
    """``breakpoint()`` on the chosen ranks only: pdb at the caller, or what ``PYTHONBREAKPOINT``
    names (``0``: nothing), as Python's own hook does."""
    chosen = os.environ.get("PYTHONBREAKPOINT", "")
    if not _stops_here() or chosen == "0":
        return None
    if chosen in ("", "pdb.set_trace"):
        return RankPdb().set_trace(sys._getframe().f_back)
    return sys.__breakpointhook__(*args, **kwargs)


def post_mortem(traceback: types.TracebackType) -> None:
    """pdb at the frame where ``traceback``'s exception was raised, whichever ranks are chosen."""
    debugger = RankPdb()
    debugger.reset()
    _Link.alone = True
    try:
        debugger.interaction(None, traceback)
    finally:
        _Link.alone = False
