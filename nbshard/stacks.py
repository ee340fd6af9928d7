"""Where a stopped rank was, in a person's terms, from the faulthandler dump it wrote.

The dump holds every thread; a person wants the main thread's place in their own
code: a notebook cell as ``Cell In[N], line L`` (IPython's own naming), the source
line from the kernel's linecache, and the installed package it was inside (a
collective in torch); nothing of nbshard or the standard library. Pure.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig

__all__ = ["BETWEEN_CALLS", "EXITING", "MAIN_THREAD_HEADER", "STARTING", "THREAD_NAME_HEADER", "not_exited_note", "source_label", "where_stopped", "why_not_exited"]

MAIN_THREAD_HEADER = "main thread "  # the first line of a rank's stacks file: "main thread 0x..."
THREAD_NAME_HEADER = "thread named "  # "thread named 0x... NAME": a thread the rank waits for at its exit
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_NBSHARD_DIR = os.path.dirname(os.path.abspath(__file__))


def _dirs(*keys: str) -> tuple[str, ...]:
    return tuple({os.path.abspath(path) + os.sep for key in keys if (path := sysconfig.get_paths().get(key))})


_STDLIB_DIRS = _dirs("stdlib", "platstdlib")
_PACKAGE_DIRS = _dirs("purelib", "platlib")


STARTING = "before its function started (nbshard was still setting the rank up)"
BETWEEN_CALLS = "between calls (it has left the session's call, and waits for the next)"
EXITING = "after its function returned, while exiting"
_CALL_JOB = ("calls.py", "call_job")  # nbshard.process.calls.call_job, the frame that calls the user's function
_SESSION_LOOP = ("session_rank.py", "serve")  # nbshard.process.session_rank.serve, a session rank's loop of calls
_RANK_EXIT = ("worker.py", "_exit")  # nbshard.process.worker._exit, a rank leaving after its function
_THREAD_JOIN = ("threading.py", "_shutdown")  # Python waiting for the threads that are not daemons

Frame = tuple[str, int, str]  # filename, line, function


def _threads(stacks: str) -> tuple[str, dict[str, list[Frame]]]:
    """The main thread's id and every thread's frames (innermost first) in a faulthandler dump."""
    lines = stacks.splitlines()
    main = lines[0][len(MAIN_THREAD_HEADER):].strip() if lines and lines[0].startswith(MAIN_THREAD_HEADER) else None
    threads: dict[str, list[Frame]] = {}
    frames: list[Frame] | None = None
    for line in lines:
        if (thread := _THREAD.match(line)) is not None:
            frames = threads.setdefault(thread.group(1), [])
            if main is None and line.startswith("Current thread"):
                main = thread.group(1)
        elif frames is not None and (frame := _FRAME.match(line)) is not None:
            frames.append((frame.group(1), int(frame.group(2)), frame.group(3)))
    return main or "", threads


def _thread_names(stacks: str) -> dict[str, str]:
    """Thread id -> name, for the threads the rank listed as it began to wait for them."""
    names = {}
    for line in stacks.splitlines():
        if line.startswith(THREAD_NAME_HEADER):
            ident, _, name = line[len(THREAD_NAME_HEADER):].partition(" ")
            names[ident] = name
    return names


def _ours(frame: Frame) -> bool:
    return frame[0].startswith(_NBSHARD_DIR + os.sep)


def _is(frame: Frame, place: tuple[str, str]) -> bool:
    return os.path.basename(frame[0]) == place[0] and frame[2] == place[1]


def _is_package(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIRS)


def _is_stdlib(filename: str) -> bool:
    """The standard library; site-packages often lies inside its directory, and is not."""
    path = os.path.abspath(filename)
    return filename.startswith("<frozen") or (path.startswith(_STDLIB_DIRS) and not _is_package(path))


def _is_library(filename: str) -> bool:
    return _is_stdlib(filename) or _is_package(filename)


def source_label(filename: str, lineno: int) -> str:
    """A frame's place as IPython names it: ``Cell In[5], line 3`` for a notebook cell."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    format_code_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    named = format_code_name(filename) if format_code_name is not None else None
    if named:
        return f"{named[0]} {named[1]}, line {lineno}"
    return f'File "{filename}", line {lineno}'


