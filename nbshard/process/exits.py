"""Ranks whose function returned but whose process has not ended (a job's launcher).

A rank leaves as a script does: Python waits for the threads the job started that are not
daemons, then runs the atexit handlers. Either may take long (an upload, a checkpoint written
in the background) or never end (a thread in a loop, a library's handler waiting on a peer
that is gone). Nothing here cuts that short: the kernel is told, once, where such a rank is
(the cell says so: ``nbshard.stacks.not_exited_note``), and a stop (the stop button, the job's
timeout) keeps the values of the ranks that had returned.
"""

from __future__ import annotations

from typing import Any

from nbshard.contracts import EXITING_EVENT
from nbshard.process.rank_process import Rank
from nbshard.run_dir import RunDir

__all__ = ["NOTE_AFTER", "SlowExits"]

NOTE_AFTER = 10.0  # seconds after its function returned before the cell hears where a rank still is
LOOK_EVERY = 0.5  # seconds between looks at the ranks' result files (and for a rank to dump its stacks once asked)


class SlowExits:
    """Which running ranks have returned (their result file is written just before they
    leave), and the stacks of each that still runs ``NOTE_AFTER`` seconds later, once."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.returned_at: dict[Rank, float] = {}
        self.asked_at: dict[Rank, float] = {}
        self.noted: set[Rank] = set()
        self.next_look = 0.0

    def returned(self, proc: Rank) -> bool:
        """Whether ``proc``'s function has returned (its value, or None where not kept, is written)."""
        return proc in self.returned_at or self.run_dir.result(proc.rank).exists()

    def tick(self, ranks: list[Rank], now: float) -> dict[str, Any] | None:
        """The event that tells the kernel of the ranks that became slow to exit now (the
        seconds since each returned, and its stacks), or None."""
        if now < self.next_look:
            return None
        self.next_look = now + LOOK_EVERY
        slow: dict[str, float] = {}
        stacks: dict[str, str] = {}
        for proc in ranks:
            if not proc.running or proc in self.noted:
                continue
            if proc not in self.returned_at:
                if self.run_dir.result(proc.rank).exists():
                    self.returned_at[proc] = now
            elif proc not in self.asked_at:
                if now - self.returned_at[proc] >= NOTE_AFTER:
                    proc.ask_stacks(self.run_dir.stacks(proc.rank))
                    self.asked_at[proc] = now
            elif now - self.asked_at[proc] >= LOOK_EVERY:
                self.noted.add(proc)
                slow[str(proc.rank)] = round(now - self.returned_at[proc], 1)
                stacks[str(proc.rank)] = proc.read_stacks(self.run_dir.stacks(proc.rank))
        return {"kind": "event", "event": EXITING_EVENT, "seconds": slow, "stacks": stacks} if slow else None
