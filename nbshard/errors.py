"""How a run can fail, described for a person; pure.

A rank's exception arrives as a JSON error file holding its frames, not only its text
(``RankFailure``); ``nbshard.kernel.remote`` rebuilds it in the kernel as a real exception
with a real traceback.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import resource
import signal
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nbshard.stacks import BETWEEN_CALLS, EXITING, STARTING, where_stopped

__all__ = [
    "PACKAGE_DIR",
    "how_it_ended",
    "JobCancelled",
    "JobError",
    "JobFailed",
    "JobInterrupted",
    "JobTimedOut",
    "RankFailure",
    "SessionLost",
    "likely_cause",
    "script_excepthook",
    "short_traceback",
    "signal_name",
]

_SIGNAL_CAUSES = {
    "SIGKILL": "likely out of memory (the Linux OOM killer sends SIGKILL; check `dmesg`), "
    "or it was killed from outside",
    "SIGSEGV": "a crash in native code (a CUDA/NCCL kernel, a C extension)",
    "SIGABRT": "native code aborted (an uncaught C++ exception or a failed CUDA/NCCL check)",
    "SIGBUS": "shared memory ran out (often /dev/shm too small for DataLoader workers)",
    "SIGTERM": "it was asked to stop from outside (a scheduler, a user)",
    "SIGINT": "it was interrupted",
}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def start_failure(error: OSError, rank: int, started: int, nproc: int) -> str:
    """Why the launcher could not start ``rank`` (``started`` of the ``nproc`` ranks of its
    node were running), with the likely cause and what to do."""
    what = f"nbshard could not start rank {rank} ({started} of the {nproc} ranks on this node had started): {error.strerror or error}"
    if error.errno == errno.EAGAIN:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        container = _pids_max()
        where = f"this container's (cgroup pids.max: {container})" if container else "the system's"
        return (
            f"{what} (EAGAIN). Likely cause: a limit on processes was reached, threads included: this "
            f"user's (ulimit -u: {limit}) or {where}. Run fewer ranks (nproc=), end other processes, or "
            "raise the limit."
        )
    if error.errno == errno.ENOMEM:
        return f"{what} (ENOMEM). Likely cause: the machine is out of memory. Run fewer ranks (nproc=) or free memory."
    return f"{what}. Look at the launcher's log in the run directory for more."


def _pids_max() -> str | None:
    """The process limit of this process's cgroup (a container's), or None where there is none."""
    try:
        with open("/proc/self/cgroup") as groups:
            for line in groups:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers in ("pids", ""):
                    base = "/sys/fs/cgroup/pids" if controllers == "pids" else "/sys/fs/cgroup"
                    with open(f"{base}{path.rstrip('/')}/pids.max") as limit:
                        value = limit.read().strip()
                    if value != "max":
                        return value
    except (OSError, ValueError):
        pass
    return None


def likely_cause(signame: str) -> str:
    return _SIGNAL_CAUSES.get(signame, "it was stopped by a signal")


def how_it_ended(code: int, cause: bool = False) -> str:
    """A process's exit code (negative: the signal that killed it) in words, with the signal's
    likely cause where ``cause``: \"exited with code 1\", \"was killed by SIGKILL (...)\"."""
    if code >= 0:
        return f"exited with code {code}"
    signame = signal_name(-code)
    return f"was killed by {signame} ({likely_cause(signame)})" if cause else f"was killed by {signame}"


MESSAGE_SHOWN = 2000  # characters of a rank's error message in a job's summary, which names every failed rank


def _shortened(message: str) -> str:
    if len(message) <= MESSAGE_SHOWN:
        return message
    return f"{message[:MESSAGE_SHOWN]}... ({len(message) - MESSAGE_SHOWN:,} characters more: the whole message ends the rank's traceback)"


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """Why one rank did not return a value."""

    rank: int
    time: float
    """When it failed (the rank's clock for exceptions, the launcher's for exits)."""
    exitcode: int | None = None
    signal: str | None = None
    exc_type: str | None = None
    """Qualified name of the exception the user's code raised, e.g. ``builtins.ValueError``."""
    message: str = ""
    frames: tuple[dict[str, Any], ...] = ()
    """``{"filename", "lineno", "name"}`` per frame, innermost last."""
    traceback: str = ""
    stopped: bool = False
    """True when nbshard stopped this rank (after another failed, on timeout or cancel)."""
    stacks: str = ""
    """The rank's Python stacks (faulthandler) taken just before it was stopped."""
    notes: tuple[str, ...] = ()
    """The exception's notes, and nbshard's hint when it knows the likely cause."""
    lost: str = ""
    """Why the node that ran this rank was lost (its machine, its launcher or its engine's
    worker gone), when that is what ended the rank."""
    pickled: str = ""
    """The exception itself, pickled by value in the rank (base64), when it could be."""
    pickle_problem: str = ""
    """Why it could not be, when it could not."""

    def describe(self) -> str:
        if self.lost:
            return f"rank {self.rank}: {self.lost}"
        if self.exc_type is not None:
            raised = f"rank {self.rank} raised {self.exc_type.removeprefix('builtins.')}: {_shortened(self.message)}"
            return "\n    ".join([raised, *self.notes])
        if self.stopped:
            where = where_stopped(self.stacks)
            if where in ([STARTING], [BETWEEN_CALLS]) or where[:1] and where[0].startswith(EXITING):
                return "\n    ".join([f"rank {self.rank} was stopped by nbshard {where[0]}", *where[1:]])
            return "\n    ".join([f"rank {self.rank} was stopped by nbshard{' at:' if where else ''}", *where])
        if self.signal is not None:
            return f"rank {self.rank} was killed by {self.signal}: {likely_cause(self.signal)}"
        if self.exitcode == 0:
            return (
                f"rank {self.rank} exited with code 0 without returning: the code called "
                "os._exit() (or exited from a thread) before the function returned"
            )
        return (
            f"rank {self.rank} exited with code {self.exitcode} before returning: "
            "the code called os._exit() or native code exited the process"
        )

    @classmethod
    def from_error_file(cls, data: dict[str, Any]) -> RankFailure:
        return cls(
            rank=int(data["rank"]),
            time=float(data["time"]),
            exc_type=str(data["exc_type"]),
            message=str(data["message"]),
            frames=tuple(data.get("frames", ())),
            traceback=str(data.get("traceback", "")),
            notes=tuple(map(str, data.get("notes", ()))),
            pickled=str(data.get("pickled", "")),
            pickle_problem=str(data.get("pickle_problem", "")),
        )


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # nbshard's own code, every side's


