"""What a session and its calls accept, checked before anything starts: a session's options
(its ranks: ``nproc``, ``gpus``, ``env``, ...), and a call's ``Job`` made of a function or a
``Job`` with the options a call takes (``timeout``, ``kwargs``, ...). Pure: it starts nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbshard.job import Job, check_seconds
from nbshard.kernel.option_names import unknown_options

__all__ = ["CALL_OPTIONS", "SESSION_OPTIONS", "call_job", "check_session_options", "one_machine_only"]

SESSION_OPTIONS = {"nproc", "gpus", "env", "cwd", "backend", "grace", "sample_interval", "master_port", "debug_ranks"}
CALL_OPTIONS = {"kwargs", "timeout", "return_all", "show_ranks", "pickle_by_value", "name"}
_NODE_BACKENDS = {"ray", "slurm"}  # a launcher per node, reached through the engine: jobs only


def one_machine_only(backend: str) -> str:
    return (
        f"a session runs its ranks on this machine, under one launcher that only this kernel talks to; "
        f"backend={backend!r} starts a launcher per node through an engine, which runs jobs, not sessions. "
        f"Run that work as a job (nbshard.run(fn, backend={backend!r}, nnodes=...)), or start the session "
        "without backend= (its ranks here)."
    )


def check_session_options(name: str, interrupt_grace: float, options: dict[str, Any]) -> None:
    unknown = set(options) - SESSION_OPTIONS
    if unknown:
        raise TypeError(f"unknown session option(s) {unknown_options(unknown, SESSION_OPTIONS)}; a session takes {', '.join(sorted(SESSION_OPTIONS))}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a session's name is a non-empty string, got {name!r}")
    check_seconds("interrupt_grace", interrupt_grace)
    if options.get("backend") in _NODE_BACKENDS:
        raise ValueError(one_machine_only(options["backend"]))


def call_job(target: Job | Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any], *, session: str, world_size: int,
             grace: float) -> Job:
    """The ``Job`` of one call of session ``session``: ``target(*args)`` on its ``world_size``
    ranks, stopped within ``grace`` seconds (the launcher's whole stop) once interrupted."""
    session_wide = set(options) & SESSION_OPTIONS
    if session_wide:
        raise TypeError(
            f"{', '.join(sorted(session_wide))}: set when the session starts (nbshard.session(...)), "
            f"not per call; a call takes {', '.join(sorted(CALL_OPTIONS))}"
        )
    if isinstance(target, Job):
        if target.profile:
            raise TypeError(
                "profile=True profiles a job's ranks from start to end; a session's calls are not profiled: "
                "run the code as a job (nbshard.run(fn, profile=True)), or use torch.profiler inside the call"
            )
        if target.max_restarts:
            raise TypeError(
                "max_restarts starts a failed job's ranks again, but a session keeps its ranks between "
                "calls: drop max_restarts here, or call session.restart() after a failure"
            )
        options = {k: getattr(target, k) for k in CALL_OPTIONS} | options
        fn, args = target.fn, target.args
    else:
        fn = target
    unknown = set(options) - CALL_OPTIONS
    if unknown:
        raise TypeError(f"unknown option(s) {unknown_options(unknown, CALL_OPTIONS)}; a call takes {', '.join(sorted(CALL_OPTIONS))}")
    label = options.pop("name", None) or getattr(fn, "__qualname__", None) or repr(fn)  # as Job.label
    return Job(fn, args, nproc=world_size, grace=grace, name=f"{label} in session {session!r}", **options)
