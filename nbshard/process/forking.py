"""Fork a fresh-looking launcher or rank from a warm process, and watch it like a Popen.

Only ever called from a process with exactly one thread (the warm process, or a
launcher forked from it before it opens its socket to the kernel): forking a
process with other threads can copy a lock some thread held, forever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from nbshard.process.fresh import become_fresh

__all__ = ["ForkedProcess", "fork_child", "fork_fresh", "fork_rank"]


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def fork_child(body: Callable[[], int], *, new_session: bool = False) -> int:
    """Fork a child that runs ``body()`` and exits with its code; returns its pid. The child
    never returns from here, into the parent's code, whatever happens in it."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if new_session:
            os.setsid()
        code = body()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - say why on the child's own stderr
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        _flush_and_exit(code)
    raise AssertionError("unreachable")  # pragma: no cover


def fork_fresh(
    main: Callable[[], int], *, module: str, run_dir: str, env: Mapping[str, str], cwd: str,
    stdio: Sequence[int], keep: Mapping[int, int] | None = None, new_session: bool = False,
    imports_invalidated: bool = False,
) -> int:
    """Fork a child that becomes ``python -m module run_dir`` (see nbshard.process.fresh) and runs
    ``main()``; returns its pid."""

    def body() -> int:
        become_fresh(module=module, run_dir=run_dir, env=env, cwd=cwd, stdio=stdio, keep=keep, imports_invalidated=imports_invalidated)
        return main()

    return fork_child(body, new_session=new_session)


class ForkedProcess:
    """A forked child with the ``subprocess.Popen`` verbs the launcher uses."""

    def __init__(self, pid: int, stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"process {self.pid} still runs after {timeout} s")
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_rank(
    main: Callable[[], int], *, run_dir: str, env: Mapping[str, str], cwd: str, keep: Sequence[int] = (),
    imports_invalidated: bool = False,
) -> ForkedProcess:
    """A rank forked from a single-threaded launcher: stdin from /dev/null, stdout and stderr
    to pipes the launcher reads, exactly as its cold ranks are started; ``keep``: fds it keeps;
    ``imports_invalidated``: see become_fresh."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        pid = fork_fresh(main, module="nbshard.worker", run_dir=run_dir, env=env, cwd=cwd, stdio=(null, out_write, err_write),
                          keep={fd: fd for fd in keep}, imports_invalidated=imports_invalidated)
    except BaseException:
        for fd in (out_read, err_read):
            os.close(fd)
        raise
    finally:
        for fd in (out_write, err_write, null):
            os.close(fd)
    return ForkedProcess(pid, os.fdopen(out_read, "rb", buffering=0), os.fdopen(err_read, "rb", buffering=0))
