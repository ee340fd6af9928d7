"""Make a process forked from the warm process look freshly started, in one place.

A cold launcher or rank is ``python -m nbshard.<module> RUN_DIR`` started by
``subprocess``. A warm one is a fork of the warm process, which has imported
torch and holds its own sockets, signal handlers, environment, seeds and
``__main__``. ``become_fresh`` resets everything user code can see to what the
cold process would have; tests/test_warm.py compares the two field by field. It
comes in two parts: ``prepare_fresh`` needs no job (a spare launcher does it
while it waits for one), ``finish_fresh`` applies the job's environment.

What cannot be reset, and so makes the kernel launch cold instead (see
``import_time_environment``): the interpreter's start-up flags and hash seed,
the locale, and whatever a preloaded library read from the environment when it
was imported (OpenBLAS's thread count among them; OpenMP's plain count is applied).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import io
import os
import signal
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbshard.procfs import stat_fields

__all__ = ["MAIN_NAMES", "become_fresh", "cold_command", "finish_fresh", "install_stdio", "prepare_fresh"]

# What ``python -m`` puts in ``__main__`` before the module's own code runs; a rank's
# ``__main__`` holds these and the notebook's names, warm or cold.
MAIN_NAMES = ("__name__", "__doc__", "__package__", "__loader__", "__spec__", "__file__", "__cached__", "__builtins__")

# Signals CPython itself sets at start-up; every other one has its default action.
_PYTHON_STARTUP_SIGNALS: dict[int, Callable[[int, Any], Any] | int] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}


def cold_command(module: str, run_dir: str) -> list[str]:
    """The command line a cold process of ``module`` has (and a warm one shows)."""
    return [sys.executable, "-m", module, run_dir]


def _argv_area() -> tuple[int, int]:
    fields = stat_fields("self")
    if fields is None:
        raise OSError("/proc/self/stat cannot be read")
    return int(fields[45]), int(fields[46])  # arg_start and arg_end: fields 48 and 49 of proc(5)


def _show_command(argv: Sequence[str]) -> None:
    """Rewrite what ``ps`` and ``/proc/PID/cmdline`` show. The warm process was started with
    a command-line area large enough (empty arguments); the rest is zero-filled, which ps and
    pgrep do not show."""
    start, end = _argv_area()
    text = b"".join(os.fsencode(arg) + b"\0" for arg in argv)
    if len(text) > end - start:
        raise ValueError(f"command line of {len(text)} bytes does not fit the warm process's {end - start}")
    with open("/proc/self/mem", "r+b", buffering=0) as memory:
        memory.seek(start)
        memory.write(text.ljust(end - start, b"\0"))


def install_stdio(stdio: Sequence[int]) -> None:
    """fds 0, 1, 2 from ``stdio``, and sys.std* rebuilt as CPython builds them at start-up
    (same encoding, error handler and buffering as the warm process, which shares the
    environment and flags they derive from)."""
    for target, fd in enumerate(stdio):
        if fd != target:
            os.dup2(fd, target)
    for fd, (name, mode) in enumerate((("stdin", "rb"), ("stdout", "wb"), ("stderr", "wb"))):
        old: Any = getattr(sys, f"__{name}__")  # None where the warm process started without it
        raw = io.FileIO(fd, mode, closefd=False)
        raw.name = f"<{name}>"  # CPython names its std streams so
        buffer: Any = raw
        if old is None or not isinstance(old.buffer, io.RawIOBase):  # else python -u or PYTHONUNBUFFERED
            buffer = io.BufferedReader(raw) if mode == "rb" else io.BufferedWriter(raw)
        text = io.TextIOWrapper(
            buffer, encoding=old.encoding if old else None, newline="\n",
            errors=old.errors if old else "backslashreplace" if name == "stderr" else None,
            line_buffering=old.line_buffering if old else False, write_through=old.write_through if old else False,
        )
        text.mode = mode[0]  # type: ignore[misc]
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


def _close_inherited_fds(keep: Mapping[int, int]) -> None:
    """Nothing of the warm process, the kernel or other ranks stays open: only fds 0-2 and
    ``keep`` (target fd -> source fd, moved into place first) survive."""
    # Each moved fd is copied above every target first, so no move overwrites another's source.
    floor = max(keep, default=2) + 1
    staged = {target: fcntl.fcntl(source, fcntl.F_DUPFD, floor) for target, source in keep.items() if source != target}
    for target, copy in staged.items():
        os.dup2(copy, target)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, _PYTHON_STARTUP_SIGNALS.get(signum, signal.SIG_DFL))


def _set_environ(env: Mapping[str, str]) -> None:
    """``os.environ`` and the C library's environment (putenv/unsetenv) both become ``env``."""
    for name in list(os.environ):
        if name not in env:
            del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _fresh_main(module: str, spec: Any, argv0: str) -> None:
    """A ``__main__`` as ``python -m module`` has one, without the module's own names (the
    cold entry points empty it too), so the notebook's names are the only ones in it."""
    main = types.ModuleType("__main__")
    main.__file__ = argv0
    main.__cached__ = spec.cached if spec is not None else None  # type: ignore[attr-defined]
    main.__loader__ = spec.loader if spec is not None else None
    main.__spec__ = spec
    main.__package__ = module.rpartition(".")[0]
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main


