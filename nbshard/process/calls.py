"""One call of a job in a rank: load it, run it, write its result or its error file.

A job's rank makes one call (``nbshard.worker``); a session's rank makes one per cell
(``nbshard.session_rank``). The error file keeps the rank's own frames, not nbshard's.
"""

from __future__ import annotations

import base64
import inspect
import os
import pickle
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbshard.errors import PACKAGE_DIR
from nbshard.files import write_atomic, write_json
from nbshard.run_dir import RunDir
from nbshard.rank import monitor

__all__ = ["NOTEBOOK_MAIN_ENV", "call_job", "run_job", "user_traceback", "write_error"]

NOTEBOOK_MAIN_ENV = "NBSHARD_NOTEBOOK_MAIN"


class _NotebookMainFile:
    """The notebook's classes and functions for this rank's spawn-started children, written when
    the first such child is prepared after a call shipped them (most calls start none, and a
    session's rank would otherwise pickle them again at every call); rewritten only on change."""

    pending: tuple[Path, dict[str, Any]] | None = None
    written: dict[Path, bytes] = {}
    hooked = False

    @classmethod
    def ship(cls, path: Path, objects: dict[str, Any]) -> None:
        cls.pending = (path, objects)
        os.environ[NOTEBOOK_MAIN_ENV] = str(path)
        if not cls.hooked:  # multiprocessing's spawn and forkserver prepare each child through this
            import multiprocessing.spawn

            prepare = multiprocessing.spawn.get_preparation_data

            def get_preparation_data(name: str) -> dict[str, Any]:
                cls.write()
                return prepare(name)

            multiprocessing.spawn.get_preparation_data = get_preparation_data
            cls.hooked = True

    @classmethod
    def write(cls) -> None:
        if cls.pending is None:
            return
        (path, objects), cls.pending = cls.pending, None
        from nbshard.results import dump_result

        try:
            data = dump_result(objects)
            if cls.written.get(path) != data:
                write_atomic(path, data)
                cls.written[path] = data
        except Exception:  # noqa: BLE001 - only spawn children would miss them
            pass


