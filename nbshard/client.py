"""The kernel side: ``run``, ``submit`` and the handle of a running job.

Nothing here imports torch. A job is pickled before any process starts; the
run directory holds the truth (job, results, errors, logs); a background
thread per job drains the ZMQ socket into the handle and, when the launcher
has exited, turns the run directory into the job's value or its exception.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbshard import launcher as launcher_commands
from nbshard.backends import LauncherProcess, get_backend
from nbshard.display import LinePrinter
from nbshard.errors import JobError
from nbshard.files import read_json, write_atomic, write_json
from nbshard.job import Job, RunDir, launch_environment
from nbshard.outcome import collect
from nbshard.pickling import dump_job
from nbshard.wire import Receiver, new_key

__all__ = ["JobHandle", "Settings", "cancel_all", "jobs", "run", "settings", "submit"]

END_MESSAGE_WAIT = 1.0  # after the launcher exits, how long its last messages may take
KILL_MARGIN = 2.0  # past the launcher's own deadline, the kernel SIGKILLs its whole group
LIVE_BACKLOG = 20_000  # lines kept while nobody watches; older ones are counted, not kept


def _default_runs_dir() -> Path:
    if "NBSHARD_RUNS_DIR" in os.environ:
        return Path(os.environ["NBSHARD_RUNS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nbshard" / "runs"


@dataclasses.dataclass
class Settings:
    """Kernel-wide settings: ``nbshard.settings.keep_runs = 5``."""

    runs_dir: Path = dataclasses.field(default_factory=_default_runs_dir)
    """Where run directories live (``$NBSHARD_RUNS_DIR``, else ``~/.cache/nbshard/runs``)."""
    keep_runs: int = 20
    """Finished run directories kept; older ones are deleted when a job is submitted."""


settings = Settings()
_running: set[JobHandle] = set()
_running_lock = threading.Lock()


class JobHandle:
    """A submitted job: ``result()``, ``done()``, ``cancel()``, ``logs(rank)``."""

    def __init__(self, job: Job, nproc: int, run_dir: RunDir, launcher: LauncherProcess, receiver: Receiver) -> None:
        self.job = job
        self.nproc = nproc
        self.run_dir = run_dir.path
        self.status = "running"
        self.started = time.time()
        self.ended: float | None = None
        self._paths = run_dir
        self._launcher = launcher
        self._receiver = receiver
        self._live: collections.deque[tuple[int, list[Any] | str]] = collections.deque()
        self._watching = False
        self._unshown = 0  # lines dropped from the live backlog while nobody watched
        self._reported_drops: collections.Counter[int] = collections.Counter()
        self._done = threading.Event()
        self._value: Any = None
        self._exception: JobError | None = None
        self._kill_at = float("inf")
        self._thread = threading.Thread(target=self._drain, name=f"nbshard-{run_dir.path.name}", daemon=True)
        with _running_lock:
            _running.add(self)
        self._thread.start()

    def __repr__(self) -> str:
        elapsed = (self.ended or time.time()) - self.started
        return f"<JobHandle {self.job.label} nproc={self.nproc} {self.status} {elapsed:.1f}s run_dir={self.run_dir}>"

    # -- concurrent.futures verbs ------------------------------------------

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's value (every rank's with ``return_all``); raises the job's error.

        ``timeout`` only limits this wait: TimeoutError leaves the job running.
        """
        exception = self.exception(timeout)
        if exception is not None:
            raise exception
        return self._value

    def exception(self, timeout: float | None = None) -> JobError | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.job.label} is still running after waiting {timeout} s (the job itself goes on)")
        return self._exception

    def cancel(self, wait: bool = True) -> bool:
        """Stop the job: stacks dumped, SIGTERM, ``grace`` seconds, SIGKILL.

        Returns False when it had already ended. With ``wait``, returns once
        every rank and the launcher are gone.
        """
        if self.done():
            return False
        self._launcher.request(launcher_commands.CANCEL)
        deadline = time.monotonic() + launcher_commands.STACK_DUMP_WAIT + self.job.grace + KILL_MARGIN
        self._kill_at = min(self._kill_at, deadline)
        if wait:
            self._done.wait()
        return True

    def kill(self) -> None:
        """Stop the job at once with SIGKILL, without stacks or a grace period."""
        self._launcher.request(launcher_commands.KILL)
        self._kill_at = min(self._kill_at, time.monotonic() + KILL_MARGIN)

    def logs(self, rank: int | None = None) -> str:
        """The complete output of one rank, or of every rank one after another."""
        if rank is None:
            return "\n".join(f"==> rank {r} <==\n{self.logs(r)}" for r in range(self.nproc))
        if not 0 <= rank < self.nproc:
            raise ValueError(f"rank must be in 0..{self.nproc - 1}, got {rank}")
        path = self._paths.log(rank)
        return path.read_bytes().decode(errors="replace") if path.exists() else ""

    # -- live output -------------------------------------------------------

    def watch(self, out: Any = None) -> None:
        """Print the ranks' output as it arrives until the job ends.

        An interrupt (Ctrl-C, the notebook's stop button) cancels the job,
        shows the ranks' stacks, and re-raises once every rank is gone.
        """
        out = out or sys.stdout
        printer = LinePrinter(self.job.show_ranks)
        self._watching = True
        if self._unshown:
            out.write(printer.note(f"{self._unshown} earlier lines are not shown here; handle.logs(rank) has them all"))
        try:
            while not self._done.wait(0.1):
                self._print_live(printer, out)
        except KeyboardInterrupt:
            self._print_live(printer, out, text=f"interrupted: stopping {self.job.label} (interrupt again to kill it now)")
            try:
                self.cancel(wait=False)
                while not self._done.wait(0.1):
                    self._print_live(printer, out)
            except KeyboardInterrupt:
                self.kill()
                self._done.wait()
            raise
        finally:
            self._watching = False
            self._print_live(printer, out)
            out.write(printer.close())
            out.flush()

    def _print_live(self, printer: LinePrinter, out: Any, text: str | None = None) -> None:
        chunks = []
        while self._live:
            rank, item = self._live.popleft()
            chunks.append(printer.note(item) if isinstance(item, str) else printer.line(rank, *item[1:]))
        if text:
            chunks.append(printer.note(text))
        if chunks:
            out.write("".join(chunks))
            out.flush()

    # -- the background thread ----------------------------------------------

    def _on_message(self, message: dict[str, Any]) -> bool:
        """Record one message; True for the launcher's last one."""
        kind = message.get("kind")
        if kind == "lines":
            rank = message["rank"]
            self._live.extend((rank, line) for line in message["lines"])
        elif kind == "dropped":
            self._note_dropped(message["rank"], message["count"])
        elif kind == "event" and message.get("event") == "note":
            self._live.append((-1, str(message["text"])))
        if not self._watching:
            while len(self._live) > LIVE_BACKLOG:
                self._live.popleft()
                self._unshown += 1
        return kind == "end"

    def _note_dropped(self, rank: int, count: int) -> None:
        self._reported_drops[rank] += count
        self._live.append((rank, (
            f"{count} lines of rank {rank} were not shown live because the kernel read too "
            f"slowly; the full log is {self._paths.log(rank)}"
        )))

    def _note_unreported_drops(self) -> None:
        """The launcher's final tally, in case its last notices could not reach the kernel."""
        try:
            totals = read_json(self._paths.outcome).get("dropped_lines", {})
        except (OSError, ValueError):
            return
        for rank, total in totals.items():
            missing = total - self._reported_drops[int(rank)]
            if missing > 0:
                self._note_dropped(int(rank), missing)

    def _drain(self) -> None:
        end_seen = False
        exited_at: float | None = None
        try:
            while True:
                for message in self._receiver.receive(0.05):
                    end_seen |= self._on_message(message)
                now = time.monotonic()
                if self._launcher.poll() is not None:
                    exited_at = exited_at or now
                    if end_seen or now - exited_at > END_MESSAGE_WAIT:
                        break
                elif now > self._kill_at:
                    self._launcher.kill()
        finally:
            self._launcher.kill()  # whatever the ranks left in the launcher's process group
            self._launcher.close()
            self._receiver.close()
            self._finish()

    def _finish(self) -> None:
        self._note_unreported_drops()
        try:
            self._value, self._exception = collect(
                self._paths, nproc=self.nproc, return_all=self.job.return_all,
                timeout=self.job.timeout, launcher_exit=self._launcher.poll(),
            )
        except Exception as error:  # noqa: BLE001 - a broken run dir must still end the handle
            self._exception = JobError(f"nbshard could not read the outcome of the run: {error!r}", run_dir=str(self.run_dir))
        self.status = "succeeded" if self._exception is None else type(self._exception).__name__
        self.ended = time.time()
        with _running_lock:
            _running.discard(self)
        self._done.set()


