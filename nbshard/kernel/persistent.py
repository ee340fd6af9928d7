"""Persistent sessions: ranks that start once and run call after call (``nbshard.session``).

A session is a launcher whose ranks stay up. Each call is sent with its hash on the
launcher's stdin (a socket pair: only the kernel holds the other end, and the launcher
answers each call's end on it): its job inside the line when small (``INLINE_MAX``), else as
a file in ``calls/N`` of the session's private run directory, where the call's logs, errors
and outcome are kept (a small value comes back in the launcher's answer, a large one as a
result file there). A call is waited for with a ``JobHandle`` like any job: live lines,
memory, results and tracebacks are the job's. Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbshard.backends import WarmLauncher
from nbshard.contracts import RunOutcome, Status
from nbshard.kernel.debugging import PostMortem
from nbshard.kernel.display import render_html
from nbshard.errors import JobError, SessionLost, how_it_ended
from nbshard.files import mkdir_private, open_private
from nbshard.kernel.handle import JobHandle
from nbshard.kernel.interrupts import deferred_interrupts
from nbshard.kernel.session_call import CallChannel, CallHandle, call_failure
from nbshard.kernel.session_options import call_job, check_session_options, one_machine_only
from nbshard.kernel.plots import Plot, charts_of
from nbshard.job import POST_MORTEM, Job
from nbshard.run_dir import RunDir
from nbshard.kernel.payload import pickled_job
from nbshard.pickling import write_sources
from nbshard.kernel.telemetry import Telemetry

__all__ = ["Session", "SessionBusy", "session", "sessions"]

DEFAULT_INTERRUPT_GRACE = 5.0  # seconds every rank has to leave an interrupted call
INLINE_MAX = 16 * 1024  # bytes: a call's job up to this size travels in its line (the ranks' pipes hold 64 KiB)
CLOSE_MARGIN = 5.0  # past the launcher's own stop deadlines, close() SIGKILLs its process group

_sessions: dict[str, Session] = {}
_sessions_lock = threading.Lock()


class SessionBusy(RuntimeError):
    """A call was started while the session still runs another."""


class Session:
    """Ranks that stay up between calls, each keeping its own namespace.

    ``run(fn, *args)`` runs ``fn`` in every rank like ``nbshard.run`` and returns
    rank 0's value; names a function reads that the session holds are the
    session's (the ranks' ``model``, not the notebook's); what it binds with
    ``global`` stays. ``restart()`` starts new ranks, ``close()`` frees them.
    """

    def __init__(self, name: str, options: dict[str, Any], interrupt_grace: float) -> None:
        self.name = name
        self.interrupt_grace = interrupt_grace
        self._options = options
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        from nbshard.kernel.client import launch, stop_unowned  # the client imports this module

        placeholder = Job(print, name=f"session-{self.name}", **self._options)
        self.world_size, self._paths, self._launcher, self._receiver = launch(
            placeholder, None, session=True, interrupt_grace=self.interrupt_grace
        )
        self.run_dir = self._paths.path
        with deferred_interrupts() as interrupts:  # the launcher runs: an interrupt waits until this session owns it
            try:
                if not hasattr(self._launcher, "pid"):  # a registered backend that starts node launchers
                    raise ValueError(one_machine_only(self._options.get("backend", "?")))
                self._take_over(self._launcher.pid)
            except BaseException:
                stop_unowned(self._launcher, self._receiver)
                raise
            if interrupts.pending:  # the stop button while the session started: it goes, as its cell does
                self._launcher.kill()

    def _take_over(self, pid: int) -> None:
        """Hold the started launcher (``pid``): the session's state, and its thread."""
        mkdir_private(self.run_dir / "calls", exist_ok=True)
        self.pid = pid
        self.warm = isinstance(self._launcher, WarmLauncher)
        self.launch_note = self._launcher.note
        self.state = "running"  # "diverged", "lost" or "closed" later
        self.started = time.time()
        self.lost: SessionLost | None = None
        self._names: set[str] = set()
        self._sources_sent: dict[str, str] = {}  # the notebook cells these ranks hold, by file name
        self._telemetry = Telemetry(self.world_size)
        self._last_samples: dict[int, dict[str, Any]] = {}
        self._current: CallHandle | None = None
        self._post_mortem: PostMortem | None = None
        self._numbers = itertools.count(1)
        self._ready_dir: RunDir | None = None  # the next call's folder, made ahead
        self._metrics_paths = [self._paths.metrics(rank) for rank in range(self.world_size)]
        self._channel = getattr(self._launcher, "channel", None)  # this kernel's own end of the launcher's stdin
        if self._channel is not None:
            self._command("replies")  # each call's end comes back on it: a hop shorter than the wire
        self._thread = threading.Thread(target=self._dispatch, name=f"nbshard-session-{self.name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<Session {self.summary()}; run_dir={self.run_dir}>"

    def summary(self) -> str:
        return f"session {self.name!r} on {self.world_size} rank{'s' * (self.world_size > 1)}: {self.state}"

    def _repr_html_(self) -> str:
        return render_html(self.summary(), self._telemetry.views(gone=self.state in ("closed", "lost")), "")

    def plot(self) -> Plot:
        """Each rank's memory and every ``log_metrics`` series since the session started (all its
        calls), drawn as ``handle.plot()`` draws a job's."""
        return Plot(charts_of(self._telemetry.memory(), self._telemetry.metrics(), self.started), title=self.summary())

    @property
    def names(self) -> set[str]:
        """The names rank 0's namespace held after the last call."""
        return set(self._names)

    # -- calls ------------------------------------------------------------------

    def submit(self, target: Job | Callable[..., Any], /, *args: Any, **options: Any) -> JobHandle:
        """Start ``target(*args)`` in every rank and return its handle at once (one call at a time)."""
        grace = self.interrupt_grace + self._options.get("grace", 2.0) + 2.0  # the launcher's whole stop
        job = call_job(target, args, options, session=self.name, world_size=self.world_size, grace=grace)
        payload = pickled_job(job)
        handle: CallHandle | None = None
        try:
            with deferred_interrupts():  # a call sent is one its caller holds, never one nobody can stop
                handle = self._send_call(job, payload)
                return handle
        except KeyboardInterrupt:
            if handle is not None:  # the stop button as the call started: it is interrupted and waited for
                handle.cancel()
            raise

    def _send_call(self, job: Job, payload: bytes) -> CallHandle:
        with self._lock:
            self._check_usable()
            if self._current is not None and not self._current.done():
                raise SessionBusy(
                    f"{self._current.job.label} is still running, and a session runs one call at a time. "
                    "Wait for it (handle.result()) or interrupt it (handle.cancel())."
                )
            call_dir, self._ready_dir = self._ready_dir or self._new_call_dir(), None
            call = call_dir.path.name
            inline = ""
            if len(payload) <= INLINE_MAX:  # no file to make now and read in each rank: a call's common case
                inline = " " + base64.b64encode(payload).decode()
            else:
                with open_private(call_dir.job, "xb") as job_file:  # not renamed into place: the rank checks its digest
                    job_file.write(payload)
            write_sources(call_dir, payload, self._sources_sent)  # each rank keeps the cells it was sent
            channel = CallChannel(self)
            # The memory the session holds shows from the call's start, before the call's first sample.
            self._current = CallHandle(self, job, call_dir, channel, list(self._last_samples.values()))
            digest = hashlib.sha256(payload).hexdigest()
            self._command(f"run {call} {digest} {job.timeout or 0} {int(job.return_all)}{inline}")
            return self._current

    def debug(self, rank: int | None = None) -> None:
        """pdb at the error of the last call, in ``rank`` (the first that raised by default): the
        rank kept its traceback, so its locals can be read, expressions run and frames walked
        (``up``, ``where``). ``c`` or ``q`` leaves; the session is ready again."""
        with self._lock:
            self._check_usable()
            current = self._current
            if current is not None and not current.done():
                raise SessionBusy(f"{current.job.label} is still running; debug the last error once it ended")
            raised = [f.rank for f in (current._exception.failures if current and current._exception else ()) if f.exc_type]
            if not raised:
                raise ValueError(f"session {self.name!r}: its last call raised nowhere, so no rank kept an error to debug")
            if rank is None:
                rank = raised[0]
            elif rank not in raised:
                raise ValueError(f"rank {rank} did not raise in the last call of session {self.name!r}; ranks that did: {raised}")
            self._post_mortem = PostMortem(rank, self._launcher.request)
            self._command(f"{POST_MORTEM} {rank}")
        try:
            self._post_mortem.serve(_write_out, lambda: self._launcher.poll() is not None)
        finally:
            found, self._post_mortem = self._post_mortem.found, None
        if found is False:
            raise ValueError(f"rank {rank} of session {self.name!r} kept no traceback of the last call (it failed in nbshard's own frames)")

    def _new_call_dir(self) -> RunDir:
        call_dir = RunDir(self.run_dir / "calls" / f"{next(self._numbers):04d}")
        os.mkdir(call_dir.path, 0o700)  # in calls/, made with the session
        return call_dir

    def _prepare_call_dir(self) -> None:
        """The next call's folder, made once a call ended rather than when the next one starts."""
        with self._lock:
            if self._ready_dir is None and self.state != "closed":
                with contextlib.suppress(OSError):  # the next call makes it, and says why it cannot
                    self._ready_dir = self._new_call_dir()

    def _metrics_files(self) -> list[Path]:
        return self._metrics_paths

    def _metrics_offsets(self) -> list[int]:
        """How far each rank's metrics file goes now: where the next call's records start."""
        offsets = []
        for path in self._metrics_files():
            try:
                offsets.append(path.stat().st_size)
            except OSError:
                offsets.append(0)
        return offsets

    def run(self, target: Job | Callable[..., Any], /, *args: Any, **options: Any) -> Any:
        """Run ``target(*args)`` in every rank, show the output live, return rank 0's value."""
        handle = self.submit(target, *args, **options)
        handle.watch()
        return handle.result()

    def _check_usable(self) -> None:
        if self.lost is not None:
            raise self.lost
        if self.state == "closed":
            raise RuntimeError(f"session {self.name!r} is closed; session.restart() starts its ranks again")

    def _command(self, line: str) -> None:
        if line:
            self._launcher.request(f"{line}\n".encode())

    def _call_error(self, outcome: RunOutcome | None, error: JobError | None, where: str) -> JobError | None:
        """The call's exception as a session sees it; marks the session diverged or lost."""
        status = outcome.status if outcome else Status.LOST
        if status is Status.SUCCEEDED:
            return error  # None, or a result the kernel could not load
        failures = error.failures if error is not None else ()
        new: JobError
        if outcome is not None and status in (Status.FAILED, Status.INTERRUPTED, Status.TIMED_OUT):
            new = call_failure(self.name, outcome, failures, where, self._current.job.timeout if self._current else None)
            if status is Status.FAILED and outcome.diverged:
                self.state = "diverged"
        else:
            new = self._lose((outcome.reason if outcome else None) or self._launcher_reason() or "its launcher ended", failures, where)
        new.__cause__ = error.__cause__ if error is not None else None
        return new

    def _lose(self, reason: str, failures: Any = (), where: str = "") -> SessionLost:
        if self.lost is None:
            self.state = "lost"
            self.lost = SessionLost(
                f"Session {self.name!r} is lost: {reason}. Its ranks were stopped, and what they held is gone. "
                "session.restart() (or %shard_session NAME --restart) starts new ranks; then load the model again.",
                failures, where or str(self.run_dir),
            )
        return self.lost

    def _launcher_reason(self) -> str | None:
        """Why the launcher ended: its own word (the outcome's reason), else how it exited."""
        outcome = RunOutcome.read(self._paths.outcome)
        if outcome is not None and outcome.reason:
            return outcome.reason
        code = self._launcher.poll()
        if code is None or outcome is not None:  # still up, or it ended as it meant to
            return None
        return f"its launcher {how_it_ended(code, cause=True)} before it could stop the ranks itself; its own log is {self._paths.launcher_log}"

    # -- the session's thread ---------------------------------------------------

    def _dispatch(self) -> None:
        """Hand the session's messages to the call they belong to, and end each call, until the
        launcher ends."""
        try:
            while self._launcher.poll() is None:
                channel = self._channel
                for message in self._receiver.receive(0.005 if channel and channel.waiting() else 0.05,
                                                      also=channel.fileno() if channel else None):
                    self._route(message)
                for message in channel.replies(self._receiver.seen) if channel else ():
                    self._route(message)
                current = self._current
                if current is not None and not current.done():
                    if current._paths.outcome.exists() and not self._end_on_channel():
                        current._end()  # its end message is late, or lost
                    elif time.monotonic() > current._kill_at:
                        current._launcher.kill()  # a stop that did not end the call in time
        finally:
            for message in self._receiver.receive(0.05):
                self._route(message)
            for message in self._channel.replies(lambda sender: float("inf")) if self._channel else ():
                self._route(message)
            if self.state != "closed":
                self._lose(self._launcher_reason() or "its launcher ended")
            self._launcher.close()
            self._receiver.close()
            if self._current is not None:
                self._current._end()

    def _end_on_channel(self) -> bool:
        """Whether the channel brought the current call's end, or holds it until the wire's lines
        before it arrived. The launcher answers before it writes the outcome file, so once that
        file is there, the answer is read here: the file never ends a call ahead of its lines."""
        if self._channel is None:
            return False
        for message in self._channel.replies(self._receiver.seen):
            self._route(message)
        return self._current is None or self._current.done() or self._channel.waiting()

    def _route(self, message: dict[str, Any]) -> None:
        kind, call, current = message.get("kind"), message.get("call"), self._current
        running = current is not None and not current.done()
        if kind in ("sample", "metrics"):
            self._telemetry.add(message)
            if kind == "sample":
                self._last_samples[message["rank"]] = message
            if running:
                current._feed.on_message(message)  # type: ignore[union-attr]
        elif running and call == current._paths.path.name:  # type: ignore[union-attr]
            for sample in message.get("samples", ()) if kind == "end" else ():  # what each rank holds after the call
                self._route(sample)
            if current._feed.on_message(message):  # type: ignore[union-attr]
                current._end(message.get("outcome"), message.get("values"))  # type: ignore[union-attr]
        elif (kind == "debug" or message.get("event") == POST_MORTEM) and self._post_mortem is not None:
            self._post_mortem.arrived(message)
        elif kind == "lines":
            self._telemetry.last_line(message["rank"], message["text"].rpartition("\n")[2])

    # -- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        """Stop the ranks and free what they hold: a running call is interrupted first. The stop
        button during a close cuts its waits short, never the close: the ranks are then killed."""
        try:
            current = self._current
            if current is not None and not current.done():
                current.cancel()
            if self.state not in ("lost", "closed"):
                self.state = "closed"
                self._command("close")
                self._thread.join(self.interrupt_grace + self._options.get("grace", 2.0) + CLOSE_MARGIN)
        finally:
            with deferred_interrupts():  # the close itself; the wait below stays interruptible
                if self.state != "lost":
                    self.state = "closed"
                self._launcher.kill()
                with _sessions_lock:
                    if _sessions.get(self.name) is self:
                        del _sessions[self.name]
        self._thread.join()  # it ends with the launcher

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``with nbshard.session(...) as s:`` closes it at the block's end, as after an error."""
        self.close()

    def restart(self) -> None:
        """New ranks with the same options; what the old ones held is gone."""
        self.close()
        self._start()
        with _sessions_lock:
            _sessions[self.name] = self


def session(name: str = "default", *, interrupt_grace: float = DEFAULT_INTERRUPT_GRACE, **options: Any) -> Session:
    """The session ``name``, started with ``options`` (``nproc``, ``gpus``, ``env``, ``cwd``, ...,
    as for ``nbshard.run``) unless this kernel has it already (a lost one stays lost until its
    ``restart()`` or ``close()``); ``interrupt_grace``: seconds each rank has to leave an
    interrupted call before the session is lost."""
    check_session_options(name, interrupt_grace, options)
    with _sessions_lock:
        existing = _sessions.get(name)
        if existing is not None and existing.state == "closed":  # a close the stop button cut short
            existing._launcher.kill()
            del _sessions[name]
            existing = None
        if existing is not None:  # running, diverged or lost: lost stays lost until restart() or close()
            asked = {k: v for k, v in options.items() if v is not None}
            differs = {k for k, v in asked.items() if existing._options.get(k) != v}
            if differs:
                raise ValueError(
                    f"session {name!r} is running with other {', '.join(sorted(differs))}; close it first "
                    f"(nbshard.session({name!r}).close()) or pick another name"
                )
            return existing
        created = Session(name, {k: v for k, v in options.items() if v is not None}, float(interrupt_grace))
        _sessions[name] = created
        return created


def sessions() -> list[Session]:
    """This kernel's sessions that are not closed (``state``: running, diverged or lost)."""
    with _sessions_lock:
        return [s for s in _sessions.values() if s.state != "closed"]


def _close_all() -> None:
    with _sessions_lock:
        held = list(_sessions.values())  # a close cut short included
    for open_session in held:
        open_session._launcher.kill()  # the kernel is exiting: no grace, the ranks go with it


atexit.register(_close_all)


def _write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
