"""Turn a finished run directory into the job's value or the exception that explains it.

Every file is read through ``OpenedDir``: the directory the kernel made, still held,
never one put at its path since.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterable
from typing import Any

from nbshard.contracts import NODES_FAILED, OTHER_VERSION, RankOutcome, RunOutcome, Status
from nbshard.errors import (
    JobCancelled,
    JobError,
    JobFailed,
    JobTimedOut,
    RankFailure,
    how_it_ended,
    signal_name,
)
from nbshard.files import OpenedDir
from nbshard.run_dir import RunDir
from nbshard.kernel.remote import remote_exception

__all__ = ["collect", "read_outcome"]


def _rank_failures(files: OpenedDir, run_dir: RunDir, ranks: list[RankOutcome]) -> list[RankFailure]:
    """Every rank that did not return, root cause first: the earliest real failure."""
    failures = []
    for entry in ranks:
        if entry.ok:
            continue
        rank, code = entry.rank, entry.exitcode
        if entry.lost:
            failures.append(RankFailure(rank=rank, time=entry.ended, lost=entry.lost))
            continue
        error_file = run_dir.error(rank)
        if files.exists(error_file) and not entry.stopped:
            failures.append(RankFailure.from_error_file(files.read_json(error_file)))
            continue
        failures.append(
            RankFailure(
                rank=rank,
                time=entry.ended,
                exitcode=code,
                signal=signal_name(-code) if code is not None and code < 0 else None,
                stopped=entry.stopped,
                stacks=entry.stacks,
            )
        )
    # A lost node's ranks lead (their peers' errors follow from it), then the earliest real
    # failure; the ranks nbshard stopped follow in rank order.
    return sorted(failures, key=lambda f: (not f.lost, f.stopped, 0.0 if f.stopped else f.time, f.rank))


def _load_values(files: OpenedDir, run_dir: RunDir, ranks: range, world_size: int, remove: bool, sent: dict[int, bytes]) -> list[Any]:
    """The ranks' values (``sent``: those that came pickled with the run's end, else each read as
    a stream from its file); then every result file goes (the values live on, and a large one
    should not fill the disk for as long as the run directory is kept), unless the caller
    removes them later (``remove_results``)."""
    values = []
    for rank in ranks:
        if rank in sent:
            values.append(pickle.loads(sent[rank]))
            continue
        with files.open(run_dir.result(rank)) as file:
            values.append(pickle.load(file))
    if remove:
        remove_results(run_dir, range(world_size), files)
    return values


def remove_results(run_dir: RunDir, ranks: Iterable[int], files: OpenedDir | None = None) -> None:
    """The result files of ``ranks``, gone (through ``files`` where the directory is open)."""
    for rank in ranks:
        with contextlib.suppress(OSError):
            files.unlink(run_dir.result(rank)) if files else os.unlink(run_dir.result(rank))


def _earlier_attempts(outcome: RunOutcome) -> str:
    """The failed attempts before this one, a line of the error's message ('' without restarts;
    the first line, which the live view's heading shows, stays short)."""
    attempts = outcome.attempts
    if not attempts:
        return ""
    causes = "; ".join(f"attempt {a.attempt} failed {a.cause}" for a in attempts)
    return f"\nThis was attempt {len(attempts) + 1}, after {len(attempts)} restart{'s' * (len(attempts) > 1)}: {causes}."


LAUNCHER_LOG_TAIL = 12  # lines of a launcher's own log shown when it ended without an outcome


def _launcher_died(files: OpenedDir, run_dir: RunDir, launcher_exit: int | None) -> str:
    """What to say of a launcher that ended without writing the outcome: killed from outside
    (a signal, an empty log), or failed by itself (its own last lines say how)."""
    how = how_it_ended(launcher_exit) if launcher_exit is not None else "ended"
    try:
        lines = files.read_bytes(run_dir.launcher_log).decode(errors="replace").rstrip().splitlines()
    except OSError:
        lines = []
    if launcher_exit is not None and launcher_exit > 0 and lines:
        tail = "\n".join(f"    {line}" for line in lines[-LAUNCHER_LOG_TAIL:])
        if OTHER_VERSION in lines[-1]:
            cause = ("nbshard was upgraded or reinstalled after this kernel imported it (restart the kernel), or the "
                     "job's PYTHONPATH or another node holds another nbshard (install the kernel's there).")
        elif NODES_FAILED in lines[-1]:
            cause = ("a bug in the backend that started the nodes (one of its nodes raised; the traceback above "
                     "says where), or in nbshard. Every node was stopped.")
        else:
            cause = ("the job's environment (env=, e.g. PYTHONHOME or PYTHONPATH) or this machine's limits keep Python "
                     "or nbshard from starting there.")
        return (
            f"The nbshard launcher failed by itself ({how}) before the job ended: {lines[-1].strip()}\n"
            f"The last lines of its log ({run_dir.launcher_log}):\n{tail}\nLikely cause: {cause}"
        )
    return (
        f"The nbshard launcher {how} before the job ended, so the ranks were stopped "
        f"with it. Likely cause: it was killed from outside, or it crashed; its own log is "
        f"{run_dir.launcher_log}."
    )