def where_stopped(stacks: str, limit: int = 3) -> list[str]:
    """Where a rank's main thread was, in a few lines: its innermost frames of user code
    (a cell as ``Cell In[N], line L``) and the installed package it was inside (a
    collective in torch), nothing of nbshard or the standard library (threading, runpy).
    ``[STARTING]`` when it had not reached the user's function yet, ``[BETWEEN_CALLS]`` in a
    session between calls, ``EXITING`` and ``why_not_exited``'s lines once its function had returned; empty
    when the dump shows no frame at all."""
    main, threads = _threads(stacks)
    every = threads.get(main, [])
    ours = [f for f in every if _ours(f)]
    if any(_is(f, _RANK_EXIT) for f in ours):
        why = why_not_exited(stacks, limit)
        return [f"{EXITING}: {why[0]}", *why[1:]] if why else [EXITING]
    if ours and not any(_is(f, _CALL_JOB) for f in ours):
        return [BETWEEN_CALLS if any(_is(f, _SESSION_LOOP) for f in ours) else STARTING]
    return _where([f for f in every if f not in ours], limit)


def why_not_exited(stacks: str, limit: int = 3) -> list[str]:
    """What a rank whose function returned does instead of exiting, in a few lines: waiting
    for a thread that is not a daemon (where one of the job's threads is), or running an atexit
    handler (where the main thread is); empty when the dump shows no frame."""
    main, threads = _threads(stacks)
    every = threads.get(main, [])
    if any(_is(f, _THREAD_JOIN) for f in every):
        others = [(thread, frames) for thread, frames in threads.items() if thread != main and frames and not any(map(_ours, frames))]
        others.sort(key=lambda other: all(_is_library(f[0]) for f in other[1]))  # those running the job's code first
        waits = "Python waits for the threads the job started that are not daemon threads"
        if not others:
            return [waits]
        name = _thread_names(stacks).get(others[0][0])
        return [f"{waits}; one of the job's threads{f' ({name!r})' if name else ''} is at:", *_where(others[0][1], limit)]
    if not every:
        return []
    where = _where([f for f in every if not _ours(f)], limit)
    return [f"it runs an exit handler (atexit){', at:' if where else ''}", *where]


def _where(frames: list[Frame], limit: int) -> list[str]:
    """The innermost ``limit`` frames of user code with their source lines, and the package
    the innermost frame is in where that is not user code."""
    user = [f for f in frames if not _is_library(f[0])][:limit]
    lines = []
    for filename, lineno, name in reversed(user):
        lines.append(f"{source_label(filename, lineno)}, in {name}")
        source = linecache.getline(filename, lineno).strip()
        if source:
            lines.append(f"    {source}")
    if frames and frames[0] not in user and not _is_stdlib(frames[0][0]):  # e.g. inside torch's barrier
        filename, lineno, name = frames[0]
        lines.append(f"  inside {name} ({filename}, line {lineno})")
    return lines


def not_exited_note(seconds: dict[str, float], stacks: dict[str, str]) -> str:
    """The cell's note on ranks whose function returned ``seconds`` ago and that still run: what
    each waits for, ranks in the same place named together."""
    places: dict[tuple[str, ...], list[str]] = {}
    for rank in seconds:
        places.setdefault(tuple(why_not_exited(stacks.get(rank, ""))), []).append(rank)
    notes = []
    for why, ranks in places.items():
        names = f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}"
        since = max(seconds[rank] for rank in ranks)
        notes.append("\n    ".join([
            f"{names} returned {since:.0f} s ago and {'have' if len(ranks) > 1 else 'has'} not exited{': ' if why else ''}{why[0] if why else ''}",
            *why[1:],
        ]))
    notes.append("The values are kept: the stop button (handle.cancel()) ends the ranks still exiting, and the job returns.")
    return "\n    ".join(notes)
