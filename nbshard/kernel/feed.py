"""What arrives for one job, put where the handle shows it: the ranks' lines into its live
backlog, memory samples and metrics into its telemetry, a rank's debugger prompts to its
debugger, the launcher's events to its launch stage; and the lines the kernel never showed,
counted and said (where the whole log is)."""

from __future__ import annotations

import collections
import contextlib
from typing import Any

from nbshard.contracts import EXITING_EVENT, RunOutcome
from nbshard.files import OpenedDir
from nbshard.run_dir import RunDir
from nbshard.kernel.backlog import LiveBacklog
from nbshard.kernel.debugging import RankDebugger
from nbshard.kernel.stages import LaunchStage
from nbshard.kernel.telemetry import Telemetry
from nbshard.stacks import not_exited_note

__all__ = ["JobFeed"]


class JobFeed:
    """The handle's live state (``live``, ``telemetry``, ``stage``, ``debugger``: the handle's own
    objects), fed message by message from whoever reads the job's messages."""

    def __init__(self, paths: RunDir, live: LiveBacklog, telemetry: Telemetry, stage: LaunchStage, debugger: RankDebugger) -> None:
        self.paths, self.live, self.telemetry, self.stage, self.debugger = paths, live, telemetry, stage, debugger
        self.reported_drops: collections.Counter[int] = collections.Counter()
        self.received_lines: collections.Counter[int] = collections.Counter()
        self.storage_error: str | None = None  # why the launcher could not write the run's files, if it said

    def on_message(self, message: dict[str, Any]) -> bool:
        """Record one message; True for the launcher's last one."""
        kind = message.get("kind")
        if kind == "lines":
            rank, texts = message["rank"], message["text"].split("\n")
            self.received_lines[rank] += len(texts)
            self.live.lines(rank, message["stream"], texts, message["open"])
            self.telemetry.last_line(rank, texts[-1])
        elif kind in ("sample", "metrics"):
            self.telemetry.add(message)
        elif kind == "dropped":
            self.note_dropped(message["rank"], message["count"])
        elif kind == "event" and message.get("event") in ("note", EXITING_EVENT):
            # Ranks slow to exit are described here, where a notebook cell's frames have its source.
            text = str(message["text"]) if message["event"] == "note" else not_exited_note(message["seconds"], message["stacks"])
            if not self.debugger.say(text):  # the reader waits in input(): shown now
                self.live.note(text)
        elif kind == "debug":
            self.debugger.arrived(message)
            self.live.wake()
        self.stage.follow(message)
        if kind == "end":
            self.storage_error = message.get("storage_error")
        return kind == "end"

    def note_dropped(self, rank: int, count: int) -> None:
        self.reported_drops[rank] += count
        self.live.note(
            f"{count} lines of rank {rank} were not shown live because the kernel read too "
            f"slowly; the full log is {self.paths.log(rank)}"
        )

    def note_unreported_drops(self, outcome: RunOutcome | None) -> None:
        """The launcher's final tally, in case its last notices could not reach the kernel, and
        lines it sent that never arrived (it exited before a slow kernel had read them)."""
        if outcome is None:
            return
        for rank, total in outcome.dropped_lines.items():
            missing = total - self.reported_drops[rank]
            if missing > 0:
                self.note_dropped(rank, missing)
        for rank, sent in outcome.lines_sent.items():
            lost = sent - self.received_lines[rank]
            if lost > 0:
                self.live.note(
                    f"the last {lost} lines of rank {rank} were not shown live: the launcher exited before "
                    f"the kernel had read them; the full log is {self.paths.log(int(rank))}"
                )

    def add_last_samples(self, files: OpenedDir, world_size: int) -> None:
        """Each rank's last sample (its peaks at the end) from its file, where the wire dropped it."""
        for rank in range(world_size):
            path = self.paths.last_sample(rank)
            if not files.exists(path):
                continue
            with contextlib.suppress(OSError, ValueError):
                sample = files.read_json(path)
                if isinstance(sample, dict) and isinstance(sample.get("time"), (int, float)) and sample["time"] > self.telemetry.last_time(rank):
                    self.telemetry.add(sample)
