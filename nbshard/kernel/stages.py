"""What a job is doing while it starts, as its live view and ``handle.stage`` name it.

Each step of a launch is marked by a message: the launcher's ``started`` event, a rank's
first memory sample (it is up, importing the job), a rank's ``running`` stage (its job is
loaded) or its first metrics or lines. The launcher and each rank send on sockets of their
own, so the kernel may read a rank's ``running`` before its launcher's ``started``: the
stage only ever moves forward.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LaunchStage"]

STARTING_RANKS = "starting its ranks"
LOADING = "loading the job in its ranks (its imports)"
RUNNING = "running"


class LaunchStage:
    def __init__(self, world_size: int, warm: bool) -> None:
        self.world_size = world_size
        self.text = "starting its launcher" + ("" if warm else " (a fresh Python process)")
        self._step = 0  # 0 the launcher, 1 its ranks, 2 loading, 3 running in some or every rank
        self._running: set[int] = set()

    def follow(self, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "event" and message.get("event") == "started":
            self._advance(1, STARTING_RANKS)
        elif kind == "sample":
            self._advance(2, LOADING)
        elif (kind == "stage" and message.get("stage") == RUNNING) or kind == "metrics":  # metrics: its job runs
            self.rank_running(message["rank"])
        elif kind == "lines" and not self._running:
            self._advance(3, RUNNING)  # a launcher that sends no stages (another nbshard on a node)

    def rank_running(self, rank: int) -> None:
        self._running.add(rank)
        self._step = 3
        self.text = RUNNING if len(self._running) >= self.world_size else (
            f"running in {len(self._running)} of its ranks, loading in the others")

    def all_running(self) -> None:
        """Every rank is up and past its imports (a session's call)."""
        self._running.update(range(self.world_size))
        self._step, self.text = 3, RUNNING

    def _advance(self, step: int, text: str) -> None:
        if step > self._step:
            self._step, self.text = step, text
