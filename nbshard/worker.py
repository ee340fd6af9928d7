"""The entry point of each rank: ``python -m nbshard.worker RUN_DIR``.

Loads the job, runs the function, writes the outcome (``result-R.pkl`` or
``error-R.json``) atomically, then ends the process with ``os._exit`` after
running ``atexit`` handlers and flushing, because gloo ranks otherwise abort
at interpreter exit now and then ("terminate called without an active
exception") after the user's code has finished.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from collections.abc import Callable
from typing import Any

from nbshard import monitor
from nbshard.contracts import LaunchSpec
from nbshard.files import open_private, write_atomic, write_json
from nbshard.fresh import MAIN_NAMES
from nbshard.job import RunDir
from nbshard.stacks import MAIN_THREAD_HEADER

__all__ = ["call_job", "main", "run_as_main", "run_forked", "run_job", "write_error"]

NOTEBOOK_MAIN_ENV = "NBSHARD_NOTEBOOK_MAIN"
_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """Ask Linux to SIGKILL this rank when the launcher dies, however it dies."""
    launcher = int(os.environ.get("NBSHARD_LAUNCHER_PID", "0"))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if launcher and os.getppid() != launcher:  # it died before prctl took effect
        os._exit(1)


def _dump_stacks_on_request(path: Path) -> None:
    """On SIGUSR1 (the launcher stopping the job), write every thread's stack to ``path``.

    faulthandler writes from its C signal handler, so a rank stuck in a
    collective or in C code still answers. The stacks go to a file of their
    own, not to stderr: the cell shows a short summary, the log the whole dump.
    """
    stacks = open_private(path, "w")  # noqa: SIM115 - faulthandler holds it for the life of the rank
    stacks.write(f"{MAIN_THREAD_HEADER}0x{threading.main_thread().ident:016x}\n")
    stacks.flush()
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)


def _use_kernel_path(kernel_path: list[str]) -> None:
    """Make the notebook's import path (helper modules, sys.path edits) the rank's too."""
    missing = [entry for entry in kernel_path if entry not in sys.path]
    sys.path[:0] = missing


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
        from nbshard.pickling import dump_result

        try:
            write_atomic(path, dump_result(shippable))
            os.environ[NOTEBOOK_MAIN_ENV] = str(path)
        except Exception:  # noqa: BLE001 - only spawn children would miss them
            pass


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


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without nbshard's leading frames, which only called the user's code."""
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == _PACKAGE_DIR:
        tb = tb.tb_next
    return tb


def write_error(run_dir: RunDir, rank: int, error: BaseException, hint: str = "") -> None:
    """The error file; the launcher copies its traceback into the rank's log (the kernel
    shows it as a traceback of its own, so it is not streamed as lines too)."""
    tb = _user_traceback(error.__traceback__)
    text = "".join(traceback.format_exception(type(error), error, tb)) + (f"{hint}\n" if hint else "")
    cls = type(error)
    write_json(
        run_dir.error(rank),
        {
            "rank": rank,
            "time": time.time(),
            "exc_type": f"{cls.__module__}.{cls.__qualname__}",
            "message": str(error),
            "frames": _frames(tb),
            "traceback": text,
            "notes": [*getattr(error, "__notes__", ()), *([hint] if hint else [])],
        },
    )


def _start_monitor(run_dir: RunDir, rank: int, launch: LaunchSpec) -> None:
    try:
        monitor.start(launch.address, run_dir.key.read_bytes(), rank, launch.sample_interval, str(run_dir.metrics(rank)))
    except Exception as error:  # noqa: BLE001 - telemetry must never fail a job
        print(f"nbshard: memory sampling is off in rank {rank}: {error!r}", file=sys.stderr)


def call_job(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The user's function; its frame in a stack dump tells that the rank had started it."""
    return fn(*args, **kwargs)


def run_job(
    paths: RunDir, rank: int, payload: bytes, *, keep_result: bool, call: Callable[..., Any] = call_job,
    keep: Callable[[str, Any], bool] | None = None,
) -> int:
    """Load the job from ``payload``, run it with ``call``, write ``paths``' result or error file
    for this rank; returns the rank's exit code. A session runs each of its calls this way
    (``keep``: which of its names the notebook's do not replace)."""
    from nbshard.pickling import write_result

    try:
        fn, args, kwargs = pickle.loads(payload)
    except Exception as error:
        write_error(paths, rank, error, hint=(
            "nbshard could not load the job in this rank: it refers by name to something not "
            "importable here. Install it in this Python environment, make it importable from the "
            "job's cwd, or pass pickle_by_value=[module]."
        ))
        return 1
    _install_notebook_main(_notebook_objects(fn, args, kwargs), paths.notebook_main(rank), keep)
    try:
        value = call(fn, args, kwargs)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            write_error(paths, rank, stop)
            return stop.code if isinstance(stop.code, int) else 1
        value = None
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the kernel
        write_error(paths, rank, error)
        return 1
    try:
        write_result(paths.result(rank), value if keep_result else None)
    except Exception as error:  # noqa: BLE001
        write_error(paths, rank, error.with_traceback(None))
        return 1
    return 0


def _run(run_dir: RunDir, rank: int) -> int:
    launch = LaunchSpec.read(run_dir.launch)
    _use_kernel_path(launch.sys_path)
    _start_monitor(run_dir, rank, launch)
    if launch.session:
        from nbshard import session_rank

        return session_rank.serve(run_dir, rank, launch)
    return run_job(run_dir, rank, run_dir.job.read_bytes(), keep_result=rank == 0 or launch.return_all)


def _exit(code: int) -> None:
    """Run atexit handlers, flush, and leave without the interpreter's teardown."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream cannot be helped
            pass
    os._exit(code)


def main(run_dir: str) -> int:
    """Run this rank of the job in ``run_dir``; returns the exit code (tests call it in-process)."""
    paths = RunDir(Path(run_dir))
    rank = int(os.environ["RANK"])
    # What an interactive Python has: code that parses the command line (litgpt's
    # save_hyperparameters, argparse defaults) sees no nbshard paths. ps still shows them.
    sys.argv = [""]
    _die_with_launcher()
    _dump_stacks_on_request(paths.stacks(rank))
    try:
        return _run(paths, rank)
    finally:
        monitor.stop()


def run_as_main(namespace: dict[str, Any]) -> None:
    """``python -m nbshard.worker RUN_DIR``: run the rank from the importable copy of
    this module, with ``__main__`` emptied of this module's names (as a warm rank's is),
    so it holds the notebook's names (and a cell's) alone."""
    for name in [name for name in namespace if name not in MAIN_NAMES]:
        del namespace[name]
    namespace["__doc__"] = None
    _exit(main(sys.argv[1]))


def run_forked(run_dir: str) -> int:
    """A rank forked from a warm launcher: its ``__main__`` is already fresh (nbshard.fresh),
    and its memory is shown as its proportional share (PSS): it shares torch's pages."""
    monitor.count_proportional_memory()
    _exit(main(run_dir))
    return 1  # not reached: _exit ends the process


def _restore_notebook_main() -> None:
    path = os.environ.get(NOTEBOOK_MAIN_ENV)
    if path:
        globals().update(pickle.loads(Path(path).read_bytes()))


if __name__ == "__mp_main__":  # a spawn-started child of a rank, e.g. a DataLoader worker
    _restore_notebook_main()

if __name__ == "__main__":
    import nbshard.worker

    nbshard.worker.run_as_main(vars())
