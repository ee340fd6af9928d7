"""A persistent session's launcher: the ranks stay up, and run call after call.

Its ``RankGroup`` starts and streams the ranks as a job's launcher's does (composition: this is
that group's ``Driver``); what differs is here.

The kernel writes one line per command on the launcher's stdin (a socket only it
holds the other end of): ``run CALL DIGEST TIMEOUT ALL [JOB]`` (JOB: a small call's pickled job, in
base64; else it is the file ``calls/CALL/job.pkl``), ``interrupt``, ``kill``, ``close``, and
``replies`` (first, where the kernel itself holds that end: each call's end is then answered on
the same socket, not sent on the wire; ``nbshard.backends.channel``). The
launcher passes ``CALL DIGEST ALL [JOB]`` to each rank on a pipe of its own and collects
their ``CALL STATUS COLLECTIVES VALUE SAMPLE`` answers; when every rank has answered it says so
(with the ranks' small values, memory samples and the outcome) on the kernel's channel, else on
the wire (the values written as result files first), then writes ``calls/CALL/outcome.json`` (the layout of a job's run directory, so the kernel reads it
like a job's). A call that some rank cannot
leave, a rank that dies, or ranks whose collective counts disagree lose the
session: every rank is stopped (with its stacks) rather than left to hang or to
pair the wrong tensors in the next collective.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import selectors
import signal
import sys
import time
from typing import Any

from nbshard.contracts import LaunchSpec, RankOutcome, RunOutcome, Status
from nbshard.errors import how_it_ended
from nbshard.files import write_atomic, write_json
from nbshard.job import POST_MORTEM
from nbshard.run_dir import RunDir
from nbshard.process.launcher import FAILURE_GRACE
from nbshard.process.rank_group import RankGroup
from nbshard.process.rank_process import CallLog, Rank
from nbshard.ports import pick_port
from nbshard.process.session_rank import PIPES_ENV

__all__ = ["SessionLauncher"]

REPLIED = "replied"  # the selector's mark for a rank's answer pipe: (REPLIED, rank)


class SessionLauncher:
    """Runs the kernel's calls on this node's ranks, which stay up between them."""

    def __init__(self, run_dir: RunDir, spec: LaunchSpec, *, kernel_pidfd: int | None = None, fork_ranks: bool = False) -> None:
        self.run_dir, self.spec = run_dir, spec
        self.group = RankGroup(run_dir, spec, self, kernel_pidfd=kernel_pidfd, fork_ranks=fork_ranks)
        self.grace = float(self.spec.interrupt_grace)
        self.commands: dict[int, int] = {}  # rank -> the write end of its command pipe
        self.answers: dict[int, bytes] = {}  # rank -> an unfinished answer line
        self.call: str | None = None
        self.call_dir: RunDir | None = None
        self.replies: dict[int, tuple[str, int | None, float]] = {}  # rank -> (status, collectives, time)
        self.samples: list[str] = []  # the memory samples (JSON) the ranks answered with
        self.values: dict[str, str] = {}  # rank -> the call's pickled value in base64, where small
        self.call_stopped: Status | None = None  # INTERRUPTED or TIMED_OUT when the call was asked to stop
        self.call_deadline = self.leave_by = float("inf")
        self.waiting_on = ""  # what ranks that have not left the call by leave_by are waiting on
        self.lost_why: str | None = None
        self.session_logs: dict[int, Any] = {}
        self.ready: set[int] = set()  # ranks that handle an interrupt themselves (before, SIGINT would kill them)

    # -- ranks and their pipes --------------------------------------------

    def start_rank(self, env: dict[str, str]) -> Any:
        rank = int(env["RANK"])
        command_read, command_write = os.pipe()
        answer_read, answer_write = os.pipe()
        try:
            popen = self.group.start_process({**env, PIPES_ENV: f"{command_read},{answer_write}"}, (command_read, answer_write))
        finally:
            os.close(command_read)
            os.close(answer_write)
        self.commands[rank] = command_write
        self.answers[rank] = b""
        os.set_blocking(answer_read, False)
        self.group.selector.register(answer_read, selectors.EVENT_READ, (REPLIED, rank))
        return popen

    def marked(self, fd: int, mark: str, target: Any) -> None:
        """A rank's answer pipe (the only other mark) is readable."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.group.selector.unregister(fd)
            os.close(fd)
            return
        *lines, self.answers[target] = (self.answers[target] + data).split(b"\n")
        for line in lines:
            if line == b"ready":
                self.ready.add(target)
                continue
            call, status, count, value, sample = line.decode().split(" ", 4)
            if call == POST_MORTEM:
                self.group.stream.send({"kind": "event", "event": POST_MORTEM, "rank": target, "found": status == "done"})
            elif call == self.call and self.group.stop_reason is None:  # once the session ends, the call ends with it
                self.replies[target] = (status, None if count == "-" else int(count), time.time())
                if value != "-":
                    self.values[str(target)] = value
                if sample != "null":
                    self.samples.append(sample)
                self.answered(target, status)

    def rank_ended(self, proc: Rank, code: int) -> None:
        if self.group.stop_reason is None:
            self.lose(f"rank {proc.rank} {how_it_ended(code, cause=True)}", rank=proc.rank)

    # -- the kernel's commands ----------------------------------------------

    def kernel_input(self, fd: int) -> None:
        lines = self.group.kernel_lines(fd)
        for line in lines:
            if self.group.debug.command(line):
                continue
            command, *words = line.split()
            if command == "run":
                self.begin_call(words[0], words[1], float(words[2]), words[3], *words[4:5])
            elif command == "interrupt" and self.call is not None:
                self.stop_call(Status.INTERRUPTED, "the interrupt")
            elif command == "kill":
                self.lose("the kernel stopped the session at once", stacks=False)
            elif command == "close":
                self.close_session()
            elif command == "replies":
                self.group.stream.reply_on(sys.stdin.fileno())
            elif command == POST_MORTEM and self.call is None and int(words[0]) in self.commands:
                os.write(self.commands[int(words[0])], f"{POST_MORTEM}\n".encode())

    def begin_call(self, call: str, digest: str, timeout: float, return_all: str, inline: str = "") -> None:
        if self.call is not None or self.group.stop_reason is not None:
            return  # the kernel sends one call at a time, and none to a session it knows is ending
        self.group.stream.flush_lines()  # what the ranks printed between calls is no call's
        self.call, self.call_dir = call, RunDir(self.run_dir.path / "calls" / call)
        self.replies, self.samples, self.values, self.call_stopped, self.leave_by = {}, [], {}, None, float("inf")
        self.call_deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
        for proc in self.group.ranks:
            self.session_logs[proc.rank] = proc.log
            proc.log = CallLog(self.call_dir.log(proc.rank))
        line = " ".join(filter(None, (call, digest, return_all, inline))) + "\n"
        for fd in self.commands.values():
            os.write(fd, line.encode())

    def stop_call(self, status: Status, what: str) -> None:
        """Interrupt every rank still in the call; those that do not leave it within the grace
        period are stuck (in a collective or in C code), and the session is lost."""
        if self.call_stopped is None:
            self.call_stopped = status
            for proc in self.group.ranks:
                if proc.rank not in self.replies:
                    with contextlib.suppress(OSError):
                        os.write(self.commands[proc.rank], f"interrupt {self.call}\n".encode())
                    if proc.rank in self.ready:
                        proc.signal(signal.SIGINT)  # a KeyboardInterrupt in the call
            self.leave_by = min(self.leave_by, time.monotonic() + self.grace)
            self.waiting_on = f"within {self.grace:g} s of {what}"

    def answered(self, rank: int, status: str) -> None:
        if status == "error":
            self.group.debug.failed(rank)
        if len(self.replies) == len(self.group.ranks):
            self.end_call()
        elif status == "error" and self.leave_by == float("inf"):
            # The others may still finish their work, or wait in a collective for this rank forever.
            self.leave_by = time.monotonic() + self.grace
            self.waiting_on = f"within {self.grace:g} s after rank {rank} raised (most likely waiting for it in a collective)"

    def close_session(self) -> None:
        """Close the ranks' command pipes: each leaves its loop and exits as a script would
        (atexit, process groups torn down); SIGTERM after the grace period, then SIGKILL."""
        if self.group.stop_reason is None:
            self.group.stop_reason = Status.CLOSED
            self.group.stream.send({"kind": "event", "event": "stopping", "reason": Status.CLOSED})
            self.group.term_at = time.monotonic() + self.grace
            self.group.kill_at = self.group.term_at + self.spec.grace
        self.close_commands()

    def close_commands(self) -> None:
        for fd in self.commands.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.commands = {}

    def lose(self, why: str, rank: int | None = None, stacks: bool = True) -> None:
        if self.group.stop_reason is None:
            self.lost_why, self.group.first_failure = why, rank
            self.group.note(f"the session is lost: {why}; stopping its ranks")
            self.group.request_stop(Status.LOST, stacks=stacks, grace=FAILURE_GRACE)

    # -- timers ----------------------------------------------------------------

    def tick(self, now: float) -> None:
        if self.call is not None and self.group.stop_reason is None:
            if now >= self.call_deadline:
                self.stop_call(Status.TIMED_OUT, "the call's timeout")
            if now >= self.leave_by:
                stuck = [p.rank for p in self.group.ranks if p.rank not in self.replies]
                self.lose(f"rank{'s' * (len(stuck) > 1)} {', '.join(map(str, stuck))} did not leave the call {self.waiting_on}")

    # -- a call's end ------------------------------------------------------------

    def end_call(self) -> None:
        """Every rank answered: the call's outcome, unless the ranks no longer agree on how many
        collectives they issued (the next one would hang or pair the wrong tensors)."""
        counts = {rank: reply[1] for rank, reply in sorted(self.replies.items())}
        if len(set(counts.values())) > 1 and self.group.stop_reason is None:
            issued = ", ".join(f"rank {rank}: {'none' if n is None else n}" for rank, n in counts.items())
            self.lose(f"the ranks no longer agree on the collectives they issued ({issued}), so the next one would hang or pair the wrong tensors")
            return
        statuses = {reply[0] for reply in self.replies.values()}
        if self.call_stopped:
            self.finish_call(self.call_stopped)
        elif statuses == {"ok"}:
            self.finish_call(Status.SUCCEEDED)
        else:  # diverged: the function ran to its end in some ranks and not in others
            ran_through = {"ok", "unsent"}  # unsent: it returned, but its value could not be pickled
            self.finish_call(Status.FAILED, diverged=bool(statuses & ran_through and statuses - ran_through))

    def finish_call(self, status: Status, diverged: bool = False) -> None:
        assert self.call_dir is not None
        now = time.time()
        # What a rank printed before it answered belongs to the call.
        owners = {fd: proc for proc in self.group.ranks for fd in proc.open_fds}
        while owners and (readable := select.select(list(owners), [], [], 0)[0]):
            for fd in readable:
                self.group.read_output(owners[fd], fd, now)
                if fd not in owners[fd].open_fds:
                    del owners[fd]
        for proc in self.group.ranks:
            self.group.stream.send_lines(proc.rank, [line for splitter in proc.splitters.values() if (line := splitter.end_line(now))])
        samples = []
        for sample in self.samples:
            with contextlib.suppress(ValueError):
                samples.append(json.loads(sample))
        # The end carries the ranks' samples, small values and the outcome, so the kernel has what
        # the ranks hold after the call and need not wait for files; the outcome file (written next)
        # is the record, and what the kernel reads when the message is late or lost.
        record, end = self.ending(status, diverged, samples)
        if not self.group.stream.reply({**end, "values": self.values}):
            if not self.write_values():  # a full disk: the call's outcome says so
                record, end = self.ending(status, diverged, samples)
            self.group.stream.send(end)
        write_json(self.call_dir.outcome, record)
        for proc in self.group.ranks:
            proc.log.close()
            proc.log = self.session_logs.pop(proc.rank)
        self.call = self.call_dir = None
        self.call_deadline = self.leave_by = float("inf")

    def ending(self, status: Status, diverged: bool, samples: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The call's outcome record, and the end message that carries it."""
        errors = [r for r, reply in self.replies.items() if reply[0] == "error"]
        outcome = RunOutcome(
            status=status, diverged=diverged, reason=self.lost_why if status is Status.LOST else None,
            unsent=sorted(r for r, reply in self.replies.items() if reply[0] == "unsent"),
            storage_error=self.group.storage_error,
            first_failure=min(errors, key=lambda r: self.replies[r][2]) if errors else self.group.first_failure,
            ranks=[self.rank_outcome(proc) for proc in self.group.ranks],
        )
        record = outcome.to_json()
        return record, {"kind": "end", "status": status, "storage_error": self.group.storage_error, "outcome": record, "samples": samples}

    def write_values(self) -> bool:
        """The ranks' small values as the result files the kernel reads when its channel did not
        carry them; False (the storage error noted) where one could not be written."""
        assert self.call_dir is not None
        for rank, value in self.values.items():
            path = self.call_dir.result(int(rank))
            try:
                write_atomic(path, base64.b64decode(value))
            except OSError as error:
                self.group.storage_error = self.group.storage_error or f"{error.strerror} while writing {path}"
                return False
        return True

    def rank_outcome(self, proc: Rank) -> RankOutcome:
        assert self.call_dir is not None
        reply = self.replies.get(proc.rank)
        if reply is not None:
            ok = reply[0] == "ok"  # its value (rank 0's, or all with return_all) is written before it answers
            return RankOutcome(proc.rank, 0 if ok else 1, ok, reply[2], stopped=reply[0] == "interrupted")
        return RankOutcome(proc.rank, proc.returncode, False, proc.ended_at or time.time(),
                           stopped=proc.rank != self.group.first_failure, stacks=proc.stacks)

    def tag(self, message: dict[str, Any]) -> dict[str, Any]:
        """Lines, events and a call's end carry the call they belong to."""
        return {**message, "call": self.call} if self.call is not None else message

    # -- the whole session -------------------------------------------------------

    def run(self) -> RunOutcome:
        port = pick_port(self.spec.master_port)
        if self.group.stop_reason is None:
            self.group.start_ranks(port, 0)
            self.group.supervise()
        if self.call is not None:  # the session ended during a call: the call ends with it
            self.finish_call(self.group.stop_reason or Status.LOST)
        self.close_commands()
        outcome = self.group.outcome(port)
        outcome.reason = self.lost_why
        return outcome
