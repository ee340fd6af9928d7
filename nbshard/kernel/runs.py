"""The runs directory, kernel side: a new run's directory, and the finished runs pruned.

Pruning keeps the newest ``keep`` finished runs within ``keep_bytes``; runs whose kernel has
exited go first, and their results (which nobody can load any more) at once. What dead kernels
and lost nodes left in the temp directory is swept once per kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import stat
import time
from pathlib import Path

from nbshard.files import make_private_dirs, read_json
from nbshard.run_dir import RunDir
from nbshard.leftovers import process_identity, sweep_temp

__all__ = ["new_run_dir", "prune_runs"]


def new_run_dir(root: Path, label: str) -> RunDir:
    """A new run directory in ``root`` (made private, and refused where another local user could
    swap its contents)."""
    make_private_dirs(root)  # refuses a directory another local user could swap things in
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in label)[:40]
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{secrets.token_hex(3)}"
    longest = path / f".torchelastic-error-{10**6}.json.{10**7}.tmp"  # the longest name a run writes
    limit = os.pathconf(root, "PC_PATH_MAX")
    if len(os.fsencode(longest)) >= limit:
        raise ValueError(
            f"the runs directory's path is too long ({len(os.fsencode(root))} bytes): a run's files "
            f"would pass this filesystem's limit of {limit} bytes per path. Set NBSHARD_RUNS_DIR or "
            "nbshard.settings.runs_dir to a shorter path."
        )
    path.mkdir(mode=0o700)
    return RunDir(path)


@dataclasses.dataclass(frozen=True)
class _FinishedRun:
    path: Path
    mtime: float
    kernel_gone: bool  # nobody can read its results any more
    unread: bool  # it still holds result files
    size: int


def _finished_run(path: Path) -> _FinishedRun | None:
    """One of ours that has ended (its launcher wrote the outcome or is gone, or its kernel died);
    None for anything else (another user's entry, a file, a run still going, one unreadable):
    pruning leaves those alone."""
    try:
        st = os.lstat(path)
        if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
            return None
        kernel_gone = _kernel_gone(path)
        launcher_left = (path / "launcher.pid").exists() or kernel_gone  # it ran, or never will
        if not ((path / "outcome.json").exists() or launcher_left and not _launcher_alive(path)):
            return None
        size, unread = _sized(os.fspath(path))
        return _FinishedRun(path, st.st_mtime, kernel_gone, unread, size)
    except OSError:
        return None


def _sized(folder: str) -> tuple[int, bool]:
    """The bytes of the files below ``folder``, and whether a result file is among them."""
    size, unread = 0, False
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                inner, inner_unread = _sized(entry.path)
                size, unread = size + inner, unread or inner_unread
            else:
                size += entry.stat(follow_symlinks=False).st_size
                unread = unread or entry.name.startswith("result-")
    return size, unread


def _kernel_gone(path: Path) -> bool:
    """Whether the kernel that started this run has exited (a reused pid is not it)."""
    try:
        kernel = read_json(path / "launch.json").get("kernel")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(kernel, str) and process_identity(int(kernel.split(":")[0])) != kernel


def _launcher_alive(path: Path) -> bool:
    try:
        os.kill(int((path / "launcher.pid").read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def prune_runs(root: Path, *, keep: int, keep_bytes: int, spare: Path) -> None:
    """Delete the results a dead kernel can no longer read, then finished runs beyond the newest
    ``keep`` or ``keep_bytes``: those of dead kernels first, then the oldest. ``spare``: the run
    just launched (the kernel prunes while its launcher starts, off the launch's path), which may
    already have finished and is never counted or touched. What dead kernels and lost nodes left
    in the temp directory is swept at the first launch."""
    _sweep_once()
    runs = [run for path in root.iterdir() if path != spare and (run := _finished_run(path)) is not None]
    for index, run in enumerate(runs):
        if run.kernel_gone and run.unread:  # counted without them from here on
            runs[index] = dataclasses.replace(run, size=run.size - _drop_results(run.path), unread=False)
    runs.sort(key=lambda run: (not run.kernel_gone, run.mtime))
    count, total = len(runs), sum(run.size for run in runs)
    for run in runs:
        if count <= keep and total <= keep_bytes:
            break
        if run.unread and not run.kernel_gone:  # its kernel lives and may be reading it now
            continue
        shutil.rmtree(run.path, ignore_errors=True)
        count, total = count - 1, total - run.size


def _drop_results(folder: Path) -> int:
    """Remove the result files below ``folder``; returns the bytes they took."""
    freed = 0
    for result in folder.rglob("result-*.pkl"):
        with contextlib.suppress(OSError):
            size = result.stat().st_size
            result.unlink()
            freed += size
    return freed


def _sweep_once() -> None:
    """What dead kernels and lost nodes left in the temp directory goes, once per kernel."""
    global _swept
    if not _swept:
        _swept = True
        sweep_temp()


_swept = False