# -- module-level API -----------------------------------------------------------

_OPTIONS = {f.name for f in dataclasses.fields(Job)} - {"fn", "args"}


def _as_job(target: Job | Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any]) -> Job:
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(sorted(unknown))}; nbshard options are "
            f"{', '.join(sorted(_OPTIONS))}. To pass keyword arguments to the function, "
            "use kwargs={...}."
        )
    if isinstance(target, Job):
        if args:
            raise TypeError("pass the function's arguments in Job(args=...), not to run()/submit() with a Job")
        return dataclasses.replace(target, **options) if options else target
    return Job(target, args, **options)


def _visible_gpu_count(env: dict[str, str] | os._Environ[str]) -> int:
    """GPUs the ranks would see, counted without creating a CUDA context."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip()]
        return len(entries) if entries and entries[0].strip() != "-1" else 0
    gpus = Path("/proc/driver/nvidia/gpus")
    return sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0


def _new_run_dir(label: str) -> RunDir:
    root = settings.runs_dir
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    _prune_runs(root, settings.keep_runs)
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in label)[:40]
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{secrets.token_hex(3)}"
    path.mkdir(mode=0o700)
    return RunDir(path)


def _prune_runs(root: Path, keep: int) -> None:
    """Delete finished run directories beyond the newest ``keep``."""
    finished = sorted(
        (p for p in root.iterdir() if (p / "outcome.json").exists() or _launcher_gone(p)),
        key=lambda p: p.stat().st_mtime,
    )
    for path in finished[: max(len(finished) - keep, 0)]:
        shutil.rmtree(path, ignore_errors=True)


def _launcher_gone(path: Path) -> bool:
    try:
        os.kill(int((path / "launcher.pid").read_text()), 0)
    except (OSError, ValueError):
        return (path / "launcher.pid").exists()
    return False


def submit(target: Job | Callable[..., Any], /, *args: Any, **options: Any) -> JobHandle:
    """Start ``target(*args)`` on ``nproc`` fresh ranks and return at once.

    ``target`` is a function (options as keywords: ``nproc=2, timeout=600``,
    the function's own keyword arguments as ``kwargs={...}``) or a ``Job``.
    """
    job = _as_job(target, args, options)
    if sys.platform != "linux":
        raise RuntimeError(
            f"nbshard runs jobs on Linux only (this is {sys.platform}): it relies on Linux "
            "process groups and /proc. Use a Linux machine or container."
        )
    start = get_backend(job.backend)
    cwd = os.fspath(job.cwd) if job.cwd is not None else os.getcwd()
    if not os.path.isdir(cwd):
        raise ValueError(f"cwd {cwd!r} is not a directory")
    nproc = job.nproc or (len(job.gpus) if job.gpus else max(_visible_gpu_count(os.environ), 1))
    payload = dump_job(job.fn, job.args, dict(job.kwargs), tuple(job.pickle_by_value))
    run_dir = _new_run_dir(job.label)
    key = new_key()
    write_atomic(run_dir.key, key)
    write_atomic(run_dir.job, payload)
    receiver = Receiver(key)
    write_json(run_dir.launch, {
        "address": receiver.address, "nproc": nproc, "cwd": cwd, "timeout": job.timeout,
        "grace": job.grace, "master_port": job.master_port, "run_id": run_dir.path.name,
        "return_all": job.return_all, "sys_path": [os.path.abspath(p) for p in sys.path],
    })
    try:
        launcher = start(run_dir, launch_environment(os.environ, gpus=job.gpus, extra=job.env), cwd)
    except BaseException:
        receiver.close()
        raise
    return JobHandle(job, nproc, run_dir, launcher, receiver)


def run(target: Job | Callable[..., Any], /, *args: Any, **options: Any) -> Any:
    """Run ``target(*args)`` on ``nproc`` ranks, show their output live, return rank 0's value.

    Raises ``JobFailed`` (root cause first) when a rank fails, ``JobTimedOut``
    past ``timeout=``; an interrupt stops every rank before it propagates.
    """
    handle = submit(target, *args, **options)
    handle.watch()
    return handle.result()


def jobs() -> list[JobHandle]:
    """The jobs of this kernel that are still running."""
    with _running_lock:
        return sorted(_running, key=lambda h: h.started)


def cancel_all() -> list[JobHandle]:
    """Cancel every running job of this kernel; returns the handles it stopped."""
    handles = jobs()
    for handle in handles:
        handle.cancel(wait=False)
    for handle in handles:
        handle.exception()
    return handles


def _stop_at_exit() -> None:
    for handle in jobs():
        handle.kill()


atexit.register(_stop_at_exit)
