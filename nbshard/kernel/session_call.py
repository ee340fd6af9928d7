"""One call of a persistent session, as the kernel holds it: a ``JobHandle`` (``CallHandle``)
whose launcher is the session's (``CallChannel``), and how a call that did not return is told
(``call_failure``). The session's one thread hands each call its messages and ends it;
``nbshard.kernel.persistent`` owns the session."""

from __future__ import annotations

import base64
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from nbshard.contracts import RunOutcome, Status
from nbshard.errors import JobCancelled, JobError, JobFailed, JobInterrupted, JobTimedOut, RankFailure, SessionLost
from nbshard.files import OpenedDir
from nbshard.job import CANCEL, KILL, Job
from nbshard.run_dir import RunDir
from nbshard.kernel.handle import JobHandle
from nbshard.kernel.outcome import remove_results
from nbshard.kernel.telemetry import read_metrics_files

__all__ = ["CallChannel", "CallHandle", "CallsSession", "call_failure"]


class CallsSession(Protocol):
    """What a call needs of its session (``nbshard.kernel.persistent.Session``)."""

    name: str
    pid: int
    world_size: int
    warm: bool
    _names: set[str]
    _launcher: Any

    def _command(self, line: str) -> None: ...
    def _metrics_files(self) -> list[Path]: ...
    def _metrics_offsets(self) -> list[int]: ...
    def _prepare_call_dir(self) -> None: ...
    def _call_error(self, outcome: RunOutcome | None, error: JobError | None, where: str) -> JobError | None: ...


class CallChannel:
    """One call's launcher, as its JobHandle sees it: cancel and kill go to the session, and the
    call has ended (``poll``) once the session's thread saw its end."""

    note: str | None = None

    def __init__(self, session: CallsSession) -> None:
        self.pid = session.pid
        self._session = session
        self._ended = threading.Event()
        self.outcome: dict[str, Any] | None = None  # as the launcher's end message carried it
        self.values: dict[int, bytes] = {}  # rank -> its pickled value, where that message carried it

    def end(self, outcome: dict[str, Any] | None = None, values: dict[str, str] | None = None) -> None:
        if self.outcome is None and outcome is not None:
            self.outcome = outcome
            self.values = {int(rank): base64.b64decode(value) for rank, value in (values or {}).items()}
        self._ended.set()

    def poll(self) -> int | None:
        return 0 if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"call of session {self._session.name}", timeout or 0)
        return 0

    def request(self, command: bytes) -> None:
        """A job's words as the session's: a cancel interrupts the call; a debugger's answer passes."""
        for line in command.splitlines(keepends=True):
            self._session._command("kill" if line == KILL else "interrupt" if line == CANCEL else line.decode().rstrip("\n"))

    def kill(self) -> None:
        """The call did not end in time after a stop: the session goes with it."""
        self._session._launcher.kill()

    def close(self) -> None:
        pass  # the session's launcher and socket outlive its calls


class CallHandle(JobHandle):
    """One call of a session: a ``JobHandle`` whose ending speaks of the session. The session's
    thread hands it its messages and ends it (no thread of its own per call)."""

    def __init__(self, session: CallsSession, job: Job, call_dir: RunDir, channel: CallChannel, samples: Iterable[dict[str, Any]]) -> None:
        self._session = session
        self._channel = channel
        self._metrics_from = session._metrics_offsets()  # the session's files hold every call's records
        super().__init__(job, session.world_size, call_dir, channel, channel, samples, drain=False)  # type: ignore[arg-type]
        self.warm = session.warm
        self._stage.all_running()  # in ranks that are up already

    _results_removed_later = True
    _last_samples_in_files = False

    def _end(self, outcome: dict[str, Any] | None = None, values: dict[str, str] | None = None) -> None:
        """The call ended (``outcome`` and the ranks' small ``values``: as the launcher's end
        message carried them); once only."""
        if self._channel.poll() is None:
            self._channel.end(outcome, values)
            self._finish()
            # Its caller has the value already; a value that came in the message made no file.
            kept = range(self.world_size) if self.job.return_all else range(1)
            remove_results(self._paths, [rank for rank in kept if rank not in self._channel.values])
            self._session._prepare_call_dir()

    def _values_sent(self) -> dict[int, bytes]:
        return self._channel.values

    def _run_callbacks(self, callbacks: list[Callable[[JobHandle], Any]]) -> None:
        # Not on the session's thread, which ended this call: a callback may start the next call
        # and wait for it, and only that thread can end it.
        threading.Thread(target=super()._run_callbacks, args=(callbacks,), name=f"nbshard-done-{self._paths.path.name}",
                         daemon=True).start()

    def _read_outcome(self, files: OpenedDir) -> RunOutcome | None:
        if self._channel.outcome is not None:  # sent before the file is written: no need to wait for it
            return RunOutcome.from_json(self._channel.outcome)
        return super()._read_outcome(files)

    def _collect(self, files: OpenedDir, outcome: RunOutcome | None) -> tuple[Any, JobError | None]:
        value, error = super()._collect(files, outcome)
        # The call's log_metrics records, from the session's files: all are there when it ends (each
        # is written before it is sent, and before the rank answers); the wire may bring some later.
        self._all_metrics = read_metrics_files(self._session._metrics_files(), self._metrics_from)
        if files.exists(self._paths.names):
            self._session._names = set(files.read_json(self._paths.names))
        return value, self._session._call_error(outcome, error, str(self.run_dir))

    def _interrupted(self) -> BaseException | None:
        if self._exception is None or isinstance(self._exception, SessionLost):
            return self._exception  # None: the call had ended (returned) as the interrupt came
        return JobInterrupted(self.job.label, self._exception, then=f"every rank left it: session {self._session.name!r} lives on")


def call_failure(session: str, outcome: RunOutcome, failures: Sequence[RankFailure], where: str, timeout: float | None) -> JobError:
    """A call that failed, was interrupted or ran past its timeout, as its session says it: the
    session lives on, its ranks' states alike unless ``outcome.diverged``."""
    if outcome.status is Status.INTERRUPTED:
        return JobCancelled(f"The call was interrupted; every rank left it, and session {session!r} lives on.", failures, where)
    if outcome.status is Status.TIMED_OUT:
        return JobTimedOut(
            f"The call ran past its timeout of {timeout if timeout is not None else '?'} s and was interrupted; every "
            f"rank left it, and session {session!r} lives on.", failures, where,
        )
    if outcome.unsent and {f.rank for f in failures} <= set(outcome.unsent):
        return JobFailed(
            f"The call ran to its end in every rank, but the value of rank{'s' * (len(outcome.unsent) > 1)} "
            f"{', '.join(map(str, outcome.unsent))} could not be sent back; session {session!r} lives on and holds "
            "what the call did (keep the value in the session with 'global', and return what can travel).",
            failures, where,
        )
    if not outcome.diverged:
        return JobFailed(f"The call failed in every rank that ran it; session {session!r} lives on.", failures, where)
    returned = [f.rank for f in outcome.ranks if f.ok]
    return JobFailed(
        f"The call failed on rank {failures[0].rank if failures else '?'} but returned on rank"
        f"{'s' * (len(returned) > 1)} {', '.join(map(str, returned))}: the ranks' states have diverged "
        f"(a model stepped on some ranks only). Session {session!r} lives on, but "
        "session.restart() is advised before you rely on it.",
        failures, where,
    )
