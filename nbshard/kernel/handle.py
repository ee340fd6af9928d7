"""The kernel's view of one running job: ``result``, ``done``, ``cancel``, ``logs``, ``watch``.

A background thread per job drains the job's ZMQ socket into the handle and,
once the launcher has exited, turns the run directory into the job's value or
its exception. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from nbshard.backends import NodeLauncher, WarmLauncher
from nbshard.kernel.backlog import LiveBacklog
from nbshard.kernel import interrupts, watching
from nbshard.kernel.debugging import RankDebugger
from nbshard.kernel.feed import JobFeed
from nbshard.contracts import Attempt, RunOutcome
from nbshard.errors import JobCancelled, JobError, JobInterrupted, JobTimedOut
from nbshard.files import OpenedDir, RunDirReplaced, identity, read_json
from nbshard.job import CANCEL, KILL, STACK_DUMP_WAIT, Job, check_seconds
from nbshard.run_dir import RunDir
from nbshard.kernel.outcome import collect, read_outcome
from nbshard.kernel.plots import Plot, charts_of
from nbshard.kernel.profiles import ProfileReport
from nbshard.kernel.stages import LaunchStage
from nbshard.kernel.telemetry import Telemetry, read_metrics_files, to_frame
from nbshard.wire import Receiver

__all__ = ["JobHandle", "running_jobs"]

END_MESSAGE_WAIT = 1.0  # after the launcher exits, how long its last messages may take
KILL_MARGIN = 2.0  # past the launcher's own deadline, the kernel SIGKILLs its whole group

_running: set[JobHandle] = set()
_running_lock = threading.Lock()


def _status_of(exception: JobError | None) -> str:
    if exception is None:
        return "succeeded"
    if isinstance(exception, JobTimedOut):
        return "timed out"
    return "cancelled" if isinstance(exception, JobCancelled) else "failed"


def running_jobs() -> list[JobHandle]:
    """The jobs of this kernel that are still running, oldest first."""
    with _running_lock:
        return sorted(_running, key=lambda h: h.started)


class JobHandle:
    """A submitted job: ``result()``, ``done()``, ``cancel()``, ``logs(rank)``."""

    def __init__(
        self, job: Job, world_size: int, run_dir: RunDir, launcher: NodeLauncher, receiver: Receiver,
        samples: Iterable[dict[str, Any]] = (), drain: bool = True, started: float | None = None,
    ) -> None:
        """``samples``: memory samples known before the job's own (a session's ranks hold memory
        already), shown from the start. ``drain``: a thread of the handle's own reads ``receiver``;
        without it, the owner hands each message to ``_feed.on_message`` and calls ``_finish`` (a
        session's one thread does, for call after call). ``started``: when the job was submitted
        (before its launch, during which a quick job may run whole), now by default."""
        self.job = job
        self.world_size = world_size
        """Ranks on all nodes (``job.nproc`` is ranks on each node)."""
        self.run_dir = run_dir.path
        self.status = "running"
        self._stage = LaunchStage(world_size, warm=isinstance(launcher, WarmLauncher))
        self.started = started if started is not None else time.time()
        self.ended: float | None = None
        self._paths = run_dir
        self._identity = identity(run_dir.path)  # read back only from this very directory
        self._launcher = launcher
        self._receiver = receiver
        self._live = LiveBacklog(str(run_dir.path))
        self.warm = isinstance(launcher, WarmLauncher)
        """True when the warm process forked this job's launcher and ranks."""
        self.launch_note: str | None = launcher.note
        """Why this launch is cold when a warm one was asked for (also shown with the output)."""
        if self.launch_note:
            self._live.note(self.launch_note)
        self._done = threading.Event()
        self._value: Any = None
        self._exception: JobError | None = None
        self._kill_at = float("inf")
        self._callbacks: list[Callable[[JobHandle], Any]] = []
        self._callbacks_lock = threading.Lock()
        self.notes: list[str] = []  # said by whoever owns the handle, e.g. the magic's pulls
        self.attempts: list[Attempt] = []
        """Once the job ended: each failed attempt that ``max_restarts`` started again, oldest first
        (``attempt``, the ``rank`` that failed first, the ``cause``, the ``files`` folder keeping
        its error and stack files)."""
        self._telemetry = Telemetry(world_size)
        for sample in samples:
            self._telemetry.add(sample)
        self._all_metrics: list[dict[str, Any]] | None = None  # read from disk once the job ended
        self._debugger = RankDebugger(self._answer_debugger)
        self._feed = JobFeed(run_dir, self._live, self._telemetry, self._stage, self._debugger)
        with _running_lock:
            _running.add(self)
        if drain:
            threading.Thread(target=self._drain, name=f"nbshard-{run_dir.path.name}", daemon=True).start()

    @property
    def stage(self) -> str:
        """While it runs, what it is doing: starting, loading the job (its imports), running."""
        return self._stage.text

    def __repr__(self) -> str:
        return f"<JobHandle {self.summary()}; run_dir={self.run_dir}>"

    # -- concurrent.futures verbs ------------------------------------------

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's value (every rank's with ``return_all``); raises the job's error.

        ``timeout`` only limits this wait: TimeoutError leaves the job running.
        """
        __tracebackhide__ = True  # pytest: the error is the rank's, not this wait's
        exception = self.exception(timeout)
        if exception is not None:
            raise exception.with_traceback(None)  # each raise starts afresh, not onto the last one's frames
        return self._value

    def exception(self, timeout: float | None = None) -> JobError | None:
        if not interrupts.wait(self._done, timeout):
            raise TimeoutError(f"{self.job.label} is still running after waiting {timeout} s (the job itself goes on)")
        return self._exception

    def cancel(self, wait: bool = True) -> bool:
        """Stop the job: stacks dumped, SIGTERM, ``grace`` seconds, SIGKILL.

        Returns False when it had already ended. With ``wait``, returns once
        every rank and the launcher are gone.
        """
        if self.done():
            return False
        self._launcher.request(CANCEL)
        deadline = time.monotonic() + STACK_DUMP_WAIT + self.job.grace + KILL_MARGIN
        self._kill_at = min(self._kill_at, deadline)
        if wait:
            interrupts.wait(self._done)
        return True

    def kill(self) -> None:
        """Stop the job at once with SIGKILL, without stacks or a grace period."""
        self._launcher.request(KILL)
        self._kill_at = min(self._kill_at, time.monotonic() + KILL_MARGIN)

    def logs(self, rank: int | None = None) -> str:
        """The complete output of one rank, or of every rank one after another."""
        if rank is None:
            return "\n".join(f"==> rank {r} <==\n{self.logs(r)}" for r in range(self.world_size))
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        if not self.run_dir.exists():
            raise FileNotFoundError(
                f"the logs of {self.job.label} are gone: its run directory {self.run_dir} was pruned "
                "(nbshard.settings.keep_runs keeps that many of the newest finished runs) or deleted."
            )
        path = self._paths.log(rank)
        text = path.read_bytes() if path.exists() else b""
        live_log = getattr(self._launcher, "live_log", None)  # several nodes: a node holds the attempt's log until it ends
        if live_log is not None and not self.done():
            text += live_log(rank)
        return text.decode(errors="replace")

    def stacks(self) -> dict[int, str]:
        """Each stopped rank's Python stacks (every thread), taken just before it was stopped
        by a cancel, an interrupt or a timeout; the cell shows only where each rank was."""
        failures = self._exception.failures if self._exception is not None else ()
        return {failure.rank: failure.stacks for failure in failures if failure.stacks}

    # -- live output (kernel/watching.py) ------------------------------------

    def watch(self, out: Any = None) -> None:
        """Print the ranks' output as it arrives until the job ends.

        In a notebook, a live view of each rank's memory and metrics sits above
        the output and updates in place; elsewhere the memory is printed now
        and then, and the peaks at the end. An interrupt (Ctrl-C, the notebook's
        stop button) cancels the job, shows the ranks' stacks, and re-raises
        once every rank is gone as a short ``JobInterrupted`` (a KeyboardInterrupt)
        that says where each rank was.
        """
        watching.watch(self, out or sys.stdout)

    def show_live(self, refresh: float = 0.5) -> None:
        """Show the job in one notebook output that updates in place, without blocking.

        The output stays with the cell that called this, even while other cells
        run. It shows each rank's memory (current, peak, over time), its last
        metrics and the newest lines (``logs(rank)`` has all), at most once per
        ``refresh`` seconds, and how the job ended.
        """
        check_seconds("refresh", refresh)
        watching.show_live(self, refresh)

    def _answer_debugger(self, command: bytes, stop: bool) -> None:
        """Send a debugger's answer to the launcher; ``stop``: it was a quit, which cancels the job
        (in the same write, so the launcher stops the ranks before it sees the quitting one end)."""
        if stop and not self.done():
            self._launcher.request(command + CANCEL)
            self._kill_at = min(self._kill_at, time.monotonic() + STACK_DUMP_WAIT + self.job.grace + KILL_MARGIN)
        else:
            self._launcher.request(command)

    def _interrupted(self) -> BaseException | None:
        """What an interrupt raises once the job has ended; None where the job returned all the
        same (each rank had returned, and the stop ended only exits that took long)."""
        return None if self._exception is None else JobInterrupted(self.job.label, self._exception)

    def profile(self) -> ProfileReport:
        """A job run with ``profile=True``: per rank, the operators with the most self time and
        the share of communication, and its trace file (``.traces``), once the job ended."""
        if not self.job.profile:
            raise ValueError(f"{self.job.label} was not profiled: run it with profile=True (%%shard_train --profile)")
        if not self.done():
            raise RuntimeError(f"{self.job.label} is still running: each rank writes its profile when the job ends; "
                               "wait for it (handle.result()) first")
        # On several nodes a rank writes in its node's directory, inside this run's: one walk finds all.
        wanted = {self._paths.profile(rank).name: rank for rank in range(self.world_size)}
        found = {wanted[path.name]: path for path in sorted(self.run_dir.rglob("*.json")) if path.name in wanted}
        summaries = {}
        for rank, path in found.items():
            with contextlib.suppress(OSError, ValueError):
                summaries[rank] = read_json(path)
        missing = [rank for rank in range(self.world_size) if rank not in summaries]
        return ProfileReport(self.summary(), summaries, missing)

    def plot(self) -> Plot:
        """Each rank's memory over time (anonymous or its proportional share, and GPU where it
        used one) and each ``log_metrics`` series per rank (over steps where every record has
        one, else seconds), as charts that show in the notebook; ``.save(path)`` writes them
        as an HTML file. Self-contained SVG: nothing is fetched, no plotting library needed."""
        return Plot(charts_of(self.memory(), self.metrics(), self.started), title=self.summary())

    # -- telemetry -----------------------------------------------------------

    def memory(self, frame: bool = False) -> Any:
        """Memory samples: one record per rank, time (and GPU), bytes; a DataFrame with ``frame``."""
        records = self._telemetry.memory()
        return to_frame(records) if frame else records

    def metrics(self, frame: bool = False) -> Any:
        """What ranks sent with ``nbshard.log_metrics``: records of rank, time, step and values.

        Once the job ended, every record, read from the run directory; while it runs, the
        newest ones that arrived live (up to 100,000).
        """
        if self.done() and self._all_metrics is None and self.run_dir.exists():
            self._all_metrics = read_metrics_files([self._paths.metrics(rank) for rank in range(self.world_size)])
        records = self._all_metrics if self._all_metrics is not None else self._telemetry.metrics()
        return to_frame(records) if frame else list(records)

    def peak_memory(self) -> dict[int, dict[str, int | None]]:
        """Per rank, in bytes: ``cpu_peak_rss`` (resident, file pages included: a memory-mapped
        checkpoint counts), ``cpu_peak_anon`` (anonymous: what tensors and the heap hold, the
        model's footprint: the samples', and a spike between two samples from the high-water mark
        Linux keeps of resident memory), for a warm rank ``cpu_peak_pss`` and ``cpu_peak_pss_anon``
        (pages shared with the warm process divided among their sharers), and ``gpu_peak_allocated``
        (torch) and ``gpu_peak_used`` (NVML, what the process holds on the device)."""
        return self._telemetry.peaks()

    def summary(self) -> str:
        """One line: what runs, how it stands, for how long."""
        elapsed = (self.ended or time.time()) - self.started
        doing = self.stage if self.status == "running" else self.status
        text = f"{self.job.label} on {self._where()}: {doing} after {elapsed:.0f} s"
        if self.attempts:
            text += f" (restarted {len(self.attempts)}x)"
        if self._exception is not None:
            text += f" ({str(self._exception).splitlines()[0]})"
        elif (paused := self._debugger.describe()) is not None:
            text += f"; {paused}"
        return text + "".join(f"; {note}" for note in self.notes)

    def _where(self) -> str:
        ranks = f"{self.world_size} rank{'s' * (self.world_size > 1)}"
        nodes = self.job.nnodes
        return f"{ranks} ({nodes} nodes x {self.job.nproc})" if nodes > 1 else ranks

    def add_done_callback(self, fn: Callable[[JobHandle], Any]) -> None:
        """Call ``fn(handle)`` when the job ends (at once if it has), from nbshard's thread."""
        with self._callbacks_lock:
            if not self.done():
                self._callbacks.append(fn)
                return
        fn(self)

    # -- the background thread ----------------------------------------------

    def _drain(self) -> None:
        end_seen = False
        exited_at: float | None = None
        try:
            while True:
                for message in self._receiver.receive(0.05):
                    end_seen |= self._feed.on_message(message)
                if end_seen:  # the launcher's last word: wait for its exit, not for the next tick
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._launcher.wait(END_MESSAGE_WAIT)
                now = time.monotonic()
                if self._launcher.poll() is not None:
                    exited_at = exited_at or now
                    if end_seen or now - exited_at > END_MESSAGE_WAIT:
                        # The ranks flushed their sockets before they exited, but the launcher's end
                        # can be read ahead of their last messages (a rank's final sample, its peaks).
                        until = time.monotonic() + END_MESSAGE_WAIT
                        while time.monotonic() < until and (messages := self._receiver.receive(0)):
                            for message in messages:
                                self._feed.on_message(message)
                        break
                elif now > self._kill_at:
                    self._launcher.kill()
        finally:
            self._launcher.close()  # and whatever the ranks left in the launcher's process group
            self._receiver.close()
            self._finish()

    _results_removed_later = False  # a session's call removes its result files after waking its caller
    _last_samples_in_files = True  # a session's ranks answer each call with their sample instead

    def _collect(self, files: OpenedDir, outcome: RunOutcome | None) -> tuple[Any, JobError | None]:
        """The job's value or its exception, from its run directory."""
        return collect(
            files, self._paths, outcome, world_size=self.world_size, return_all=self.job.return_all,
            timeout=self.job.timeout, launcher_exit=self._launcher.poll(), storage_error=self._feed.storage_error,
            remove_later=self._results_removed_later, sent=self._values_sent(),
        )

    def _values_sent(self) -> dict[int, bytes]:
        """Ranks' pickled values that came with the run's end rather than as files (a session's calls)."""
        return {}

    def _read_outcome(self, files: OpenedDir) -> RunOutcome | None:
        return read_outcome(files, self._paths)

    def _finish(self) -> None:
        try:
            with OpenedDir(self._paths.path, self._identity) as files:
                outcome = self._read_outcome(files)  # read once: for the drop tally and the result
                self._feed.note_unreported_drops(outcome)
                self.attempts = list(outcome.attempts) if outcome else []
                if self._last_samples_in_files:
                    self._feed.add_last_samples(files, self.world_size)
                self._value, self._exception = self._collect(files, outcome)
        except RunDirReplaced as error:
            # Its logs went with it (or are another run's): no "full log is in" pointing there.
            self._exception = JobError(f"nbshard could not read the outcome of the run: {error}")
        except Exception as error:  # noqa: BLE001 - a broken run dir must still end the handle
            self._exception = JobError(f"nbshard could not read the outcome of the run: {error!r}", run_dir=str(self.run_dir))
        self.status = _status_of(self._exception)
        self.ended = time.time()
        self._debugger.ended(f"{self.job.label} ended: " + (str(self._exception).splitlines()[0] if self._exception else "it returned"))
        with _running_lock:
            _running.discard(self)
        with self._callbacks_lock:
            self._done.set()
            self._live.wake()
            callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            self._run_callbacks(callbacks)

    def _run_callbacks(self, callbacks: list[Callable[[JobHandle], Any]]) -> None:
        for callback in callbacks:
            try:
                callback(self)
            except Exception as error:  # noqa: BLE001 - like concurrent.futures: log, go on
                print(f"nbshard: a done-callback of {self.job.label} raised {error!r}", file=sys.stderr)