def read_outcome(files: OpenedDir, run_dir: RunDir) -> RunOutcome | None:
    """The launcher's ``outcome.json``, or None when it ended without writing one."""
    return RunOutcome.from_json(files.read_json(run_dir.outcome)) if files.exists(run_dir.outcome) else None


def collect(
    files: OpenedDir,
    run_dir: RunDir,
    outcome: RunOutcome | None,
    *,
    world_size: int,
    return_all: bool,
    timeout: float | None,
    launcher_exit: int | None,
    storage_error: str | None = None,
    remove_later: bool = False,
    sent: dict[int, bytes] | None = None,
) -> tuple[Any, JobError | None]:
    """(value, None) for a job that succeeded, else (None, the exception to raise).

    ``storage_error``: why the launcher could not write the run's files, as its last message
    said (when it could not write ``outcome.json`` either). ``remove_later``: the caller removes
    the result files (``remove_results``) once it has woken whoever waits for the value.
    ``sent``: ranks' pickled values that came with the run's end message, not as files.
    """
    where = str(run_dir.path)
    storage_error = (outcome.storage_error if outcome else None) or storage_error
    if storage_error:
        failures = _rank_failures(files, run_dir, outcome.ranks) if outcome else []
        return None, JobFailed(
            f"The job was stopped because its files could not be written: {storage_error}. Likely "
            f"cause: the filesystem of the run directory is full (or over quota), so the ranks' logs "
            "and results could not be kept. Free space there, or set NBSHARD_RUNS_DIR (or "
            "nbshard.settings.runs_dir) to a directory on another filesystem.",
            failures, where,
        )
    if outcome is None:
        return None, JobFailed(_launcher_died(files, run_dir, launcher_exit), run_dir=where)
    if outcome.start_error:
        return None, JobFailed(outcome.start_error, _rank_failures(files, run_dir, outcome.ranks), where)
    status = outcome.status
    if status is Status.SUCCEEDED:
        try:
            values = _load_values(files, run_dir, range(world_size) if return_all else range(1), world_size, not remove_later,
                                  sent or {})
        except Exception as error:  # noqa: BLE001 - reported with its cause
            failed = JobFailed(
                f"The job succeeded but its result could not be loaded in the kernel: {error!r}. "
                "Likely cause: the value refers to a module or class the kernel cannot import. "
                "Return plain data (dicts, lists, tensors, numbers) or import that module here.",
                run_dir=where,
            )
            failed.__cause__ = error
            return None, failed
        return (values if return_all else values[0]), None
    failures = _rank_failures(files, run_dir, outcome.ranks)
    earlier = _earlier_attempts(outcome)
    exception: JobError
    if status is Status.TIMED_OUT:
        exception = JobTimedOut(
            f"The job ran past its timeout of {timeout:g} s and was stopped. Where each rank was "
            "is below (every thread's stack is at the end of its log). If it was still making "
            f"progress, raise timeout=; if a rank waits in a collective, another rank never joined it.{earlier}",
            failures, where,
        )
    elif status is Status.CANCELLED:
        exception = JobCancelled(f"The job was cancelled and its ranks were stopped.{earlier}", failures, where)
    elif outcome.stopped_from_outside and not outcome.lost_nodes:
        which = ", ".join(f"node {node}'s got {name}" for node, name in outcome.stopped_from_outside.items())
        exception = JobFailed(
            f"The job was stopped from outside: the launchers were signalled ({which}), as a scheduler does "
            f"when the allocation is cancelled (scancel), preempted or out of time, or a user's kill.{earlier}",
            failures, where,
        )
    elif outcome.lost_nodes:
        lost = "; ".join(f"node {node} was lost: {why}" for node, why in outcome.lost_nodes.items())
        others = any(rank.lost is None for rank in outcome.ranks)  # ranks of nodes that were not lost
        follow = " The errors of the other nodes' ranks follow from it (a peer gone from a collective)." if others else ""
        exception = JobFailed(f"The job failed because {lost}.{follow}{earlier}", failures, where)
    else:
        first = f"on rank {failures[0].rank}" if failures else "(no rank reported why)"
        exception = JobFailed(f"The job failed {first}.{earlier}", failures, where)
    if failures and failures[0].exc_type is not None:
        exception.__cause__ = remote_exception(failures[0])
    return None, exception
