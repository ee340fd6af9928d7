"""The entry point of each rank: ``python -m nbshard.worker RUN_DIR`` (a shim that calls ``run_as_main``).

Loads the job, runs the function, writes the outcome (``result-R.pkl`` or
``error-R.json``) atomically, then ends the process with ``os._exit`` after
running ``atexit`` handlers and flushing, because gloo ranks otherwise abort
at interpreter exit now and then ("terminate called without an active
exception") after the user's code has finished.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

from nbshard.rank import memory_sample, monitor
from nbshard.contracts import LaunchSpec
from nbshard.process import debugger, inner_launchers
from nbshard.process.calls import NOTEBOOK_MAIN_ENV, call_job, run_job
from nbshard.files import open_private
from nbshard.process.fresh import MAIN_NAMES
from nbshard.run_dir import RunDir
from nbshard.stacks import MAIN_THREAD_HEADER, THREAD_NAME_HEADER

__all__ = ["main", "restore_notebook_main", "run_as_main", "run_forked"]

_PR_SET_PDEATHSIG = 1
_stacks_file: Any = None  # where faulthandler writes this rank's stacks on request


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
    global _stacks_file
    _stacks_file = stacks = open_private(path, "w")  # noqa: SIM115 - faulthandler holds it for the life of the rank
    stacks.write(f"{MAIN_THREAD_HEADER}0x{threading.main_thread().ident:016x}\n")
    stacks.flush()
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)


def _use_kernel_path(kernel_path: list[str]) -> None:
    """Make the notebook's import path (helper modules, sys.path edits) the rank's too."""
    missing = [entry for entry in kernel_path if entry not in sys.path]
    sys.path[:0] = missing


def _start_monitor(run_dir: RunDir, rank: int, launch: LaunchSpec) -> None:
    try:
        monitor.start(launch.address, run_dir.key.read_bytes(), rank, launch.sample_interval, str(run_dir.metrics(rank)),
                      str(run_dir.last_sample(rank)))
    except Exception as error:  # noqa: BLE001 - telemetry must never fail a job
        print(f"nbshard: memory sampling is off in rank {rank}: {error!r}", file=sys.stderr)


def _run(run_dir: RunDir, rank: int) -> int:
    launch = LaunchSpec.read(run_dir.launch)
    _use_kernel_path(launch.sys_path)
    inner_launchers.install()
    _start_monitor(run_dir, rank, launch)
    if launch.session:
        from nbshard.process import session_rank

        return session_rank.serve(run_dir, rank, launch)
    call = call_job
    if launch.profile:
        from nbshard.rank.profiling import profiled

        call = profiled(run_dir, rank, call_job)
    return run_job(run_dir, rank, run_dir.job.read_bytes(), keep_result=rank == 0 or launch.return_all, call=call)[0]


def _skip_torch_library_finalizers() -> None:
    """torch.library's finalizers deregister operators one by one at exit (``torch._C.reset``,
    ~0.1 ms each: 20 ms of every rank's exit with lightning imported, 174 of them), for a
    process that is about to end without its interpreter's teardown: they undo nothing that
    outlives it. Every other atexit handler (the user's, a logger's flush) still runs."""
    registry = getattr(weakref.finalize, "_registry", None)  # private: without it, they simply run
    for finalizer in list(registry or ()):
        found = finalizer.peek()
        if found is not None and getattr(found[1], "__module__", None) == "torch.library":
            finalizer.atexit = False


def _join_threads() -> None:
    """Wait for the threads the job started that are not daemons, as Python does before a
    script exits (``threading._shutdown``): work a ThreadPoolExecutor still holds (an async
    checkpoint's write, an upload in the background) is finished, not cut off."""
    shutdown = getattr(threading, "_shutdown", None)  # private: without it, they are not waited for
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        return
    waited = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if waited and _stacks_file is not None:  # their names, for a dump taken while they are waited for
        with contextlib.suppress(OSError, ValueError):
            names = (" ".join(str(t.name).split())[:100] for t in waited)  # one line each, whatever a name holds
            _stacks_file.write("".join(f"{THREAD_NAME_HEADER}0x{t.ident or 0:016x} {name}\n" for t, name in zip(waited, names)))
            _stacks_file.flush()
    shutdown()


def _exit(code: int) -> None:
    """Leave as a script does (after a success, the job's non-daemon threads are waited for;
    then atexit handlers run and the streams are flushed), without the interpreter's teardown.
    A failed rank does not wait for its threads: the launcher learns of a failure from its
    exit, and stops the other ranks then."""
    _skip_torch_library_finalizers()
    if code == 0:
        _join_threads()
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
    debugger.install(rank)
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
    """A rank forked from a warm launcher: its ``__main__`` is already fresh (nbshard.process.fresh),
    and its memory is shown as its proportional share (PSS): it shares torch's pages."""
    memory_sample.count_proportional_memory()
    _exit(main(run_dir))
    return 1  # not reached: _exit ends the process


def restore_notebook_main(namespace: dict[str, Any]) -> None:
    """In a spawn-started child of a rank (a DataLoader worker), which re-imports the rank's
    ``__main__`` as ``__mp_main__``: the notebook's names, as the rank had them."""
    path = os.environ.get(NOTEBOOK_MAIN_ENV)
    if path:
        namespace.update(pickle.loads(Path(path).read_bytes()))
