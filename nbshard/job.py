"""The job spec and its checks (``nbshard.run_dir``: the run directory's layout;
``nbshard.environment``: what each rank's environment holds).

Pure: nothing here starts a process or reads the machine, so every check of a
job (a bad option, a rank it names that will not exist) is a function a test
can call and compare.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbshard.environment import TORCHRUN_VARIABLES

__all__ = [
    "CANCEL",
    "DEBUG_FD_ENV",
    "DEBUG_RANKS_ENV",
    "KILL",
    "POST_MORTEM",
    "STACK_DUMP_WAIT",
    "Job",
    "check_count",
    "check_ranks_exist",
    "check_seconds",
]

# The kernel's words to a launcher (lines on its stdin: these, a session's commands, and
# ``debug RANK {json}``, an answer to a rank's debugger), and how long ranks get to dump their
# stacks when stopped. Here, not in launcher.py, so the kernel never imports the launcher module
# (``python -m nbshard.launcher`` would then run a second copy of it).
CANCEL, KILL = b"cancel\n", b"kill\n"
DEBUG_FD_ENV = "NBSHARD_DEBUG_FD"  # a rank's end of its debug socket to the launcher
DEBUG_RANKS_ENV = "NBSHARD_DEBUG_RANKS"  # the ranks where breakpoint() stops ("1", "0,2"); all when unset
POST_MORTEM = "postmortem"  # a session's command (``postmortem RANK``): pdb at that rank's last failed call
STACK_DUMP_WAIT = 0.5

@dataclasses.dataclass(frozen=True)
class Job:
    """What to run and how: a function, its arguments and the launch options.

    ``fn(*args, **kwargs)`` runs once in each of ``nproc`` fresh processes
    that look exactly like torchrun's workers.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    nproc: int | None = None
    """Number of ranks (on each node); None means one per visible GPU, or 1 without GPUs."""
    nnodes: int = 1
    """Number of nodes, each running ``nproc`` ranks, as torchrun's ``--nnodes``: ranks get the
    multi-node environment (global ``RANK``, ``GROUP_RANK``, ...). With ``backend="subprocess"``
    every node runs on this machine (as torchrun's nodes can); an engine backend spreads them."""
    gpus: Sequence[int | str] | None = None
    """GPU indices or UUIDs the ranks see (their CUDA_VISIBLE_DEVICES); None
    keeps the kernel's setting, ``()`` hides every GPU."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: str | None = None
    """Working directory of the ranks; None means the caller's."""
    timeout: float | None = None
    """Seconds the whole job may run before it is stopped."""
    return_all: bool = False
    """Return a list with every rank's value instead of rank 0's."""
    backend: str = "subprocess"
    """How the nodes start: ``"subprocess"`` (on this machine) or ``"ray"`` (one Ray actor per node)."""
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Settings of the backend, e.g. ``{"num_gpus": 8}`` for Ray (see its module's docstring)."""
    grace: float = 2.0
    """Seconds between SIGTERM and SIGKILL when a job is stopped."""
    show_ranks: Sequence[int] | None = None
    """Ranks whose output is shown live (all when None); every log is kept."""
    pickle_by_value: Sequence[Any] = ()
    """Local modules to ship by value instead of importing them by name."""
    master_port: int | None = None
    """Port for the rendezvous; None picks a free one. A taken port is retried."""
    sample_interval: float | None = 1.0
    """Seconds between memory samples sent by each rank; None turns sampling off."""
    max_restarts: int = 0
    """How many times a failed job starts again, as torchrun's ``--max-restarts``: every rank is
    stopped and all start afresh with ``TORCHELASTIC_RESTART_COUNT`` one higher (a job that
    saves checkpoints resumes from its last one); with several nodes, every node. Cancel, timeout
    and a full disk never restart."""
    name: str | None = None
    debug_ranks: Sequence[int] | None = None
    """Ranks where ``breakpoint()`` (``pdb.set_trace()``) stops and asks in the cell; the others
    pass over it. None: every rank (the ``NBSHARD_DEBUG_RANKS`` variable, "1" or "0,2", does the same)."""
    profile: bool = False
    """Run the job under ``torch.profiler`` in every rank: each rank's trace (Perfetto,
    TensorBoard) and a summary of its top operators and communication share (``handle.profile()``)."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def rank_env(self) -> dict[str, str]:
        """The variables the job adds to each rank's environment: ``env``, and ``debug_ranks``'."""
        if self.debug_ranks is None:
            return dict(self.env)
        return {**self.env, DEBUG_RANKS_ENV: ",".join(map(str, self.debug_ranks))}

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__qualname__", None) or repr(self.fn)


MAX_VARIABLE_BYTES = 128 * 1024  # Linux's MAX_ARG_STRLEN: one NAME=value string, with its NUL, is below it
MAX_SECONDS = 1e9  # about 31 years; also below what Python's waits take (threading.TIMEOUT_MAX)


def check_seconds(name: str, value: Any, *, optional: bool = False) -> None:
    """``ValueError`` unless ``value`` is a positive, finite number of seconds (or None when
    ``optional``): NaN compares false with everything, so a deadline made of it never comes."""
    if value is None and optional:
        return
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or not math.isfinite(value) or not 0 < value <= MAX_SECONDS
    ):
        none = " (None for no limit)" if optional else ""
        raise ValueError(f"{name} must be a positive, finite number of seconds up to {MAX_SECONDS:g}{none}, got {value!r}")


def check_count(name: str, value: Any) -> None:
    """``ValueError`` unless ``value`` is a finite number >= 0 (a count of CPUs or GPUs)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_ranks_exist(job: Job, world_size: int) -> None:
    """``ValueError`` where ``show_ranks`` or ``debug_ranks`` name a rank the job does not have."""
    for field, ranks in (("show_ranks", job.show_ranks), ("debug_ranks", job.debug_ranks)):
        beyond = sorted({rank for rank in ranks or () if rank >= world_size})
        if beyond:
            raise ValueError(
                f"{field} names rank{'s' * (len(beyond) > 1)} {', '.join(map(str, beyond))}, but the job has "
                f"{world_size} rank{'s' * (world_size > 1)} (0 to {world_size - 1}); list ranks below {world_size}"
            )


def _validate(job: Job) -> None:
    if not callable(job.fn):
        raise TypeError(f"Job.fn must be callable, got {type(job.fn).__name__}: {job.fn!r}")
    if inspect.isgeneratorfunction(job.fn) or inspect.isasyncgenfunction(job.fn):
        raise TypeError(
            f"{getattr(job.fn, '__qualname__', job.fn)!r} is a generator function: calling it only makes a generator, "
            "which runs none of its body (and cannot be sent back). Return the values instead: a list, or the last one."
        )
    if not isinstance(job.args, tuple):
        raise TypeError(f"Job.args must be a tuple, got {type(job.args).__name__}")
    if not isinstance(job.kwargs, Mapping):
        raise TypeError(f"Job.kwargs must be a mapping, got {type(job.kwargs).__name__}")
    if not all(isinstance(name, str) for name in job.kwargs):
        raise TypeError(f"Job.kwargs must map argument names (str) to values, got the key {next(k for k in job.kwargs if not isinstance(k, str))!r}")
    if job.name is not None and (not isinstance(job.name, str) or not job.name.strip()):
        raise TypeError(f"name must be a non-empty string (it names the run and its directory), got {job.name!r}")
    if job.nproc is not None and (
        isinstance(job.nproc, bool) or not isinstance(job.nproc, int) or job.nproc < 1
    ):
        raise ValueError(f"nproc must be a positive integer, got {job.nproc!r}")
    if isinstance(job.nnodes, bool) or not isinstance(job.nnodes, int) or job.nnodes < 1:
        raise ValueError(f"nnodes must be a positive integer, got {job.nnodes!r}")
    for option, setting in (("profile", job.profile), ("return_all", job.return_all)):
        if not isinstance(setting, bool):  # "yes" or 0 would pass as truth values, and mean other than they say
            raise TypeError(f"{option} must be True or False, got {setting!r}")
    if job.gpus is not None:
        if isinstance(job.gpus, (str, bytes)) or not isinstance(job.gpus, Sequence):
            raise TypeError(f"gpus must be a list of GPU indices or UUIDs, e.g. [0, 1]; got {job.gpus!r}")
        for gpu in job.gpus:
            if isinstance(gpu, bool) or not isinstance(gpu, (int, str)) or (
                isinstance(gpu, int) and gpu < 0
            ):
                raise ValueError(f"gpus holds {gpu!r}: use non-negative indices or GPU UUID strings")
        if len(set(map(str, job.gpus))) != len(job.gpus):
            raise ValueError(f"gpus lists a GPU twice: {list(job.gpus)}")
    if not isinstance(job.env, Mapping):
        raise TypeError(f"env must be a dict of environment variables, e.g. {{'KEY': 'value'}}; got {job.env!r}")
    for key, value in job.env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env must map str to str; {key!r}: {value!r} is not (use str(value))")
        if not key or "=" in key or "\0" in key:
            raise ValueError(
                f"env holds the variable name {key!r}, which no environment can hold: a name is non-empty, "
                "without '=' or NUL characters"
            )
        if "\0" in value:
            raise ValueError(f"env[{key!r}] holds a NUL character, which no environment variable can hold; remove it")
        if len(f"{key}={value}".encode(errors="surrogateescape")) >= MAX_VARIABLE_BYTES:
            raise ValueError(
                f"env[{key!r}] takes {len(value.encode(errors='surrogateescape')) / 1024:,.0f} KiB, and Linux starts no process "
                f"with a variable of {MAX_VARIABLE_BYTES // 1024} KiB or more (MAX_ARG_STRLEN). Pass large data to the "
                "function as an argument, or write it to a file and pass its path."
            )
        if key in TORCHRUN_VARIABLES or key == "CUDA_VISIBLE_DEVICES":
            option = "gpus=" if key == "CUDA_VISIBLE_DEVICES" else "nproc= / master_port="
            raise ValueError(f"env sets {key}, which nbshard sets for each rank; use {option} instead")
    if job.cwd is not None and not isinstance(job.cwd, (str, os.PathLike)):
        raise TypeError(f"cwd must be a path, got {type(job.cwd).__name__}")
    for field, seconds in (("timeout", job.timeout), ("grace", job.grace), ("sample_interval", job.sample_interval)):
        check_seconds(field, seconds, optional=field != "grace")
    if not isinstance(job.backend, str):
        raise TypeError(f"backend must be a name such as 'subprocess', got {job.backend!r}")
    if not isinstance(job.backend_options, Mapping) or not all(isinstance(k, str) for k in job.backend_options):
        raise TypeError(f"backend_options must map option names to values, got {job.backend_options!r}")
    for field, ranks in (("show_ranks", job.show_ranks), ("debug_ranks", job.debug_ranks)):
        if ranks is not None and (isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
        )):
            raise ValueError(f"{field} must list rank numbers, e.g. [0]; got {ranks!r}")
    if job.nproc is not None:
        check_ranks_exist(job, job.nproc * job.nnodes)
    if not all(isinstance(module, types.ModuleType) for module in job.pickle_by_value):
        raise TypeError(
            f"pickle_by_value must list imported modules (import mymodule; pickle_by_value=[mymodule]), "
            f"got {list(job.pickle_by_value)!r}"
        )
    if job.master_port is not None and not (
        isinstance(job.master_port, int) and 0 < job.master_port < 65536
    ):
        raise ValueError(f"master_port must be a TCP port number (1-65535), got {job.master_port!r}")
    if isinstance(job.max_restarts, bool) or not isinstance(job.max_restarts, int) or job.max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number of restarts (0 for none), got {job.max_restarts!r}")
