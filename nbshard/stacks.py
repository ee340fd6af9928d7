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

__all__ = ["BETWEEN_CALLS", "MAIN_THREAD_HEADER", "STARTING", "source_label", "where_stopped"]

MAIN_THREAD_HEADER = "main thread "  # the first line of a rank's stacks file: "main thread 0x..."
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_NBSHARD_DIR = os.path.dirname(os.path.abspath(__file__))


def _dirs(*keys: str) -> tuple[str, ...]:
    return tuple({os.path.abspath(path) + os.sep for key in keys if (path := sysconfig.get_paths().get(key))})


_STDLIB_DIRS = _dirs("stdlib", "platstdlib")
_PACKAGE_DIRS = _dirs("purelib", "platlib")


STARTING = "before its function started (nbshard was still setting the rank up)"
BETWEEN_CALLS = "between calls (it has left the session's call, and waits for the next)"
_CALL_JOB = "call_job"  # nbshard.process.calls.call_job, the frame that calls the user's function
_SESSION_LOOP = "serve"  # nbshard.process.session_rank.serve, a session rank's loop of calls


def _main_thread_frames(stacks: str) -> list[tuple[str, int, str]]:
    """The main thread's frames in a faulthandler dump, innermost first."""
    lines = stacks.splitlines()
    main = lines[0][len(MAIN_THREAD_HEADER):].strip() if lines and lines[0].startswith(MAIN_THREAD_HEADER) else None
    threads: dict[str, list[tuple[str, int, str]]] = {}
    frames: list[tuple[str, int, str]] | None = None
    for line in lines:
        if (thread := _THREAD.match(line)) is not None:
            frames = threads.setdefault(thread.group(1), [])
            if main is None and line.startswith("Current thread"):
                main = thread.group(1)
        elif frames is not None and (frame := _FRAME.match(line)) is not None:
            frames.append((frame.group(1), int(frame.group(2)), frame.group(3)))
    return threads.get(main or "", [])


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
    ``[STARTING]`` when it had not reached the user's function yet; empty when the dump
    shows no frame at all."""
    every = _main_thread_frames(stacks)
    ours = [f for f in every if f[0].startswith(_NBSHARD_DIR + os.sep)]
    if ours and not any(name == _CALL_JOB for _, _, name in ours):
        return [BETWEEN_CALLS if any(name == _SESSION_LOOP for _, _, name in ours) else STARTING]
    frames = [f for f in every if f not in ours]
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
