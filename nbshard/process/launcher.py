"""A job's launcher: ``python -m nbshard.launcher RUN_DIR`` (through ``nbshard.process.entry``).

It runs outside the kernel, in its own session, and imports no torch. Its ``RankGroup``
starts the ranks and streams their output; this module decides what their ends mean: the
first failure stops every rank, a cancel (a byte from the kernel) or the timeout stops them
with their stacks, and a failure with ``max_restarts`` left starts them again
(``RestartPolicy``). A rendezvous port taken by another program before rank 0 could listen on
it is retried on another port. It writes ``outcome.json`` last.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from typing import Any

from nbshard.contracts import LaunchSpec, RunOutcome, Status
from nbshard.errors import start_failure
from nbshard.files import read_json
from nbshard.job import CANCEL, KILL
from nbshard.run_dir import RunDir
from nbshard.ports import pick_port
from nbshard.process.exits import SlowExits
from nbshard.process.forking import ForkedProcess
from nbshard.process.rank_group import RankGroup
from nbshard.process.rank_process import Rank
from nbshard.process.supervision import RestartPolicy

__all__ = ["FAILURE_GRACE", "JobLauncher"]

FAILURE_GRACE = 1.0  # SIGTERM to SIGKILL for ranks stopped because another failed
PORT_ATTEMPTS = 3


class JobLauncher:
    """Runs the job in ``run_dir`` on this node's ranks, attempt after attempt."""

    def __init__(self, run_dir: RunDir, spec: LaunchSpec, *, kernel_pidfd: int | None = None, fork_ranks: bool = False) -> None:
        self.run_dir, self.spec = run_dir, spec
        self.group = RankGroup(run_dir, spec, self, kernel_pidfd=kernel_pidfd, fork_ranks=fork_ranks)
        self.deadline = float("inf")
        # With several nodes, the kernel's NodeGroup restarts every node: a node never restarts alone.
        self.policy = RestartPolicy(run_dir, spec.max_restarts if spec.nnodes == 1 else 0, "every rank", self._mark_log)
        self.exits = SlowExits(run_dir)
        self.only_exits = False  # stopped (a cancel, the timeout) when every rank had returned: the values stand

    # -- the Driver's events ----------------------------------------------------

    def start_rank(self, env: dict[str, str]) -> subprocess.Popen[bytes] | ForkedProcess:
        return self.group.start_process(env)

    def kernel_input(self, fd: int) -> None:
        for line in self.group.kernel_lines(fd):
            if line == KILL.decode().strip():
                self.group.final = True
                self.stop(Status.CANCELLED, stacks=False, grace=0)
            elif line == CANCEL.decode().strip():
                self.group.final = True
                self.stop(Status.CANCELLED, stacks=True, grace=self.spec.grace)
            else:
                self.group.debug.command(line)

    def rank_ended(self, proc: Rank, code: int) -> None:
        """A rank returned, or its failure (the first) stops the others."""
        group = self.group
        # A rank stopped while it was exiting had returned: the stop was of its exit alone.
        proc.ok = (code == 0 or self.only_exits and proc.stopped) and self.run_dir.result(proc.rank).exists()
        group.log_error(proc)
        if not proc.ok and group.stop_reason is None:
            group.first_failure = proc.rank
            group.debug.failed(proc.rank)
            group.request_stop(Status.FAILED, stacks=False, grace=FAILURE_GRACE)

    def marked(self, fd: int, mark: str, target: Any) -> None:
        pass  # a job's ranks have no other channel

    def tick(self, now: float) -> None:
        if now >= self.deadline and self.group.stop_reason is None:
            self.stop(Status.TIMED_OUT, stacks=True, grace=self.spec.grace)
        if self.group.stop_reason is None and (slow := self.exits.tick(self.group.ranks, now)) is not None:
            self.group.stream.send(slow)

    def stop(self, reason: Status, *, stacks: bool, grace: float) -> None:
        """Stop every rank for ``reason`` (a cancel, the timeout); where each had returned and
        some are only exiting still, the job's values stand and the job succeeds."""
        group = self.group
        exiting = [p.rank for p in group.ranks if p.running and self.exits.returned(p)]
        if group.stop_reason is None and group.ranks and all(p.ok or p.rank in exiting for p in group.ranks):
            self.only_exits = True
            if exiting:
                what = "was cancelled" if reason is Status.CANCELLED else f"ran past its timeout of {self.spec.timeout:g} s"
                group.note(f"the job {what} after every rank had returned: stopping rank{'s' * (len(exiting) > 1)} "
                           f"{', '.join(map(str, exiting))}, which had not exited yet; the values are kept.")
        group.request_stop(reason, stacks=stacks, grace=grace)

    def tag(self, message: dict[str, Any]) -> dict[str, Any]:
        return message

    # -- attempts ----------------------------------------------------------------

    def run(self) -> RunOutcome:
        if self.spec.timeout:
            self.deadline = time.monotonic() + self.spec.timeout
        if self.group.stop_reason is not None:  # the kernel was gone before any rank started
            return self.group.outcome(self.spec.master_port or 0)
        return self.policy.run(
            self.run_attempt, self.spec.restart_count,
            final=lambda: self.group.final or not self.group.kernel_alive(), restarting=self._restarting,
        )

    def run_attempt(self, restart_count: int) -> tuple[RunOutcome, int]:
        """Start the ranks and supervise them to their end; retry a rendezvous port taken by another
        program (on one node: with several, the port is node 0's, chosen for every node), with
        the next restart count, as torchrun's agent starts a new round. Returns the outcome and
        the restart count the ranks last started with."""
        one_node = self.spec.nnodes == 1
        port = pick_port(self.spec.master_port) if one_node else self.spec.master_port
        if port is None:
            raise ValueError("a job of several nodes starts each node's launcher with the port node 0 chose (LaunchSpec.master_port), and this one has none")
        self.exits, self.only_exits = SlowExits(self.run_dir), False
        for retry in range(PORT_ATTEMPTS):
            if retry:
                restart_count += 1
            try:
                self.group.start_ranks(port, restart_count)
            except OSError as error:  # a restart would meet the same limit
                started = len(self.group.ranks)
                self.group.start_error = start_failure(error, self.spec.first_rank() + started, started, self.spec.nproc_per_node)
                self.group.final = True
                self.group.stop_started_ranks()
            self.group.supervise()
            if self.only_exits:
                outcome = self.group.outcome(port)
                outcome.status = Status.SUCCEEDED
                return outcome, restart_count
            if not (one_node and retry + 1 < PORT_ATTEMPTS and self._port_was_taken(port)):
                return self.group.outcome(port), restart_count
            self.group.note(f"MASTER_PORT {port} was taken by another program before rank 0 could listen on it; restarting the ranks on another port")
            port = pick_port(None)
            self.group.reset()
        raise AssertionError("not reached")  # the last retry returns

    def _restarting(self, text: str, restart_count: int) -> None:
        self.group.note(text)
        self.group.reset()

    def _mark_log(self, rank: int, text: str) -> None:
        for proc in self.group.ranks:
            if proc.rank == rank:
                self.group.to_log(proc, text.encode())

    def _port_was_taken(self, port: int) -> bool:
        """Whether rank 0 failed first because ``port`` (MASTER_PORT) was in use: a port the job's
        own code listens on (another launcher's) is the job's error, which a new port would not mend."""
        if self.group.first_failure != 0 or not self.run_dir.error(0).exists():
            return False
        with contextlib.suppress(OSError, ValueError):
            message = read_json(self.run_dir.error(0)).get("message", "")
            in_use = "EADDRINUSE" in message or "address already in use" in message.lower()
            return in_use and re.search(rf"(?<!\d){port}(?!\d)", message) is not None
        return False
