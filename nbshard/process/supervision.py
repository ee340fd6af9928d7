"""The one restart policy: run an attempt; a failure, with restarts left and someone waiting,
sets the attempt's files aside, says why it failed, and starts every member again; anything else
ends the run. Like torch elastic's agent, one loop, whatever the members are: a node's launcher
drives it with ranks, a multi-node run's ``NodeGroup`` with nodes. (That the first failure stops
the other members is each driver's: it signals ranks, or asks nodes to cancel.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from nbshard.contracts import Attempt, RunOutcome, Status
from nbshard.run_dir import RunDir
from nbshard.process import attempts

__all__ = ["RestartPolicy"]


class RestartPolicy:
    """``members``: what starts again ("every rank", "every node"); ``mark_log(rank, text)``
    writes the attempt's end into that rank's log, which holds every attempt."""

    def __init__(self, run_dir: RunDir, max_restarts: int, members: str, mark_log: Callable[[int, str], None]) -> None:
        self.run_dir, self.max_restarts, self.members, self._mark_log = run_dir, max_restarts, members, mark_log
        self.attempts: list[Attempt] = []

    def should_restart(self, outcome: RunOutcome, *, final: bool) -> bool:
        """A failure (not a cancel, a timeout, a full disk, a process limit) with restarts left,
        and nobody has said it is over (``final``: a cancel, or the kernel is gone)."""
        return (
            outcome.status is Status.FAILED and not final and not outcome.storage_error and not outcome.start_error
            and len(self.attempts) < self.max_restarts
        )

    def set_aside(self, outcome: RunOutcome, restart_count: int, also: Sequence[Path] = ()) -> str:
        """Move the failed attempt's error and stack files (and ``also``) into its folder,
        remember its cause, mark it in each rank's log; returns what to tell the kernel."""
        folder = attempts.set_aside(self.run_dir, (entry.rank for entry in outcome.ranks), restart_count)
        for path in also:
            with contextlib.suppress(OSError):
                os.replace(path, folder / path.name)
        if outcome.lost_nodes:
            rank, why = None, "because " + "; ".join(f"node {node} was lost: {text}" for node, text in outcome.lost_nodes.items())
        else:
            rank, why = attempts.first_cause(folder, outcome.ranks)
        text = attempts.record(self.attempts, rank, why, folder, self.members, self.max_restarts, restart_count)
        for entry in outcome.ranks:
            self._mark_log(entry.rank, f"\n[nbshard] {text}\n")
        return text

    def run(
        self, run_attempt: Callable[[int], tuple[RunOutcome, int]], first_restart_count: int, *,
        final: Callable[[], bool], restarting: Callable[[str, int], None], also: Sequence[Path] = (),
    ) -> RunOutcome:
        """Attempts until one is not restarted; returns its outcome with every failed attempt
        before it. ``run_attempt(restart_count)`` returns the outcome and the restart count its
        ranks last started with (a driver may start them again within an attempt);
        ``restarting(text, restart_count)`` tells and prepares the next attempt."""
        restart_count = first_restart_count
        while True:
            outcome, restart_count = run_attempt(restart_count)
            if not self.should_restart(outcome, final=final()):
                outcome.attempts = list(self.attempts)
                return outcome
            restarting(self.set_aside(outcome, restart_count, also), restart_count + 1)
            restart_count += 1
