"""The kernel side's entry points: ``run``, ``submit``, ``jobs``, ``cancel_all``, ``settings``.

Nothing here imports torch. A job is pickled before any process starts, and
the run directory holds the truth: the job, results, errors and logs.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbshard.backends import NodeLauncher, get_backend, warm
from nbshard.backends.relay import importable_env
from nbshard.contracts import LaunchSpec
from nbshard.files import write_atomic
from nbshard.kernel.gpus import ranks_environment, visible_gpu_count, warn_if_kernel_holds_cuda
from nbshard.kernel.handle import JobHandle, running_jobs
from nbshard.kernel.interrupts import deferred_interrupts
from nbshard.environment import launch_environment
from nbshard.job import Job, check_ranks_exist
from nbshard.run_dir import RunDir
from nbshard.leftovers import process_identity
from nbshard.limits import check_can_start
from nbshard.kernel.option_names import unknown_options
from nbshard.kernel.payload import pickled_job
from nbshard.pickling import write_sources
from nbshard.kernel.runs import new_run_dir, prune_runs
from nbshard.wire import Receiver, new_key

__all__ = [
    "JobHandle", "Settings", "TooManyRanks", "cancel_all", "jobs", "restart_warm", "run", "settings", "submit", "warm_status",
]

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
    """Finished run directories kept; older ones are deleted when a job is submitted (those whose
    kernel is gone first)."""
    keep_runs_bytes: int = 1 << 30
    """Bytes the finished runs may take together; past it the oldest are deleted (those whose kernel
    is gone first), except the newest of a running kernel not yet read back."""
    warm: bool = dataclasses.field(default_factory=lambda: os.environ.get("NBSHARD_WARM", "1") != "0")
    """Fork launchers and ranks from a warm process that has imported ``preload`` (``$NBSHARD_WARM=0``
    turns it off); a launch that cannot be warm is cold and says why in one line."""
    preload: list[str] = dataclasses.field(default_factory=lambda: ["torch"])
    """Modules the warm process imports, e.g. ``["torch", "lightning"]``; changing it replaces it."""


settings = Settings()


_OPTIONS = {f.name for f in dataclasses.fields(Job)} - {"fn", "args"}


def _as_job(target: Job | Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any]) -> Job:
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown_options(unknown, _OPTIONS)}; nbshard options are "
            f"{', '.join(sorted(_OPTIONS))}. To pass keyword arguments to the function, "
            "use kwargs={...}."
        )
    if isinstance(target, Job):
        if args:
            raise TypeError("pass the function's arguments in Job(args=...), not to run()/submit() with a Job")
        return dataclasses.replace(target, **options) if options else target
    return Job(target, args, **options)


class TooManyRanks(UserWarning):
    """More ranks than this machine can run side by side."""


def _warn_if_oversubscribed(nproc: int, gpus: int) -> None:
    cpus = len(os.sched_getaffinity(0))
    if nproc > max(2 * cpus, gpus):
        warnings.warn(
            f"nproc={nproc} starts {nproc} processes on a machine with {cpus} CPUs available"
            f"{f' and {gpus} GPUs' if gpus else ' and no GPU'}: they will crowd each other (and each "
            "holds its own copy of torch in memory). Use nproc <= the number of GPUs, or a few per CPU "
            "core for CPU jobs; to use more machines, see the backends.",
            TooManyRanks, stacklevel=3,
        )


def submit(target: Job | Callable[..., Any], /, *args: Any, **options: Any) -> JobHandle:
    """Start ``target(*args)`` on ``nproc`` fresh ranks and return at once.

    ``target`` is a function (options as keywords: ``nproc=2, timeout=600``,
    the function's own keyword arguments as ``kwargs={...}``) or a ``Job``.
    """
    started = time.time()
    job = _as_job(target, args, options)
    payload = pickled_job(job)
    world_size, run_dir, launcher, receiver = launch(job, payload)
    with deferred_interrupts() as interrupts:  # the launcher runs: an interrupt waits until a handle owns it
        try:
            handle = JobHandle(job, world_size, run_dir, launcher, receiver, started=started)
        except BaseException:  # e.g. no thread could start: nobody would stop this launcher
            stop_unowned(launcher, receiver)
            raise
        if interrupts.pending:  # the stop button during the launch: nobody got this job, so it stops
            handle.cancel(wait=False)
    return handle


def stop_unowned(launcher: NodeLauncher, receiver: Receiver) -> None:
    """Stop a launcher that started but that no handle or session came to own."""
    launcher.kill()
    launcher.close()
    receiver.close()


def launch(job: Job, payload: bytes | None, **session: Any) -> tuple[int, RunDir, NodeLauncher, Receiver]:
    """Start the launcher of ``job`` (its ``payload`` written as the run's job file; ``session``:
    the session fields of the launch spec, for a session); returns (the world size, run dir,
    launcher, the socket its messages arrive on)."""
    if sys.platform != "linux":
        raise RuntimeError(
            f"nbshard runs jobs on Linux only (this is {sys.platform}): it relies on Linux "
            "process groups and /proc. Use a Linux machine or container."
        )
    start = get_backend(job.backend)
    cwd = os.fspath(job.cwd) if job.cwd is not None else os.getcwd()
    if not os.path.isdir(cwd):
        raise ValueError(f"cwd {cwd!r} is not a directory")
    home = job.env.get("PYTHONHOME")
    if home is not None and job.backend == "subprocess" and not os.path.isdir(home):
        raise ValueError(
            f"env sets PYTHONHOME to {home!r}, which is not a directory here: no Python could start with it "
            "(\"Fatal Python error: init_fs_encoding\"). Drop it from env=, or point it at a Python's prefix."
        )
    warn_if_kernel_holds_cuda()
    kernel_env = ranks_environment(os.environ)
    nproc = job.nproc or (len(job.gpus) if job.gpus else max(visible_gpu_count(kernel_env), 1))
    if job.nproc is None:  # an nproc given was checked with the job; the default is known only now
        check_ranks_exist(job, nproc * job.nnodes)
    if job.backend == "subprocess":  # every launcher and rank on this machine
        check_can_start(nproc, nproc * job.nnodes)
    _warn_if_oversubscribed(nproc, visible_gpu_count(kernel_env) if job.gpus is None else len(job.gpus))
    run_dir = new_run_dir(settings.runs_dir, job.label)
    receiver = None
    try:
        with contextlib.suppress(OSError):  # before the launcher starts, so an interrupt here leaves nothing running
            prune_runs(settings.runs_dir, keep=settings.keep_runs, keep_bytes=settings.keep_runs_bytes, spare=run_dir.path)
        key = new_key()
        write_atomic(run_dir.key, key)
        if payload is not None:
            write_atomic(run_dir.job, payload)
            write_sources(run_dir, payload)
        receiver = Receiver(key, run_dir.path)
        LaunchSpec(
            address=receiver.address, nproc_per_node=nproc, cwd=cwd, timeout=job.timeout,
            grace=job.grace, master_port=job.master_port, max_restarts=job.max_restarts, nnodes=job.nnodes,
            env=job.rank_env, gpus=None if job.gpus is None else list(job.gpus),
            backend_options=dict(job.backend_options), run_id=run_dir.path.name,
            return_all=job.return_all, sys_path=[os.path.abspath(p) for p in sys.path],
            sample_interval=job.sample_interval, profile=job.profile, kernel_pid=os.getpid(), kernel=process_identity(os.getpid()),
            **session,
        ).write(run_dir.launch)
        env = launch_environment(kernel_env, gpus=job.gpus, extra=job.rank_env)
        launcher = start(run_dir, env, cwd, preload=list(settings.preload) if settings.warm else None)
        _stop_first_at_exit()
    except BaseException as error:  # nothing started: leave no half-written run behind (a full disk, an interrupt)
        if receiver is not None:
            receiver.close()
        shutil.rmtree(run_dir.path, ignore_errors=True)
        if isinstance(error, OSError) and error.errno == errno.E2BIG:
            raise OSError(error.errno, (
                f"nbshard could not start the launcher: {error.strerror}. The environment it inherits (the kernel's "
                "and env=) is larger than Linux allows a new process. Pass large data to the function as an "
                "argument or in a file, not in environment variables (os.environ or env=)."
            )) from error
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(error.errno, (
                f"nbshard could not write the job into {settings.runs_dir}: {error.strerror}. Free space "
                "there, or set NBSHARD_RUNS_DIR (or nbshard.settings.runs_dir) to another filesystem."
            )) from error
        raise
    return nproc * job.nnodes, run_dir, launcher, receiver


def run(target: Job | Callable[..., Any], /, *args: Any, **options: Any) -> Any:
    """Run ``target(*args)`` on ``nproc`` ranks, show their output live, return rank 0's value.

    Raises ``JobFailed`` (root cause first) when a rank fails, ``JobTimedOut``
    past ``timeout=``; an interrupt stops every rank before it propagates.
    """
    __tracebackhide__ = True  # pytest: the error is the rank's, not this wait's
    handle = submit(target, *args, **options)
    handle.watch()
    return handle.result()


def jobs() -> list[JobHandle]:
    """The jobs of this kernel that are still running."""
    return running_jobs()


def cancel_all() -> list[JobHandle]:
    """Cancel every running job of this kernel; returns the handles it stopped."""
    handles = jobs()
    for handle in handles:
        handle.cancel(wait=False)
    for handle in handles:
        handle.exception()
    return handles


def warm_status() -> dict[str, Any]:
    """The warm process's state: ``none`` (before the first launch), ``starting``, ``ready``
    (its pid, start-up seconds and preloads), ``failed`` or ``exited`` (why, and its log)."""
    return warm.warm_status()


def restart_warm() -> None:
    """Start a new warm process now with ``settings.preload`` (e.g. after ``pip install``); jobs
    it already forked run on. Launches are cold until it is ready."""
    kernel_env = launch_environment(ranks_environment(os.environ), gpus=None, extra={})
    warm.restart_warm(importable_env(kernel_env), settings.preload, os.getcwd())


def _stop_at_exit() -> None:
    for handle in jobs():
        handle.kill()
    warm.close_warm()


def _stop_first_at_exit() -> None:
    """Have ``_stop_at_exit`` run before the exit handlers of what a launch imported (they run
    newest first): Ray registers ``ray.shutdown`` when it is imported, and a Ray shut down before
    the jobs on it are stopped cannot stop them, while the calls that try start a new Ray."""
    atexit.unregister(_stop_at_exit)
    atexit.register(_stop_at_exit)


atexit.register(_stop_at_exit)
