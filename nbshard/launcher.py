"""Supervise the ranks of one run: ``python -m nbshard.launcher RUN_DIR``.

The launcher runs outside the kernel, in its own session, and imports no
torch. It starts the ranks as its children (in its process group), reads
their stdout and stderr at the file-descriptor level into one log per rank,
streams the lines to the kernel, and stops every rank on the first failure,
on cancel, on timeout and when the kernel goes away (its stdin, a pipe from
the kernel, reaches end-of-file). It writes ``outcome.json`` last.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nbshard import attempts
from nbshard.contracts import Attempt, LaunchSpec, RankOutcome, RunOutcome, Status
from nbshard.errors import signal_name, start_failure
from nbshard.files import open_private, read_json, write_atomic
from nbshard.forking import ForkedProcess, fork_rank
from nbshard.fresh import cold_command
from nbshard.job import CANCEL, KILL, STACK_DUMP_WAIT, RunDir, rank_environment
from nbshard.lines import LineSplitter
from nbshard.ports import pick_port
from nbshard.reaper import adopt_orphans, kill_leftovers
from nbshard.wire import Sender

__all__ = ["main", "pick_port"]

TICK = 0.1  # seconds between checks of exits, deadlines and open (\r) lines
FAILURE_GRACE = 1.0  # SIGTERM to SIGKILL for ranks stopped because another failed
KERNEL_GONE_GRACE = 1.0
PIPE_DRAIN_WAIT = 1.0  # how long exited ranks' children may hold the pipes open
PORT_ATTEMPTS = 3
END_SEND_WAIT = 1.0  # how long the final messages may wait for room in the queue when nobody reads them
FINAL_FLUSH = 10.0  # how long they may wait, and be flushed, while the kernel lives (a slow one, after a flood)
KERNEL = "kernel"  # the selector's mark for the kernel's pidfd
EXITED = "exited"  # the selector's mark for a rank's pidfd, with the rank: (EXITED, rank)


def _readable(fd: int) -> bool:
    """Whether ``fd`` (a pidfd: its process has exited) is readable now."""
    return bool(select.select([fd], [], [], 0)[0])


class Rank:
    """One rank process, its pipes and its log."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes] | ForkedProcess, log_path: Path) -> None:
        self.rank = rank
        self.popen = popen
        self.log = open_private(log_path, "ab", buffering=0)  # noqa: SIM115 - closed in close(); unbuffered: a full disk shows at once
        self.pipes = (popen.stdout, popen.stderr)
        self.splitters = {pipe.fileno(): LineSplitter(name) for pipe, name in zip(self.pipes, ("out", "err"))}
        self.open_fds = set(self.splitters)
        self.returncode: int | None = None
        self.ended_at = 0.0
        self.ok = False
        self.stopped = False
        self.stacks_asked = False
        self.stacks = ""
        self.pidfd: int | None = None

    @property
    def running(self) -> bool:
        return self.returncode is None

    def catches(self, signum: int) -> bool:
        """Whether the rank handles ``signum`` yet: its kernel-side mask of caught signals.
        A rank still starting Python has the default action, which for SIGUSR1 kills."""
        try:
            with open(f"/proc/{self.popen.pid}/status") as status:
                caught = next(line for line in status if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            return False
        return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)

    def signal(self, signum: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()
        self.close_pidfd()
        self.log.close()

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Launcher:
    """``kernel_pidfd``: the kernel's pidfd when a warm process forked this launcher (else the
    kernel is its parent, found by pid). ``fork_ranks``: fork the ranks from this process,
    which has torch imported, instead of starting fresh interpreters."""

    def __init__(self, run_dir: RunDir, *, kernel_pidfd: int | None = None, fork_ranks: bool = False) -> None:
        self.run_dir = run_dir
        self.spec = LaunchSpec.read(run_dir.launch)
        self.fork_ranks = fork_ranks
        self._sender: Sender | None = None  # opened once the ranks are started: ZeroMQ's threads must not exist at a fork
        self.selector = selectors.DefaultSelector()
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
        self.ranks: list[Rank] = []
        self.dropped: dict[int, int] = {}  # lines not streamed and not yet reported, by rank
        self.dropped_total: dict[int, int] = {}
        self.lines_sent: dict[int, int] = {}  # queued for the kernel, by rank: it can tell what never arrived
        self.notes: list[str] = []
        self.stop_reason: Status | None = None
        self.first_failure: int | None = None
        self.term_at = self.kill_at = float("inf")
        self.signalled: Status | None = None
        self.signal_received: str | None = None
        self.storage_error: str | None = None  # why the run's files could not be written (a full disk)
        self.start_error: str | None = None  # why a rank could not be started (fork refused: a process limit)
        self.final = False  # cancelled, or the kernel is gone: a failure now is not restarted
        self.attempts: list[Attempt] = []  # the failed attempts that were restarted
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.kernel_pidfd: int | None = None
        if kernel_pidfd is not None:
            self.kernel_pidfd = kernel_pidfd
            self.selector.register(kernel_pidfd, selectors.EVENT_READ, KERNEL)
        else:
            self.kernel_pidfd = self.watch_kernel(self.spec.kernel_pid)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = Status.CANCELLED
        self.signal_received = signal_name(signum)  # from outside: a user, or a scheduler (scancel)
        self.final = True

    # -- messages ---------------------------------------------------------

    @property
    def sender(self) -> Sender:
        if self._sender is None:
            self._sender = Sender(self.spec.address, self.run_dir.key.read_bytes())
        return self._sender

    def close_sender(self, linger: float | None = None) -> None:
        """Flush (for ``linger`` seconds at most) and close the socket, ending ZeroMQ's threads
        (before forking ranks again)."""
        if self._sender is not None:
            self._sender.close(None if linger is None else int(linger * 1000))
            self._sender = None

    def send(self, message: dict[str, Any], rank: int | None = None, lines: int = 0, wait: float = 0.0) -> None:
        """Send without blocking (or ``wait`` at most); count lines the kernel was too slow to take."""
        if rank is not None:
            self.send_dropped_notice(rank, wait)
        sent = self.sender.send(message, wait)
        if lines and not sent:
            self.dropped[rank] = self.dropped.get(rank, 0) + lines  # type: ignore[index]
            self.dropped_total[rank] = self.dropped_total.get(rank, 0) + lines  # type: ignore[index]
        elif lines:
            self.lines_sent[rank] = self.lines_sent.get(rank, 0) + lines  # type: ignore[index]

    def send_dropped_notice(self, rank: int, wait: float = 0.0) -> None:
        if self.dropped.get(rank):
            notice = {"kind": "dropped", "rank": rank, "count": self.dropped[rank], "log": str(self.run_dir.log(rank))}
            if self.sender.send(notice, wait):
                self.dropped[rank] = 0

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.send({"kind": "event", "event": "note", "text": text})

    # -- ranks ------------------------------------------------------------

    def start_ranks(self, port: int, restart_count: int) -> None:
        spec = self.spec
        for local_rank in range(spec.nproc_per_node):
            rank = spec.first_rank() + local_rank
            for stale in (self.run_dir.result(rank), self.run_dir.error(rank)):
                stale.unlink(missing_ok=True)
            env = rank_environment(
                os.environ, rank=local_rank, nproc=spec.nproc_per_node, master_port=port,
                run_id=spec.run_id, run_dir=self.run_dir, restart_count=restart_count,
                max_restarts=spec.max_restarts, node_rank=spec.node_rank, nnodes=spec.nnodes, master_addr=spec.master_addr,
            )
            env["NBSHARD_LAUNCHER_PID"] = str(os.getpid())
            proc = Rank(rank, self.start_rank(env), self.run_dir.log(rank))
            for fd in proc.splitters:
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_READ, proc)
            with contextlib.suppress(OSError):  # exits wake the loop at once; without pidfds, the tick notices
                proc.pidfd = os.pidfd_open(proc.popen.pid)
                self.selector.register(proc.pidfd, selectors.EVENT_READ, (EXITED, proc))
            self.ranks.append(proc)
        self.send({"kind": "event", "event": "started", "master_port": port, "pids": [r.popen.pid for r in self.ranks]})

    def start_rank(self, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes] | ForkedProcess:
        """A rank, forked or a fresh interpreter, with ``pass_fds`` open in it at the same numbers."""
        run_dir = str(self.run_dir.path)
        if self.fork_ranks:
            from nbshard import worker

            self.close_sender()  # this process must hold one thread when it forks
            return fork_rank(lambda: worker.run_forked(run_dir), run_dir=run_dir, env=env, cwd=self.spec.cwd, keep=pass_fds)
        return subprocess.Popen(
            cold_command("nbshard.worker", run_dir), env=env, cwd=self.spec.cwd, pass_fds=pass_fds,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )

    def read_output(self, proc: Rank, fd: int, now: float) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self.to_log(proc, data)
        else:
            self.selector.unregister(fd)
            proc.open_fds.discard(fd)
        self.send_lines(proc.rank, proc.splitters[fd].feed(data, now))

    def send_open_lines(self, now: float) -> None:
        for proc in self.ranks:
            self.send_lines(proc.rank, [line for s in proc.splitters.values() if (line := s.open_line(now)) is not None])

    def send_lines(self, rank: int, lines: list[list[Any]]) -> None:
        if lines:
            self.send({"kind": "lines", "rank": rank, "lines": lines}, rank, len(lines))

    def check_exits(self) -> None:
        for proc in self.ranks:
            if not proc.running or proc.popen.poll() is None:
                continue
            proc.returncode = proc.popen.returncode
            proc.ended_at = time.time()
            signame = signal_name(-proc.returncode) if proc.returncode < 0 else None
            self.send({"kind": "event", "event": "exited", "rank": proc.rank, "exitcode": proc.returncode, "signal": signame})
            self.rank_ended(proc)

    def rank_ended(self, proc: Rank) -> None:
        """A rank of the job exited: it returned, or its failure stops the others."""
        proc.ok = proc.returncode == 0 and self.run_dir.result(proc.rank).exists()
        self.log_error(proc)
        if not proc.ok and self.stop_reason is None:
            self.first_failure = proc.rank
            self.request_stop(Status.FAILED, stacks=False, grace=FAILURE_GRACE)

    # -- stopping ---------------------------------------------------------

    def request_stop(self, reason: Status, *, stacks: bool, grace: float) -> None:
        now = time.monotonic()
        if self.stop_reason is None:
            self.stop_reason = reason
            self.send({"kind": "event", "event": "stopping", "reason": reason})
        if stacks and self.term_at == float("inf"):
            for proc in self.ranks:
                if proc.running and proc.catches(signal.SIGUSR1):  # one still starting has no stack to give
                    proc.stacks_asked = True
                    proc.signal(signal.SIGUSR1)
            self.term_at = now + STACK_DUMP_WAIT
        else:
            self.term_at = min(self.term_at, now)
        self.kill_at = min(self.kill_at, self.term_at + grace)

    def advance_stop(self, now: float) -> None:
        if now >= self.term_at:
            for proc in self.ranks:
                if proc.stacks_asked and not proc.stacks:
                    self.keep_stacks(proc)
                if proc.running and not proc.stopped:
                    proc.stopped = True
                    proc.signal(signal.SIGTERM)
        if now >= self.kill_at:
            for proc in self.ranks:
                proc.signal(signal.SIGKILL)

    def to_log(self, proc: Rank, data: bytes) -> None:
        """Append to the rank's log; a log that cannot be kept (a full disk) stops the job, since
        its output would be lost, and says why."""
        try:
            proc.log.write(data)
        except OSError as error:
            if self.storage_error is None:
                self.storage_error = f"{error.strerror} while writing {proc.log.name}"
                self.note(f"stopping the job: {self.storage_error}")
                self.request_stop(Status.FAILED, stacks=False, grace=self.spec.grace)

    def log_error(self, proc: Rank) -> None:
        """The traceback of a rank that raised, at the end of its log."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            text = read_json(self.run_dir.error(proc.rank)).get("traceback", "")
            if text:
                self.to_log(proc, f"\n[nbshard] this rank raised:\n{text}".encode())

    def keep_stacks(self, proc: Rank) -> None:
        """The stacks the rank dumped on request: for the outcome, and at the end of its log."""
        with contextlib.suppress(OSError):
            dump = self.run_dir.stacks(proc.rank).read_text(errors="replace")
            if "\n" in dump.rstrip():  # more than the header: the rank answered
                proc.stacks = dump
                self.to_log(proc, f"\n[nbshard] this rank's Python stacks when it was stopped:\n{dump.split(chr(10), 1)[1]}".encode())

    def watch_kernel(self, pid: int | None) -> int | None:
        """Learn of the kernel's death from the kernel itself, not only from the pipe: a process
        the notebook forked (a multiprocessing helper) holds the pipe's other end as well."""
        if pid is None:
            return None
        if os.getppid() != pid:  # the kernel started this launcher: another parent means it is gone
            self.kernel_gone()
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.kernel_gone()
            return None
        except OSError:  # no pidfd on this system: the pipe alone tells
            return None
        self.selector.register(pidfd, selectors.EVENT_READ, KERNEL)
        return pidfd

    def kernel_gone(self) -> None:
        """Nobody waits for this run any more: stop every rank, without stacks, quickly."""
        self.final = True
        if self.kernel_pidfd is not None:
            self.selector.unregister(self.kernel_pidfd)
            os.close(self.kernel_pidfd)
            self.kernel_pidfd = None
        self.request_stop(Status.KERNEL_GONE, stacks=False, grace=min(KERNEL_GONE_GRACE, self.spec.grace))

    def read_kernel_input(self, fd: int) -> None:
        data = os.read(fd, 64)
        if not data:  # the kernel is gone: nobody is waiting for this run
            self.selector.unregister(fd)
            self.kernel_gone()
        elif KILL in data:
            self.final = True
            self.request_stop(Status.CANCELLED, stacks=False, grace=0)
        elif CANCEL in data:
            self.final = True
            self.request_stop(Status.CANCELLED, stacks=True, grace=self.spec.grace)

    # -- the loop ---------------------------------------------------------

    def supervise(self, deadline: float) -> None:
        last_tick = 0.0
        all_ended_at: float | None = None
        while True:
            for key, _ in self.selector.select(TICK):
                if key.data is None:
                    self.read_kernel_input(key.fd)
                elif key.data is KERNEL:
                    self.kernel_gone()
                elif isinstance(key.data, tuple):
                    self.on_marked(key.fd, *key.data)
                else:
                    self.read_output(key.data, key.fd, time.time())
            now = time.monotonic()
            if self.signalled and self.stop_reason is None:
                self.request_stop(self.signalled, stacks=True, grace=self.spec.grace)
            if now >= deadline and self.stop_reason is None:
                self.request_stop(Status.TIMED_OUT, stacks=True, grace=self.spec.grace)
            if now - last_tick >= TICK:
                last_tick = now
                self.send_open_lines(time.time())
            self.check_exits()
            self.advance_stop(now)
            if all(not p.running for p in self.ranks):
                all_ended_at = all_ended_at or now
                if all(not p.open_fds for p in self.ranks) or now - all_ended_at > PIPE_DRAIN_WAIT:
                    return

    def on_marked(self, fd: int, mark: str, target: Any) -> None:
        """A marked fd is ready: (EXITED, rank) is a rank's pidfd; check_exits reaps it."""
        self.selector.unregister(fd)
        target.close_pidfd()

    def port_was_taken(self) -> bool:
        if self.first_failure != 0 or not self.run_dir.error(0).exists():
            return False
        message = read_json(self.run_dir.error(0)).get("message", "")
        return "EADDRINUSE" in message or "address already in use" in message.lower()

    def run(self) -> RunOutcome:
        timeout = self.spec.timeout
        deadline = time.monotonic() + timeout if timeout else float("inf")
        fixed_port = self.spec.master_port
        if self.stop_reason is not None:  # the kernel was gone before any rank started
            return self.outcome(fixed_port or 0)
        one_node = self.spec.nnodes == 1  # else the port is node 0's, chosen for every node
        port, restart_count, port_retries = pick_port(fixed_port) if one_node else fixed_port, self.spec.restart_count, 0
        while True:
            try:
                self.start_ranks(port, restart_count)
            except OSError as error:  # a restart would meet the same limit
                started = len(self.ranks)
                self.start_error = start_failure(error, self.spec.first_rank() + started, started, self.spec.nproc_per_node)
                self.final = True
                self.stop_started_ranks()
            self.supervise(deadline)
            if one_node and port_retries + 1 < PORT_ATTEMPTS and self.port_was_taken():
                port_retries += 1
                self.note(f"MASTER_PORT {port} was taken by another program before rank 0 could listen on it; restarting the ranks on another port")
                port = pick_port(None)
            elif self.may_restart():
                self.note(self.keep_attempt(restart_count))
                port = pick_port(fixed_port)
            else:
                return self.outcome(port)
            self.reset_for_retry()
            restart_count += 1

    def stop_started_ranks(self) -> None:
        """The job cannot run whole: SIGKILL and reap the ranks started so far, before anything
        else, so the processes a limit counts are free again when ZeroMQ needs its thread (libzmq
        aborts when it cannot start one)."""
        for proc in self.ranks:
            proc.stopped = True
            proc.signal(signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                proc.popen.wait()
        self.request_stop(Status.FAILED, stacks=False, grace=0)

    def may_restart(self) -> bool:
        """A failure (not a cancel, a timeout or a full disk) with restarts left, the kernel waiting."""
        failed = self.stop_reason is Status.FAILED or (self.stop_reason is None and not all(p.ok for p in self.ranks))
        return (
            failed and not self.final and self.storage_error is None and self.spec.nnodes == 1  # else the kernel restarts every node
            and len(self.attempts) < self.spec.max_restarts and self.kernel_alive()
        )

    def keep_attempt(self, restart_count: int) -> str:
        """Set a failed attempt's files aside, remember its cause, mark it in each rank's log;
        returns what to tell the kernel."""
        folder = attempts.set_aside(self.run_dir, (p.rank for p in self.ranks), restart_count)
        rank, why = attempts.first_cause(folder, [
            RankOutcome(p.rank, p.returncode, p.ok, p.ended_at, p.stopped) for p in self.ranks
        ])
        text = attempts.record(self.attempts, rank, why, folder, "every rank", self.spec.max_restarts, restart_count)
        for proc in self.ranks:
            self.to_log(proc, f"\n[nbshard] {text}\n".encode())
        return text

    def reset_for_retry(self) -> None:
        for proc in self.ranks:
            for fd in [*proc.open_fds, *([proc.pidfd] if proc.pidfd is not None else [])]:
                self.selector.unregister(fd)
            proc.close()
        self.ranks = []
        self.stop_reason = self.first_failure = None
        self.term_at = self.kill_at = float("inf")

    def outcome(self, port: int) -> RunOutcome:
        if self.stop_reason is None:
            status = Status.SUCCEEDED if all(p.ok for p in self.ranks) else Status.FAILED
        else:
            status = self.stop_reason
        return RunOutcome(
            status=status, storage_error=self.storage_error, start_error=self.start_error,
            first_failure=self.first_failure, master_port=port, notes=self.notes, attempts=self.attempts,
            signal_received=self.signal_received, dropped_lines=dict(self.dropped_total), lines_sent=dict(self.lines_sent),
            ranks=[
                RankOutcome(p.rank, p.returncode, p.ok, p.ended_at, p.stopped and p.rank != self.first_failure, p.stacks)
                for p in self.ranks
            ],
        )

    def kernel_alive(self) -> bool:
        if self.stop_reason is Status.KERNEL_GONE:
            return False
        if self.kernel_pidfd is None:
            return True
        return not _readable(self.kernel_pidfd)

    def close(self) -> None:
        for proc in self.ranks:
            proc.close()
        kill_leftovers()
        self.close_sender(FINAL_FLUSH if self.kernel_alive() else None)


def main(run_dir: str, *, kernel_pidfd: int | None = None, fork_ranks: bool = False) -> int:
    """Supervise the run in ``run_dir`` to its end; returns the exit code."""
    paths = RunDir(Path(run_dir))
    adopt_orphans()
    write_atomic(paths.path / "launcher.pid", str(os.getpid()).encode())
    launcher_class = Launcher
    if LaunchSpec.read(paths.launch).session:
        from nbshard.session_launcher import SessionLauncher as launcher_class  # noqa: N813 - one class or the other
    launcher = launcher_class(paths, kernel_pidfd=kernel_pidfd, fork_ranks=fork_ranks)
    try:
        outcome = launcher.run()
        try:
            outcome.write(paths.outcome)
        except OSError as error:  # the kernel learns why from the last message instead
            outcome.storage_error = outcome.storage_error or f"{error.strerror} while writing {paths.outcome}"
        # The last words may wait for a slow kernel while it lives, never long: the files hold the truth.
        wait = FINAL_FLUSH if launcher.kernel_alive() else END_SEND_WAIT
        for rank in list(launcher.dropped):
            launcher.send_dropped_notice(rank, wait=wait)
        # One node of many: the kernel's side of the nodes says when the whole run ended.
        kind = "end" if launcher.spec.nnodes == 1 else "node_end"
        launcher.send({"kind": kind, "status": outcome.status, "storage_error": outcome.storage_error}, wait=wait)
    finally:
        launcher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
