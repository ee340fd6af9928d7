"""The warm process: ``python -m nbshard.forkserver DIR``, one per kernel.

It imports torch (and what ``nbshard.settings.preload`` names) once, checks that
forking it is safe (one thread, no CUDA, a probe child not in a "bad fork"),
then forks a fresh launcher for each job the kernel asks for; that launcher
forks its ranks. It never runs user code itself. While idle it keeps one
launcher forked ahead (nbshard.process.spare), which takes the next job.

The kernel starts it in a session of its own and writes one JSON line to its
stdin: a token, the modules to preload, the kernel's pid. Requests arrive on a
Unix socket in DIR (mode 0700): one JSON message (no pickle) with the peer's
uid checked and the token compared, and three file descriptors passed along
(the launcher's command pipe and log). The reply is the launcher's pid, later
its exit code. When the kernel dies (its pidfd, or the pipe's end) it stops
taking requests and exits once its launchers, which watch the kernel too, end.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import importlib
import json
import os
import selectors
import shutil
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from nbshard.files import write_json
from nbshard.process.forking import fork_fresh
from nbshard.process.module_watch import ModuleWatch, module_files
from nbshard.process.spare import Spare, fork_spare

__all__ = ["MAX_REQUEST_BYTES", "main"]

MAX_REQUEST_BYTES = 1 << 20
SOCKET_NAME = "socket"
STATUS_NAME = "status.json"
KERNEL_PIDFD_IN_LAUNCHER = 3
# The next spare is forked once a launcher ends, or this long after a launch (a long job): not
# while a launch is starting its ranks, which has the CPUs first.
SPARE_DELAY = 1.0
SPARE = "spare"  # the selector's mark for the waiting spare's pidfd
_ALWAYS = (
    "nbshard.process.entry", "nbshard.process.worker", "nbshard.pickling", "nbshard.results", "nbshard.rank.monitor", "nbshard.kernel.cell",
)


def _write_status(directory: Path, status: dict[str, Any]) -> None:
    write_json(directory / STATUS_NAME, status)


# Threads a fork copies safely: jemalloc, which some wheels bundle (on an H200 image
# `import lightning` started its background thread), takes its locks in pthread_atfork
# handlers and starts that thread anew in the child when it needs one.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def _other_threads() -> list[str]:
    """The names of this process's threads besides the main one that a fork could break."""
    names = []
    for task in os.listdir("/proc/self/task"):
        if int(task) == os.getpid():
            continue
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # it ended meanwhile
            continue
        if name not in FORK_SAFE_THREADS:
            names.append(name)
    return names


