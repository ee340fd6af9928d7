"""Nothing the ranks start outlives their launcher: not their children in its process group
(DataLoader workers), nor those in a session of their own (a daemon), which Linux hands
to the launcher when their parent exits because it is their subreaper."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

from nbshard.procfs import stat_fields

__all__ = ["adopt_orphans", "kill_leftovers"]

_PR_SET_CHILD_SUBREAPER = 36


def _live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process not yet a zombie."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)  # state, parent's pid, process group, ...
        if fields is not None and fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


def kill_leftovers(within: float = 3.0) -> None:
    """SIGKILL every process the ranks left behind: in this process group (DataLoader workers)
    or anywhere below this launcher, new sessions included (it is their subreaper).

    Only when the launcher leads its own group, as it does when a backend starts it;
    called in-process by a test, these processes are not ours to clean.
    """
    me = os.getpid()
    if os.getpgrp() != me:
        return
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        table = _live_processes()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in table.items():
            children.setdefault(parent, []).append(pid)
        doomed = {pid for pid, (_, group) in table.items() if group == me and pid != me}
        below = list(children.get(me, ()))
        while below:
            pid = below.pop()
            doomed.add(pid)
            below += children.get(pid, ())
        if not doomed:
            return
        for pid in doomed:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in children.get(me, ()):  # orphans handed to this subreaper: reap them
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)


def adopt_orphans() -> None:
    """Become the subreaper of the ranks' descendants: a process they start in a new session
    (``start_new_session=True``, a daemon) is handed to this launcher, not to init, when its
    parent exits, so ``kill_leftovers`` finds it."""
    if os.getpgrp() == os.getpid():
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
