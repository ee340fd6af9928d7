"""One node's ranks, supervised: what every launcher does, whether it runs a job or a session.

``RankGroup`` starts the ranks as the launcher's children (in its process group), reads their
stdout and stderr at the file-descriptor level into one log per rank, streams the lines to the
kernel, sees each exit at once (pidfds), and stops every rank together: stacks (SIGUSR1),
SIGTERM, then SIGKILL. It watches the kernel (its stdin and its pidfd) and signals from outside.
What the ranks run, and what a rank's end or the kernel's words mean, is its ``Driver``'s: a
job's launcher or a session's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Protocol

from nbshard.contracts import LaunchSpec, RankOutcome, RunOutcome, Status
from nbshard.errors import signal_name
from nbshard.files import read_json
from nbshard.environment import rank_environment
from nbshard.job import DEBUG_FD_ENV, STACK_DUMP_WAIT
from nbshard.run_dir import RunDir
from nbshard.process.debug_relay import DEBUG, DebugRelay
from nbshard.process.forking import ForkedProcess, fork_rank
from nbshard.process.kernel_stream import KernelStream
from nbshard.process.fresh import cold_command
from nbshard.process.rank_process import Rank
from nbshard.process.reaper import kill_leftovers

__all__ = ["Driver", "RankGroup"]

TICK = 0.1  # seconds between checks of exits, deadlines and open (\r) lines
KERNEL_GONE_GRACE = 1.0
PIPE_DRAIN_WAIT = 1.0  # how long exited ranks' children may hold the pipes open
KERNEL = "kernel"  # the selector's mark for the kernel's pidfd
EXITED = "exited"  # the selector's mark for a rank's pidfd, with the rank: (EXITED, rank)


class Driver(Protocol):
    """What the ranks run, and what their events mean (a job's launcher, a session's)."""

    def start_rank(self, env: dict[str, str]) -> subprocess.Popen[bytes] | ForkedProcess: ...
    def kernel_input(self, fd: int) -> None: ...
    def rank_ended(self, proc: Rank, code: int) -> None: ...
    def marked(self, fd: int, mark: str, target: Any) -> None: ...
    def tick(self, now: float) -> None: ...
    def tag(self, message: dict[str, Any]) -> dict[str, Any]: ...


class RankGroup:
    """``kernel_pidfd``: the kernel's pidfd when a warm process forked this launcher (else the
    kernel is its parent, found by pid). ``fork_ranks``: fork the ranks from this process,
    which has torch imported, instead of starting fresh interpreters."""

    def __init__(self, run_dir: RunDir, spec: LaunchSpec, driver: Driver, *, kernel_pidfd: int | None, fork_ranks: bool) -> None:
        self.run_dir, self.spec, self.driver, self.fork_ranks = run_dir, spec, driver, fork_ranks
        self.stream = KernelStream(spec.address, run_dir.key, driver.tag, run_dir.log)
        self.selector: selectors.BaseSelector = selectors.DefaultSelector()
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
        self.ranks: list[Rank] = []
        self.debug = DebugRelay(self)
        self.kernel_pending = b""  # an unfinished command line from the kernel
        self.notes: list[str] = []
        self.stop_reason: Status | None = None
        self.first_failure: int | None = None
        self.term_at = self.kill_at = float("inf")
        self.signalled: Status | None = None
        self.signal_received: str | None = None
        self.storage_error: str | None = None  # why the run's files could not be written (a full disk)
        self.start_error: str | None = None  # why a rank could not be started (fork refused: a process limit)
        self.final = False  # cancelled, or the kernel is gone: a failure now is not restarted
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.kernel_pidfd: int | None = None
        if kernel_pidfd is not None:
            self.kernel_pidfd = kernel_pidfd
            self.selector.register(kernel_pidfd, selectors.EVENT_READ, KERNEL)
        else:
            self.kernel_pidfd = self.watch_kernel(spec.kernel_pid)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = Status.CANCELLED
        self.signal_received = signal_name(signum)  # from outside: a user, or a scheduler (scancel)
        self.final = True

    # -- messages ---------------------------------------------------------

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.stream.send({"kind": "event", "event": "note", "text": text})

    # -- ranks ------------------------------------------------------------

    def start_ranks(self, port: int, restart_count: int) -> None:
        spec = self.spec
        if self.fork_ranks:
            # Import caches are invalidated here, once, where the finders' pages are this process's
            # own: in each forked rank, touching them would copy a page per finder, milliseconds
            # before its job starts. Nothing is imported until the last rank is forked, so every
            # rank lists directories anew, as a new interpreter would.
            importlib.invalidate_caches()
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
            ours, theirs = self.debug.connect(env)
            try:
                with theirs:  # the rank's end: open in the rank only
                    proc = Rank(rank, self.driver.start_rank(env), self.run_dir.log(rank))
            except BaseException:
                ours.close()
                raise
            self.debug.started(proc, ours)
            for fd in proc.splitters:
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_READ, proc)
            with contextlib.suppress(OSError):  # exits wake the loop at once; without pidfds, the tick notices
                proc.pidfd = os.pidfd_open(proc.popen.pid)
                self.selector.register(proc.pidfd, selectors.EVENT_READ, (EXITED, proc))
            self.ranks.append(proc)
        self.stream.send({"kind": "event", "event": "started", "master_port": port, "pids": [r.popen.pid for r in self.ranks]})

    def start_process(self, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes] | ForkedProcess:
        """A rank, forked or a fresh interpreter, with ``pass_fds`` (and its debug socket) open in
        it at the same numbers."""
        run_dir = str(self.run_dir.path)
        if DEBUG_FD_ENV in env:
            pass_fds = (*pass_fds, int(env[DEBUG_FD_ENV]))
        if self.fork_ranks:
            from nbshard.process import worker

            self.stream.close()  # this process must hold one thread when it forks
            return fork_rank(
                lambda: worker.run_forked(run_dir), run_dir=run_dir, env=env, cwd=self.spec.cwd, keep=pass_fds, imports_invalidated=True,
            )
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
        splitter = proc.splitters[fd]
        self.stream.send_texts(proc.rank, now, splitter.stream, splitter.feed_texts(data, now))

    def send_open_lines(self, now: float) -> None:
        for proc in self.ranks:
            self.stream.send_lines(proc.rank, [line for s in proc.splitters.values() if (line := s.open_line(now)) is not None])

    def check_exits(self) -> None:
        for proc in self.ranks:
            code = proc.popen.poll() if proc.running else None
            if code is None:
                continue
            proc.returncode, proc.ended_at = code, time.time()
            signame = signal_name(-code) if code < 0 else None
            self.stream.send({"kind": "event", "event": "exited", "rank": proc.rank, "exitcode": code, "signal": signame})
            self.driver.rank_ended(proc, code)

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

    # -- stopping ---------------------------------------------------------

    def request_stop(self, reason: Status, *, stacks: bool, grace: float) -> None:
        now = time.monotonic()
        if self.stop_reason is None:
            self.stop_reason = reason
            self.stream.send({"kind": "event", "event": "stopping", "reason": reason})
        if stacks and self.term_at == float("inf"):
            for proc in self.ranks:  # one still starting has no stack to give
                proc.stacks_asked = proc.ask_stacks(self.run_dir.stacks(proc.rank))
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

    def keep_stacks(self, proc: Rank) -> None:
        """The stacks the rank dumped on request: for the outcome, and at the end of its log."""
        dump = proc.read_stacks(self.run_dir.stacks(proc.rank))
        if dump:  # the rank answered
            proc.stacks = dump
            self.to_log(proc, f"\n[nbshard] this rank's Python stacks when it was stopped:\n{dump.split(chr(10), 1)[1]}".encode())

    # -- the kernel ----------------------------------------------------------

    def kernel_lines(self, fd: int) -> list[str]:
        """The kernel's finished command lines on stdin (``fd`` readable); none, and the
        ranks stopped, once the kernel is gone (its end closed: nobody waits for this run)."""
        data = os.read(fd, 1 << 16)
        if not data:
            self.selector.unregister(fd)
            self.kernel_gone()
            return []
        *lines, self.kernel_pending = (self.kernel_pending + data).split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def watch_kernel(self, pid: int | None) -> int | None:
        """Learn of the kernel's death from the kernel itself, not only from stdin: a process
        the notebook forked (a multiprocessing helper) holds the kernel's end as well."""
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

    def kernel_alive(self) -> bool:
        if self.stop_reason is Status.KERNEL_GONE:
            return False
        if self.kernel_pidfd is None:
            return True
        return not select.select([self.kernel_pidfd], [], [], 0)[0]  # a pidfd is readable once its process exited

    # -- the loop ---------------------------------------------------------

    def supervise(self) -> None:
        """Until every rank has ended and its pipes are drained (or ``PIPE_DRAIN_WAIT`` passed)."""
        last_tick = 0.0
        all_ended_at: float | None = None
        while True:
            for key, _ in self.selector.select(min(TICK, self.stream.wait_for_lines())):
                if key.data is None:
                    self.driver.kernel_input(key.fd)
                elif key.data is KERNEL:
                    self.kernel_gone()
                elif isinstance(key.data, tuple) and key.data[0] == EXITED:
                    self.selector.unregister(key.fd)  # check_exits reaps it
                    key.data[1].close_pidfd()
                elif isinstance(key.data, tuple) and key.data[0] == DEBUG:
                    self.debug.readable(key.data[1])
                elif isinstance(key.data, tuple):
                    self.driver.marked(key.fd, *key.data)
                else:
                    self.read_output(key.data, key.fd, time.time())
            now = time.monotonic()
            if self.stream.wait_for_lines() == 0:
                self.stream.flush_lines()
            if self.signalled and self.stop_reason is None:
                self.request_stop(self.signalled, stacks=True, grace=self.spec.grace)
            self.driver.tick(now)
            self.debug.tick(now)
            if now - last_tick >= TICK:
                last_tick = now
                self.send_open_lines(time.time())
            self.check_exits()
            self.advance_stop(now)
            if all(not p.running for p in self.ranks):
                all_ended_at = all_ended_at or now
                if all(not p.open_fds for p in self.ranks) or now - all_ended_at > PIPE_DRAIN_WAIT:
                    return

    def reset(self) -> None:
        """Forget the ended ranks, for the next attempt."""
        for proc in self.ranks:
            for fd in [*proc.open_fds, *([proc.pidfd] if proc.pidfd is not None else [])]:
                self.selector.unregister(fd)
            self.debug.forget(proc)
            proc.close()
        self.ranks = []
        self.stop_reason = self.first_failure = None
        self.term_at = self.kill_at = float("inf")

    def close(self, linger: float) -> None:
        """Close every rank's pipes and log, kill what the ranks left behind, and flush the last
        messages for ``linger`` seconds at most while the kernel lives."""
        for proc in self.ranks:
            proc.close()
        kill_leftovers()
        self.stream.close(linger if self.kernel_alive() else None)

    def outcome(self, port: int | None) -> RunOutcome:
        if self.stop_reason is None:
            status = Status.SUCCEEDED if all(p.ok for p in self.ranks) else Status.FAILED
        else:
            status = self.stop_reason
        return RunOutcome(
            status=status, storage_error=self.storage_error, start_error=self.start_error,
            first_failure=self.first_failure, master_port=port, notes=self.notes,
            signal_received=self.signal_received, dropped_lines=dict(self.stream.dropped_total), lines_sent=dict(self.stream.lines_sent),
            ranks=[
                RankOutcome(p.rank, p.returncode, p.ok, p.ended_at, p.stopped and p.rank != self.first_failure, p.stacks)
                for p in self.ranks
            ],
        )
