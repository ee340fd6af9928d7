"""pdb in a rank, answered from the notebook: the kernel's side (the rank's is
``nbshard.process.debugger``, the launcher's ``nbshard.process.debug_relay``).

A rank's prompt arrives as a ``debug`` message; the thread that waits for the job (``watch``,
in the cell) shows pdb's output and asks with ``input()``: in Jupyter that is the kernel's
input request (JupyterLab's input box), in a terminal the terminal. The answer goes back as
a ``debug RANK {json}`` line to the launcher. Where nobody can answer (a notebook run by
nbconvert without input, a captured stdin), the rank is told to go on and to pass over later
breakpoints, and the cell says so once.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable
from typing import Any

from nbshard.kernel.interrupts import deferred_interrupts
from nbshard.stacks import where_stopped

__all__ = ["QUIT_COMMANDS", "PostMortem", "RankDebugger", "answer_line"]

QUIT_COMMANDS = frozenset({"q", "quit", "exit"})  # pdb's words for leaving: the job (or call) stops


def answer_line(rank: int, reply: dict[str, Any]) -> bytes:
    """The launcher's command that carries ``reply`` to ``rank``'s debugger."""
    return f"debug {rank} {json.dumps(reply, separators=(',', ':'))}\n".encode()


class RankDebugger:
    """The prompts of ranks paused in pdb, oldest first: the handle's thread adds them as they
    arrive; ``answer`` (the thread that waits for the job) asks the person."""

    # What the person is told where nobody can answer here (a breakpoint's; a post-mortem's differs).
    UNANSWERED = ("stopped at a breakpoint, but nobody can answer here ({error}): its ranks go on and pass over "
                  "later breakpoints. Run the cell in Jupyter or a terminal to debug, or set PYTHONBREAKPOINT=0 "
                  "in env= to skip breakpoints.")

    def __init__(self, send: Callable[[bytes, bool], None], unanswered: str = UNANSWERED) -> None:
        self._send = send  # (the launcher's command, whether the job or call stops with it)
        self._unanswered = unanswered
        self._write: Callable[[str], None] | None = None  # where the prompt now asked was shown
        self._prompts: collections.deque[dict[str, Any]] = collections.deque()
        self._lock = threading.Lock()
        self.paused: set[int] = set()  # ranks stopped in pdb (between their first prompt and their resume)
        self.asking: int | None = None  # the rank whose prompt input() shows now
        self.last: tuple[int, int] | None = None  # (rank, prompt) last asked about
        self.detached = False  # nobody can answer here: ranks were told to go on
        self.watched = False  # a thread asks the person as prompts come (watch)

    def arrived(self, message: dict[str, Any]) -> None:
        rank = int(message["rank"])
        with self._lock:
            if message.get("resumed"):
                self.paused.discard(rank)
                return
            self.paused.add(rank)
            self._prompts.append(message)

    def waiting(self) -> bool:
        return bool(self._prompts)

    def describe(self) -> str | None:
        """Which ranks are paused, for the live view; and, when nobody is asked (a ``show_live``
        view), how to answer."""
        if not self.paused:
            return None
        ranks = ", ".join(map(str, sorted(self.paused)))
        how = "" if self.watched else ": handle.watch() answers"
        return f"rank{'s' * (len(self.paused) > 1)} {ranks} paused in the debugger{how}"

    def answer(self, write: Callable[[str], None], ended: Callable[[], bool], ask: Callable[[str], str] = input) -> str | None:
        """Ask the person about the oldest prompt (with ``ask``, ``input`` by default); returns
        the command they gave (None when there was no prompt, or nobody can answer). A quit
        (``q``) stops the job or call too."""
        with self._lock:
            if not self._prompts:
                return None
            message = self._prompts.popleft()
        rank, seq = int(message["rank"]), int(message["ask"])
        if ended():
            return None
        shown, _, prompt = str(message["text"]).rpartition("\n")
        others = message.get("others")
        if others:
            write(_others_text(rank, others))
        if shown:
            write(shown + "\n")
        if self.detached:
            self._send(answer_line(rank, {"seq": seq, "detach": True}), False)
            return None
        self.asking, self._write, self.last = rank, write, (rank, seq)
        try:
            line = ask(prompt or f"(Pdb rank {rank}) ")
        except (EOFError, OSError, NotImplementedError) as error:  # no stdin here (nbconvert, a captured one)
            self.detached = True
            self._send(answer_line(rank, {"seq": seq, "detach": True}), False)
            after_prompt = "\n" if isinstance(error, EOFError) else ""  # input() wrote the prompt, then met the end
            write(f"{after_prompt}[nbshard] rank {rank} " + self._unanswered.format(error=f"{type(error).__name__}: {error}") + "\n")
            return None
        finally:
            self.asking = None
        if not ended():
            self._send(answer_line(rank, {"seq": seq, "line": line}), line.strip() in QUIT_COMMANDS)
        return line

    def say(self, text: str) -> bool:
        """Show ``text`` at once if a prompt waits for the person (the thread that shows lines
        waits in input()); False when none does."""
        asking, write = self.asking, self._write
        if asking is None or write is None:
            return False
        write(f"\n[nbshard] {text}\n")
        return True

    def ended(self, how: str) -> None:
        """The job (or call) ended: a prompt still waiting has nobody to answer it."""
        self.say(f"{how}, while rank {self.asking}'s debugger waited for you; press Enter to see the rest.")


def _others_text(rank: int, others: dict[str, str]) -> str:
    lines = [f"[nbshard] rank {rank} stopped in the debugger; where the other ranks are:"]
    for other, stacks in sorted(others.items(), key=lambda item: int(item[0])):
        where = where_stopped(stacks) if stacks else []
        lines.append(f"  rank {other}: " + ("\n    ".join(where) if where else "(it did not say: still starting, or ended)"))
    return "\n".join(lines) + "\n"


class PostMortem:
    """A session's post-mortem in one rank: pdb's prompts until the rank says it left pdb."""

    def __init__(self, rank: int, send: Callable[[bytes], None]) -> None:
        self.rank = rank
        self._send = send
        self.debugger = RankDebugger(  # a quit only leaves pdb
            lambda command, stop: send(command),
            unanswered="kept its error for a post-mortem, but nobody can answer pdb here ({error}): it left pdb, "
                       "and the session is ready. Call session.debug() (or %shard_debug) in Jupyter or a terminal.",
        )
        self.ended = threading.Event()
        self.found: bool | None = None  # whether the rank kept a failed call's error

    def arrived(self, message: dict[str, Any]) -> None:
        if message.get("kind") == "debug":
            self.debugger.arrived(message)
        elif message.get("rank") == self.rank:
            self.found = bool(message.get("found"))
            self.ended.set()

    def serve(self, write: Callable[[str], None], lost: Callable[[], bool]) -> None:
        """Answer the rank's prompts until it left pdb (or the session is lost). An interrupt
        leaves pdb (``q``) and returns once the rank did."""
        with deferred_interrupts() as interrupts:  # raised at the checks, not inside the event's lock
            while not self.ended.wait(0.02) and not lost():
                try:
                    interrupts.check()
                    self.debugger.answer(write, self.ended.is_set, interrupts.raising_in(input))
                except KeyboardInterrupt:
                    if self.debugger.last is not None:
                        rank, seq = self.debugger.last
                        self._send(answer_line(rank, {"seq": seq, "line": "q"}))
                    write("\n[nbshard] interrupted: leaving the debugger\n")
                    self.ended.wait(5.0)
                    return
