"""pdb in a rank, answered from the notebook: the launcher's side (the rank's is
``nbshard.process.debugger``).

Each rank gets one end of a socket pair. What its pdb asks goes to the kernel as a signed
``debug`` message; the kernel's answer comes back as a ``debug RANK {json}`` command line
and is written to that rank alone. When a rank stops (not when it steps), the other ranks
are asked where they are (their stacks, SIGUSR1, a moment later: they reach the collective
that will wait for it) and its first prompt waits for their answers, so the cell can say where
each one waits. No new port: the socket pair is private
to the launcher and the rank, and the kernel's channel is the one it already signs.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import time
from typing import Any, Protocol

from nbshard.job import DEBUG_FD_ENV, STACK_DUMP_WAIT
from nbshard.run_dir import RunDir
from nbshard.process.kernel_stream import KernelStream
from nbshard.process.rank_process import Rank

__all__ = ["DEBUG", "DebugRelay", "MAX_DEBUG_TEXT"]

DEBUG = "debug"  # the selector's mark for a rank's debug socket: (DEBUG, rank)
MAX_DEBUG_TEXT = 1 << 20  # characters of pdb output in one prompt (a printed tensor can be long)
STEPPING = 2.0  # seconds: a rank that stops again this soon after it resumed is stepping (n, s)
SETTLE = 0.25  # seconds the peers of a rank that stopped get to reach what they will wait in, before they are asked


class Group(Protocol):
    """What the relay uses of its ``RankGroup`` (which owns it)."""

    selector: selectors.BaseSelector
    ranks: list[Rank]
    run_dir: RunDir
    stream: KernelStream

    def note(self, text: str) -> None: ...


class DebugRelay:
    """The ranks' debug sockets on this node, and who waits for an answer."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.buffers: dict[int, bytes] = {}
        self.asking: dict[int, float] = {}  # rank -> since when its prompt waits for the person
        self.resumed_at: dict[int, float] = {}
        # Prompts waiting for the others' stacks: [when next to act, the message, the rank, the peers asked (None: not yet)]
        self.held: list[list[Any]] = []

    @staticmethod
    def connect(env: dict[str, str]) -> tuple[socket.socket, socket.socket]:
        """A socket pair (ours, the rank's) for the rank about to start: its end's number goes
        in ``env``; the caller passes that end to the rank, then closes it here."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        env[DEBUG_FD_ENV] = str(theirs.fileno())
        return ours, theirs

    def started(self, proc: Rank, ours: socket.socket) -> None:
        proc.debug = ours
        self.buffers[proc.rank] = b""
        self.group.selector.register(ours.fileno(), selectors.EVENT_READ, (DEBUG, proc))

    def forget(self, proc: Rank) -> None:
        if proc.debug is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.group.selector.unregister(proc.debug.fileno())
        self.asking.pop(proc.rank, None)

    def readable(self, proc: Rank) -> None:
        assert proc.debug is not None
        try:
            data = proc.debug.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.forget(proc)
            return
        *lines, self.buffers[proc.rank] = (self.buffers[proc.rank] + data).split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError, TypeError):
                self._from_rank(proc, json.loads(line))

    def _from_rank(self, proc: Rank, said: dict[str, Any]) -> None:
        now = time.monotonic()
        if said.get("resumed"):
            self.asking.pop(proc.rank, None)
            self.resumed_at[proc.rank] = now
            self.group.stream.send({"kind": "debug", "rank": proc.rank, "resumed": True})
            return
        text = str(said.get("text", ""))
        if len(text) > MAX_DEBUG_TEXT:
            text = f"[nbshard: {len(text) - MAX_DEBUG_TEXT} characters of pdb's output left out]\n" + text[-MAX_DEBUG_TEXT:]
        message = {"kind": "debug", "rank": proc.rank, "ask": int(said["seq"]), "text": text}  # "seq" is the wire's own
        stopping = not said.get("alone") and proc.rank not in self.asking and now - self.resumed_at.get(proc.rank, -STEPPING) >= STEPPING
        self.asking.setdefault(proc.rank, time.time())
        if not stopping:
            self.group.stream.send(message)
            return
        self.held.append([now + SETTLE, message, proc, None])

    def tick(self, now: float) -> None:
        """Ask the peers of a rank that stopped where they are, once they had a moment to reach
        the collective that will wait for it; send its prompt once they had time to answer."""
        for held in self.held:
            if held[3] is None and now >= held[0]:
                held[3] = [p for p in self.group.ranks if p is not held[2] and p.ask_stacks(self.group.run_dir.stacks(p.rank))]
                held[0] = now + STACK_DUMP_WAIT
        while self.held and (self.held[0][3] is not None and now >= self.held[0][0] or not any(p.running for p in self.group.ranks)):
            _, message, _, asked = self.held.pop(0)
            message["others"] = {str(p.rank): p.read_stacks(self.group.run_dir.stacks(p.rank)) for p in asked or ()}
            self.group.stream.send(message)

    def command(self, line: str) -> bool:
        """Whether ``line`` from the kernel is an answer to a prompt (``debug RANK {json}``),
        which then goes to that rank (if it runs on this node)."""
        command, _, rest = line.partition(" ")
        if command != DEBUG:
            return False
        rank, _, reply = rest.partition(" ")
        for proc in self.group.ranks:
            if str(proc.rank) == rank and proc.debug is not None and proc.running:
                with contextlib.suppress(OSError):  # a line or two: the socket's buffer holds it
                    proc.debug.send(reply.encode() + b"\n")
        return True

    def failed(self, rank: int) -> None:
        """Say so when a rank fails while another waits in its debugger: most likely a collective
        of the failed rank timed out, held up by the paused one."""
        paused = self.paused(besides=rank)
        if paused:
            now = time.time()
            who = ", ".join(f"rank {r} (for {now - since:.0f} s)" for r, since in sorted(paused.items()))
            self.group.note(
                f"rank {rank} failed while {who} waited in the debugger. A rank paused in pdb holds up its peers' "
                "collectives, which fail once the process group's timeout passes. While debugging, give "
                "init_process_group a longer timeout (timeout=datetime.timedelta(hours=1)), or stop with "
                "torch.distributed.breakpoint(rank), which lengthens it on every rank."
            )

    def paused(self, besides: int | None = None) -> dict[int, float]:
        """Ranks whose prompt waits for the person (rank -> since when, wall clock)."""
        return {rank: since for rank, since in self.asking.items() if rank != besides}