def _notebook_objects(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Classes and functions of the notebook's ``__main__`` that the job carries."""
    found: dict[str, Any] = {}
    if isinstance(fn, types.FunctionType) and fn.__module__ == "__main__":
        found.update((k, v) for k, v in fn.__globals__.items() if not k.startswith("__"))
        found[fn.__name__] = fn
    pending: list[tuple[Any, int]] = [(value, 0) for value in (*args, *kwargs.values())]
    while pending:
        value, depth = pending.pop()
        cls = value if isinstance(value, type) else type(value)
        if cls.__module__ == "__main__" and "." not in cls.__qualname__:
            found.setdefault(cls.__qualname__, cls)
        if depth < 2:
            if isinstance(value, dict):
                pending += [(v, depth + 1) for v in value.values()]
            elif isinstance(value, (list, tuple)):
                pending += [(v, depth + 1) for v in value[:100]]
    return found


def _install_notebook_main(objects: dict[str, Any], path: Path, keep: Callable[[str, Any], bool] | None = None) -> None:
    """Put the notebook's names on this process's ``__main__``.

    Code that pickles by reference (``torch.save(model)``, DataLoader workers)
    looks classes up as ``__main__.Name``; here ``__main__`` is this worker, so
    the notebook's classes must be found on it. Spawn-started children re-import
    this module as ``__mp_main__`` and load the same names from ``path``. ``keep(name, value)``:
    whether ``__main__``'s own value of a name stays (a session's names win over the notebook's).
    """
    main = vars(sys.modules["__main__"])
    main.update((k, v) for k, v in objects.items() if keep is None or k not in main or not keep(k, v))
    shippable = {k: v for k, v in objects.items() if getattr(v, "__module__", None) == "__main__"}
    if shippable:
        _NotebookMainFile.ship(path, shippable)


def _frames(tb: types.TracebackType | None) -> list[dict[str, Any]]:
    frames = []
    codes = [frame.f_code for frame, _ in traceback.walk_tb(tb)]
    for frame, code in zip(traceback.extract_tb(tb), codes):
        entry: dict[str, Any] = {
            "filename": frame.filename, "lineno": frame.lineno, "name": frame.name,
            "firstlineno": code.co_firstlineno,  # where its function starts, for tracebacks that show it whole
        }
        if getattr(frame, "end_lineno", None) == frame.lineno and frame.colno is not None:
            entry.update(colno=frame.colno, end_colno=frame.end_colno)
        frames.append(entry)
    return frames


def user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without nbshard's leading frames, which only called the user's code."""
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        tb = tb.tb_next
    return tb


_MAX_PICKLED_ERROR = 1 << 20  # an exception holding more (a tensor argument) arrives as its text


def _pickled_exception(error: BaseException) -> tuple[str, str]:
    """``error`` pickled by value (its class and args intact, a notebook's class included) as
    base64, and "" ; or "" and why it could not be, for the kernel to say so."""
    from nbshard.pickling import find_unpicklable
    from nbshard.results import dump_result

    try:
        data = dump_result(error, "the exception")
    except Exception:  # noqa: BLE001 - any failure here only means: send the text
        found = find_unpicklable(error, "the exception")
        culprit = f"{found[0]} (a {type(found[1]).__qualname__})" if found else "it"
        return "", f"{culprit} could not be pickled in the rank"
    if len(data) > _MAX_PICKLED_ERROR:
        return "", f"pickled, it takes {len(data) / 2**20:.1f} MiB (over {_MAX_PICKLED_ERROR >> 20} MiB)"
    return base64.b64encode(data).decode("ascii"), ""


def write_error(run_dir: RunDir, rank: int, error: BaseException, hint: str = "") -> None:
    """The error file; the launcher copies its traceback into the rank's log (the kernel
    shows it as a traceback of its own, so it is not streamed as lines too). It carries the
    exception pickled, so the kernel raises the same object where it can."""
    tb = user_traceback(error.__traceback__)
    text = "".join(traceback.format_exception(type(error), error, tb)) + (f"{hint}\n" if hint else "")
    cls = type(error)
    pickled, pickle_problem = _pickled_exception(error)
    write_json(
        run_dir.error(rank),
        {
            "rank": rank,
            "time": time.time(),
            "exc_type": f"{cls.__module__}.{cls.__qualname__}",
            "message": _message(error),
            "frames": _frames(tb),
            "traceback": text,
            "notes": [*getattr(error, "__notes__", ()), *([hint] if hint else [])],
            "pickled": pickled,
            "pickle_problem": pickle_problem,
        },
    )


def _message(error: BaseException) -> str:
    """``str(error)``; where that raises, what Python's own traceback says then."""
    try:
        return str(error)
    except Exception as problem:  # noqa: BLE001 - the rank's error is reported all the same
        return f"<exception str() failed: {type(problem).__name__}>"


def call_job(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The user's function; its frame in a stack dump tells that the rank had started it. An
    ``async def`` runs to its end, as ``asyncio.run`` runs a script's."""
    value = fn(*args, **kwargs)
    if inspect.iscoroutine(value):
        import asyncio

        value = asyncio.run(value)
    return value


def run_job(
    paths: RunDir, rank: int, payload: bytes, *, keep_result: bool, mark_success: bool = True, call: Callable[..., Any] = call_job,
    keep: Callable[[str, Any], bool] | None = None, announce: bool = True, main_file: Path | None = None,
    inline_max: int | None = None,
) -> tuple[int, bytes | None]:
    """Load the job from ``payload``, run it with ``call``, write ``paths``' result or error file
    for this rank; returns the rank's exit code, and its pickled value where it took at most
    ``inline_max`` bytes (then no result file is made: a session's rank answers with it). Where
    the value is not kept, the result file holds None, as a job's launcher's sign that the rank
    got through (``mark_success=False``: none, for a session's rank, whose answer says so). A session runs each of its calls this way
    (``keep``: which of its names the notebook's do not replace; ``announce``: tell the kernel when
    the job is loaded and runs; ``main_file``: where spawn-started children find the notebook's
    names, ``paths``' own by default)."""
    from nbshard.pickling import register_sources
    from nbshard.results import write_result

    register_sources(paths)  # pdb here shows the notebook's cells
    try:
        fn, args, kwargs = pickle.loads(payload)
    except Exception as error:
        write_error(paths, rank, error, hint=(
            "nbshard could not load the job in this rank: it refers by name to something not "
            "importable here. Install it in this Python environment, make it importable from the "
            "job's cwd, or pass pickle_by_value=[module]."
        ))
        return 1, None
    _install_notebook_main(_notebook_objects(fn, args, kwargs), main_file or paths.notebook_main(rank), keep)
    if announce:  # loaded, its imports done: the cell says so (a session's calls run in ranks long up)
        monitor.send_stage("running")
    try:
        value = call(fn, args, kwargs)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            write_error(paths, rank, stop)
            return (stop.code if isinstance(stop.code, int) else 1), None
        value = None
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the kernel
        write_error(paths, rank, error)
        return 1, None
    if not keep_result and not mark_success:
        return 0, None
    try:
        return 0, write_result(paths.result(rank), value if keep_result else None, keep_small=inline_max)
    except Exception as error:  # noqa: BLE001
        write_error(paths, rank, error.with_traceback(None))
        return 1, None