def _reseed() -> None:
    """Every forked process would otherwise share the warm process's random state, where each
    cold process seeds its own (``random`` reseeds itself at fork)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):
        torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _apply_thread_pool(env: Mapping[str, str]) -> None:
    """torch's intra-op pool as a cold process would size it: OpenMP reads OMP_NUM_THREADS
    once, when it loads, which was in the warm process; unset, it is the number of CPUs
    this process may run on. (Other values than a plain count make the launch cold.)"""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    wanted = env.get("OMP_NUM_THREADS", "")
    count = int(wanted) if wanted.isdigit() and int(wanted) > 0 else len(os.sched_getaffinity(0))
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def prepare_fresh(keep: Mapping[int, int], *, invalidate_imports: bool = True) -> None:
    """The part of becoming fresh that needs no job: nothing inherited open but fds 0-2 and
    ``keep`` (target -> source), default signals, seeds of its own, and (unless the parent
    just did so before forking) import caches that list directories anew, as a new
    interpreter's do. A spare launcher does this while it waits for a job; it imports nothing
    meanwhile, so its caches see the disk as of the job's arrival."""
    _close_inherited_fds(dict(keep))
    _reset_signals()
    _reseed()
    if invalidate_imports:
        importlib.invalidate_caches()


def finish_fresh(*, module: str, run_dir: str, env: Mapping[str, str], cwd: str) -> None:
    """The part that depends on the job: ``env``, ``cwd``, the command line and ``__main__`` of
    ``python -m module run_dir``, and the thread pool ``env`` asks for."""
    _set_environ(env)
    os.chdir(cwd)
    cwd = os.getcwd()
    command = cold_command(module, run_dir)
    spec = importlib.util.find_spec(module)
    argv0 = spec.origin if spec is not None and spec.origin else module
    sys.argv = [argv0, run_dir]
    sys.orig_argv = command
    with contextlib.suppress(OSError, ValueError):
        _show_command(command)
    _fresh_main(module, spec, argv0)
    sys.path[0] = cwd  # python -m puts the working directory first
    _apply_thread_pool(env)


def become_fresh(
    *, module: str, run_dir: str, env: Mapping[str, str], cwd: str, stdio: Sequence[int], keep: Mapping[int, int] | None = None,
    imports_invalidated: bool = False,
) -> None:
    """Turn this just-forked child into what ``python -m module run_dir`` started with ``env``
    in ``cwd`` would be. ``keep`` maps fds to keep (target -> source) beyond stdio;
    ``imports_invalidated``: the parent invalidated its import caches just before the fork
    (cheap there: its pages are its own; here each finder's page would be copied)."""
    install_stdio(stdio)
    prepare_fresh(keep or {}, invalidate_imports=not imports_invalidated)
    finish_fresh(module=module, run_dir=run_dir, env=env, cwd=cwd)
