"""What a dead kernel, warm process or node leaves behind, removed by the next nbshard start.

A directory nbshard makes in the system's temp directory (a warm process's, a Ray node's, a
socket's) holds a lock from the moment it is made for as long as its owner lives
(``hold_alive``); ``sweep_temp`` removes this user's directories whose lock nobody holds any
more. One without the lock file is left alone: whose it is cannot be told (an older
nbshard's). Whether a run's kernel still lives is told by its pid and start time together
(``process_identity``), so a reused pid is not it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

from nbshard.procfs import stat_fields

__all__ = ["ALIVE", "TEMP_PREFIXES", "hold_alive", "process_identity", "sweep_temp"]

ALIVE = ".alive"
TEMP_PREFIXES = ("nbshard-warm-", "nbshard-node-", "nbshard-wire-")


def hold_alive(directory: Path) -> int:
    """Lock ``directory`` as in use for as long as the returned descriptor (and any process it
    is passed to) stays open; not inherited across ``exec`` unless passed on purpose."""
    # Locked under another name, then renamed: a sweep never finds the lock file unlocked while
    # its owner lives (a sweep that tested it between its creation and its lock removed a new
    # directory), and a directory without one is not judged at all.
    locking = directory / f"{ALIVE}.{os.getpid()}"
    fd = os.open(locking, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweep tests the lock, a moment
    os.rename(locking, directory / ALIVE)
    return fd


def _owner_gone(directory: Path) -> bool:
    try:
        fd = os.open(directory / ALIVE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def sweep_temp(root: Path | None = None) -> list[Path]:
    """Remove this user's nbshard directories in ``root`` (the temp directory) whose owner is
    gone; returns them. Another user's entries, links and files are left alone."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIXES):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode) and _owner_gone(Path(entry.path)):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(Path(entry.path))
    return removed


def process_identity(pid: int) -> str | None:
    """``"PID:START"`` (its start time in clock ticks since boot) while ``pid`` runs, else None."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else f"{pid}:{fields[19]}"