def _unsafe_to_fork() -> str | None:
    """Why forking this process now could hand a child a broken state; None when it is safe."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # first: CUDA's own threads are its symptom
        return "a preload initialized CUDA, which a forked process cannot use"
    others = _other_threads()
    if others:
        return (
            f"after the preloads this process runs {len(others) + 1} threads (besides the main one: "
            f"{', '.join(sorted(set(others)))}; a library started one at import; "
            "numpy's OpenBLAS does unless OMP_NUM_THREADS or OPENBLAS_NUM_THREADS is set), and forking a "
            "threaded process can copy a held lock"
        )
    if torch is None:
        return None
    probe = os.fork()
    if probe == 0:
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(probe, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return "a probe fork reports a bad fork (CUDA state was initialized by a preload)"
    return None


class WarmServer:
    def __init__(self, directory: Path, token: str, kernel_pidfd: int) -> None:
        self.directory = directory
        self.token = token.encode()
        self.kernel_pidfd = kernel_pidfd
        self.modules = ModuleWatch(module_files())
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path = directory / SOCKET_NAME
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(16)
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "kernel")
        self.selector.register(kernel_pidfd, selectors.EVENT_READ, "kernel")
        self.launchers: dict[int, tuple[socket.socket, int]] = {}  # pid -> (its requester, its pidfd)
        self.spare: Spare | None = None
        self.spare_due: float | None = time.monotonic()  # when to fork the next spare; None: not now
        self.spares = True  # off once one died while it waited

    def serve(self) -> None:
        while self.listener is not None or self.launchers:
            if self.spare_due is not None and time.monotonic() >= self.spare_due:
                self.fork_spare()
            wait = None if self.spare_due is None else max(0.0, self.spare_due - time.monotonic())
            for key, _ in self.selector.select(wait):
                if key.data == "listen" and self.listener is not None:
                    connection, _ = self.listener.accept()
                    self.selector.register(connection, selectors.EVENT_READ, "request")
                elif key.data == "request":
                    self.answer(key.fileobj)  # type: ignore[arg-type]
                elif key.data == "kernel":
                    self.stop_listening()
                elif key.data == SPARE and (spare := self.take_spare()) is not None:
                    self.spare_died(spare)
                elif isinstance(key.data, int):
                    self.report_exit(key.data)

    def stop_listening(self) -> None:
        """The kernel is gone: take no more requests; the launchers end on their own."""
        for fd in (sys.stdin.fileno(), self.kernel_pidfd):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(fd)
        self.spares = False
        if (spare := self.take_spare()) is not None:
            spare.discard()
        if self.listener is not None:
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None
            (self.directory / SOCKET_NAME).unlink(missing_ok=True)

    def answer(self, connection: socket.socket) -> None:
        self.selector.unregister(connection)
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST_BYTES, 3)
            reply = self.launch(connection, data, fds)
        except Exception as error:  # noqa: BLE001 - a bad request never takes the warm process down
            reply = {"refused": f"the warm process could not launch: {error!r}"}
        finally:
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(OSError):
            connection.send(json.dumps(reply).encode())
        if "pid" not in reply:
            connection.close()

    def launch(self, connection: socket.socket, data: bytes, fds: list[int]) -> dict[str, Any]:
        pid, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():
            return {"refused": f"a request from uid {uid} (pid {pid}), not this user's"}
        request = json.loads(data)
        if not hmac.compare_digest(str(request.get("token", "")).encode(), self.token) or len(fds) != 3:
            return {"refused": "a request without this kernel's token and descriptors"}
        changed = self.modules.changed()
        if changed is not None:
            return {"refused": f"{changed} changed on disk since the warm process imported it", "stale": True}
        job: dict[str, Any] = {"run_dir": str(request["run_dir"]), "env": dict(request["env"]), "cwd": str(request["cwd"])}
        spare = self.take_spare()
        if spare is not None and spare.hand_over(job, fds):
            child, pidfd = spare.pid, spare.pidfd
        else:
            if spare is not None:  # it ended, or was stopped, while it waited
                self.spare_died(spare)
            child = fork_fresh(
                lambda: _run_launcher(job["run_dir"]), module="nbshard.launcher", **job, stdio=fds,
                keep={KERNEL_PIDFD_IN_LAUNCHER: self.kernel_pidfd}, new_session=True,
            )
            pidfd = os.pidfd_open(child)
        self.launchers[child] = (connection, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, child)
        self.spare_due = time.monotonic() + SPARE_DELAY
        return {"pid": child}

    def take_spare(self) -> Spare | None:
        """The waiting spare, no longer watched here (its pidfd becomes a launcher's, or it goes)."""
        spare, self.spare = self.spare, None
        if spare is not None:
            self.selector.unregister(spare.pidfd)
        return spare

    def fork_spare(self) -> None:
        self.spare_due = None
        if self.spares and self.spare is None:
            self.spare = fork_spare("nbshard.launcher", {KERNEL_PIDFD_IN_LAUNCHER: self.kernel_pidfd}, _run_launcher)
            self.selector.register(self.spare.pidfd, selectors.EVENT_READ, SPARE)

    def spare_died(self, spare: Spare) -> None:
        """A spare ended while it waited (killed, or it failed to prepare): no more spares, so
        one that cannot prepare is not forked again and again; launches fork as they come."""
        spare.reap()
        self.spares = False

    def report_exit(self, pid: int) -> None:
        if self.spare is None:
            self.spare_due = time.monotonic()
        connection, pidfd = self.launchers.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
        connection.close()


def _run_launcher(run_dir: str) -> int:
    from nbshard.process import entry

    return entry.main(run_dir, kernel_pidfd=KERNEL_PIDFD_IN_LAUNCHER, fork_ranks=True)


def _kernel_pidfd(kernel_pid: int) -> int | None:
    """A pidfd of the kernel, taken while it is surely this process's parent (no pid reuse)."""
    try:
        pidfd = os.pidfd_open(kernel_pid)
    except OSError:
        return None
    return pidfd if os.getppid() == kernel_pid else None


def main(directory: str) -> int:
    """Preload, check, then serve the kernel's launch requests until it goes away. Once the
    kernel is gone this process removes the directory (the kernel cannot); while it lives, the
    kernel reads why a start failed there and removes it (a kernel that died meanwhile leaves
    it to the next nbshard start's sweep)."""
    started = time.monotonic()
    root = Path(directory)
    config = json.loads(sys.stdin.buffer.readline() or b"{}")
    kernel_pidfd = _kernel_pidfd(int(config.get("kernel_pid", 0)))
    if kernel_pidfd is None:  # the kernel is already gone (it may have died a moment after starting this)
        shutil.rmtree(root, ignore_errors=True)
        return 1
    problem = None
    for name in (*_ALWAYS, *config.get("preload", ())):
        try:
            importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 - an import may even exit; say why and stop
            problem = f"preloading {name} failed: {error!r}"
            break
    problem = problem or _unsafe_to_fork()
    if problem is not None:
        _write_status(root, {"ready": False, "reason": problem, "pid": os.getpid()})
        return 1
    gc.collect()
    gc.freeze()  # forked children never touch these objects' pages for garbage collection
    server = WarmServer(root, str(config["token"]), kernel_pidfd)
    _write_status(root, {
        "ready": True, "pid": os.getpid(), "seconds": round(time.monotonic() - started, 3),
        "preloaded": list(config.get("preload", ())), "modules": len(server.modules.files),
    })
    server.serve()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
