"""A failed attempt that ``max_restarts`` starts again: its files set aside, its cause in one line.

For the launcher: the next attempt's error and stack files must not mix with this one's, and the
kernel shows each attempt's cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from nbshard.contracts import Attempt, RankOutcome
from nbshard.errors import signal_name
from nbshard.files import read_json
from nbshard.run_dir import RunDir

__all__ = ["cause", "first_cause", "record", "set_aside"]


def set_aside(run_dir: RunDir, ranks: Iterable[int], restart_count: int) -> Path:
    """Move each rank's error, stack and torchelastic error files into the attempt's folder."""
    folder = run_dir.attempt(restart_count)
    folder.mkdir(mode=0o700)
    for rank in ranks:
        for path in (run_dir.error(rank), run_dir.stacks(rank), run_dir.torchelastic_error(rank)):
            with contextlib.suppress(FileNotFoundError):
                path.rename(folder / path.name)
    return folder


def first_cause(folder: Path, ranks: Sequence[RankOutcome]) -> tuple[int | None, str]:
    """The rank of ``ranks`` that failed
    first, and its cause: the root, not a peer that failed because of it (gloo's "Connection closed
    by peer") and whose exit happened to be seen first, by another node's launcher or in the same
    tick. Ordered by when each rank raised (its error file, set aside in ``folder``), else by when
    its exit was seen, as the job's final error orders its failures; a rank nbshard stopped counts
    only if no other failed."""
    failed = [e for e in ranks if not e.ok and not e.stopped] or [e for e in ranks if not e.ok]
    errors = RunDir(folder)

    def when(entry: RankOutcome) -> float:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return float(read_json(errors.error(entry.rank))["time"])
        return float(entry.ended or 0.0)

    if not failed:
        return None, "(no rank reported why)"
    first = min(failed, key=when)
    return first.rank, cause(errors.error(first.rank), first.rank, first.exitcode)


def cause(error_file: Path, rank: int, returncode: int | None) -> str:
    """'on rank R: Type: first line of the message', or how the rank exited."""
    with contextlib.suppress(OSError, ValueError, KeyError, AttributeError):
        error = read_json(error_file)
        message = (str(error["message"]).strip().splitlines() or [""])[0][:200]
        return f"on rank {rank}: {error['exc_type'].rsplit('.', 1)[-1]}{': ' + message if message else ''}"
    code = returncode or 0
    return f"on rank {rank}: " + (f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}")


def record(attempts: list[Attempt], rank: int | None, why: str, folder: Path, started_again: str,
           max_restarts: int, restart_count: int) -> str:
    """Add a failed attempt to ``attempts`` and return the line that tells the kernel and the logs."""
    attempts.append(Attempt(len(attempts) + 1, rank, why, str(folder)))
    return (
        f"attempt {len(attempts)} failed {why}; starting {started_again} again "
        f"(restart {len(attempts)} of {max_restarts}, TORCHELASTIC_RESTART_COUNT={restart_count + 1})"
    )