def _without_package_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without nbshard's own frames (they only waited for the ranks)."""
    kept = [entry for entry in _entries(tb) if not entry.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR)]
    for entry, after in zip(kept, [*kept[1:], None]):
        entry.tb_next = after
    return kept[0] if kept else None


def _entries(tb: types.TracebackType | None) -> Iterator[types.TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


def script_excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``sys.excepthook`` for plain Python scripts: a job's error is printed with the script's
    frames and the rank's, without nbshard's, then by the hook it replaced. (IPython renders
    ``_render_traceback_``; pytest honours ``__tracebackhide__``.)"""

    def hook(cls: type[BaseException], error: BaseException, tb: types.TracebackType | None) -> None:
        if isinstance(error, (JobError, JobInterrupted)):
            tb = _without_package_frames(tb)
            error.__traceback__ = tb
        previous(cls, error, tb)

    hook.replaced = previous  # type: ignore[attr-defined]
    return hook


def short_traceback(error: BaseException) -> list[str]:
    """An error as IPython shows it in one line, ``Name: message`` with the name in red,
    for errors whose frames (nbshard waiting) would say nothing to a person."""
    return [f"\x1b[0;31m{type(error).__name__}\x1b[0m: {error}"]


def _ipython_traceback(error: BaseException) -> list[str]:
    """``error``'s traceback as IPython formats one raised in a cell (colours, cell names)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or error.__traceback__ is None:
        return []
    try:
        # tb_offset=0: the shell's formatter skips its own first frame unless told (IPython 8),
        # and every frame here is the rank's.
        return list(shell.InteractiveTB.structured_traceback(type(error), error, error.__traceback__, tb_offset=0))
    except Exception:  # noqa: BLE001 - an IPython that formats differently: the summary still shows
        return []


class JobError(Exception):
    """A job ended without its result: a summary, then each rank that did not return.

    ``failures`` lists those ranks, the earliest failure (the root cause)
    first; ``run_dir`` holds each rank's complete log.
    """

    def __init__(self, summary: str, failures: Sequence[RankFailure] = (), run_dir: str = "") -> None:
        self.summary = summary
        self.failures = tuple(failures)
        self.run_dir = run_dir
        super().__init__(summary, self.failures, run_dir)

    def __str__(self) -> str:
        lines = [self.summary, *("  " + failure.describe() for failure in self.failures)]
        if self.run_dir:
            stacks = ", its stacks at the end," if any(f.stacks for f in self.failures) else ""
            lines.append(f"Each rank's full log{stacks} is in {self.run_dir} (handle.logs(rank)).")
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.summary, self.failures, self.run_dir))

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the root cause's traceback as if the cell had failed
        locally, then this summary; none of nbshard's own frames (they only waited)."""
        cause = self.__cause__
        shown = _ipython_traceback(cause) if cause is not None else []
        return [*shown, *([""] if shown else []), *short_traceback(self)]


class JobFailed(JobError):
    """A rank raised, was killed or exited early; the root cause comes first."""


class JobTimedOut(JobFailed):
    """The job ran past its ``timeout=`` and was stopped."""


class SessionLost(JobFailed):
    """A persistent session's ranks were stopped (a rank died, a call could not be left, the
    ranks' collectives no longer agree); ``session.restart()`` starts new ones."""


class JobCancelled(JobError, concurrent.futures.CancelledError):
    """The job was cancelled (``handle.cancel()``, an interrupt, ``nbshard.cancel_all()``).

    Also a ``concurrent.futures.CancelledError``, as a cancelled future's result raises.
    """


class JobInterrupted(KeyboardInterrupt):
    """An interrupt (Ctrl-C, the notebook's stop button) stopped the job being waited for.

    A ``KeyboardInterrupt``, so the interrupt still ends the cell or script;
    ``cancelled`` is the job's ``JobCancelled``, with where each rank was.
    """

    def __init__(self, label: str, cancelled: JobError | None, then: str = "its ranks were stopped") -> None:
        self.cancelled = cancelled
        where = str(cancelled).split("\n", 1)[1:] if cancelled is not None else []
        super().__init__("\n".join([f"{label} was interrupted, and {then}.", *where]))

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {self}"]  # what a person pressed for
