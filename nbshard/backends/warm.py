"""The kernel's side of warm start: one warm process per kernel, and launchers forked by it.

``warm_launch`` either returns a launcher that the warm process forked, or says
in one short line why this launch is cold (the caller then starts a cold one):
the warm process is still importing, it could not be made safe to fork, the
job's environment differs from it in a variable read at import time, a module
it imported changed on disk, or it died, was stopped or did not answer. In all
but the second case it is replaced in the background, so a later launch is warm
again; each such event is said once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nbshard.backends.channel import Channel
from nbshard.errors import how_it_ended
from nbshard.backends.warm_launcher import WarmLauncher, process_state
from nbshard.files import open_private
from nbshard.environment import TORCHRUN_VARIABLES, import_time_environment
from nbshard.run_dir import RunDir
from nbshard.leftovers import hold_alive

__all__ = ["WarmLauncher", "WarmProcess", "close_warm", "restart_warm", "start_pending_warm", "warm_launch", "warm_status"]

REPLY_WAIT = 10.0  # seconds the warm process may take to fork a launcher
ANSWER_CHECK = 0.1  # while waiting, how often the kernel checks that the warm process can still answer
_COMMAND_LINE_ROOM = 4200  # empty arguments: room for a forked process to show its own command line
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch.cuda.is_available() without initializing CUDA


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why the warm process did not fork a launcher. ``replace``: a new one would (a module it
    imported changed); ``lost``: it cannot answer any more (it died, was stopped, or hangs)."""

    reason: str
    replace: bool = False
    lost: bool = False


class WarmProcess:
    """One warm process: started, asked to fork launchers, replaced, closed."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str], cwd: str) -> None:
        self.preload = tuple(preload)
        self.signature = import_time_environment(env, self.preload)
        env = {k: v for k, v in env.items() if k not in TORCHRUN_VARIABLES}
        env.setdefault("OMP_NUM_THREADS", "1")  # as most ranks have it; OpenBLAS would start a thread without
        self.directory = Path(tempfile.mkdtemp(prefix="nbshard-warm-"))  # 0700, this user's
        self.token = secrets.token_hex(32)
        self.started = time.time()
        self.log = self.directory / "warm.log"
        alive = hold_alive(self.directory)  # held by the warm process from its first instant to its end
        try:
            with open_private(self.log, "wb") as log:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", "nbshard.process.forkserver", str(self.directory), *[""] * _COMMAND_LINE_ROOM],
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, pass_fds=(alive,),
                    env={**env, _NVML_CHECK: env.get(_NVML_CHECK, "1")}, start_new_session=True,
                )
        finally:
            os.close(alive)
        config = {"token": self.token, "preload": list(self.preload), "kernel_pid": os.getpid()}
        assert self._popen.stdin is not None
        self._popen.stdin.write(json.dumps(config).encode() + b"\n")
        self._popen.stdin.flush()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def status(self) -> dict[str, Any]:
        """``{"state": "starting" | "ready" | "failed" | "exited", ...}``."""
        try:
            status = json.loads((self.directory / "status.json").read_text())
        except (OSError, ValueError):
            status = None
        exited = self._popen.poll() is not None
        if status is not None and not status.get("ready"):
            return {"state": "failed", "reason": status.get("reason", "unknown"), "log": str(self.log)}
        if exited:
            return {"state": "exited", "reason": f"the warm process exited with code {self._popen.returncode}", "log": str(self.log)}
        if status is None:
            return {"state": "starting", "pid": self.pid, "since": self.started}
        return {"state": "ready", **status, "signature": self.signature, "log": str(self.log)}

    def unable(self) -> str | None:
        """Why this warm process cannot answer (it exited, or was stopped); None while it can."""
        code = self._popen.poll()
        if code is not None:
            return how_it_ended(code)
        if process_state(self.pid) in ("T", "t"):
            return "was stopped (SIGSTOP, or a debugger holds it) and cannot answer"
        return None

    def launch(self, run_dir: RunDir, env: Mapping[str, str], cwd: str) -> WarmLauncher | Refusal:
        """A forked launcher, or why the warm process refused or could not answer."""
        channel = Channel()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            answer = self._request(connection, run_dir, env, cwd, channel.launcher_end.fileno())
        except BaseException:  # an interrupt while it answers: a launcher it forked reads the end of its input, and stops
            connection.close()
            channel.close()
            raise
        finally:
            channel.launcher_started()
        if isinstance(answer, Refusal):
            connection.close()
            channel.close()
            return answer
        return WarmLauncher(answer, connection, channel)

    def _request(self, connection: socket.socket, run_dir: RunDir, env: Mapping[str, str], cwd: str, commands: int) -> int | Refusal:
        """The forked launcher's pid, or the refusal."""
        try:
            connection.settimeout(REPLY_WAIT)
            connection.connect(str(self.directory / "socket"))
            with open_private(run_dir.launcher_log, "ab") as log:
                message = json.dumps({"token": self.token, "run_dir": str(run_dir.path), "env": dict(env), "cwd": cwd})
                socket.send_fds(connection, [message.encode()], [commands, log.fileno(), log.fileno()])
            data = self._reply(connection)
            if data is None:
                why = self.unable() or f"did not answer within {REPLY_WAIT:g} s"
                return Refusal(f"the warm process (pid {self.pid}) {why}", lost=True)
            reply = json.loads(data or b'{"refused": "the warm process closed the connection"}')
        except (OSError, ValueError) as error:  # a live warm process always answers, if only to refuse
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(ANSWER_CHECK)  # one dying now is gone in a moment: say how it ended
            return Refusal(f"the warm process (pid {self.pid}) {self.unable() or f'did not answer ({error})'}", lost=True)
        if "pid" not in reply:
            return Refusal(str(reply["refused"]), replace=bool(reply.get("stale")))
        return int(reply["pid"])

    def _reply(self, connection: socket.socket) -> bytes | None:
        """The warm process's answer, or None once it cannot answer (checked every
        ``ANSWER_CHECK`` s, so a warm process that died or was stopped costs no long wait)."""
        connection.settimeout(ANSWER_CHECK)
        deadline = time.monotonic() + REPLY_WAIT
        while time.monotonic() < deadline:
            try:
                return connection.recv(4096)
            except TimeoutError:
                if self.unable() is not None:
                    return None
        return None

    def close(self, kill: bool = False) -> None:
        """Stop taking requests; the warm process exits once the launchers it forked end (with
        ``kill`` at once: the launchers, in sessions of their own, run on)."""
        if self._popen.stdin is not None:
            with contextlib.suppress(OSError):
                self._popen.stdin.close()
        if self._popen.poll() is None and (kill or not self._forked_launchers()):
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(0.5 if self._popen.poll() is None else 0)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _forked_launchers(self) -> bool:
        with contextlib.suppress(OSError):
            return bool(Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split())
        return False


_current: WarmProcess | None = None
_pending: tuple[Mapping[str, str], tuple[str, ...], str] | None = None  # a warm process to start after this launch
_said: set[str] = set()  # reasons already shown in a cell: one note per reason per kernel
_lost_in_a_row = 0  # warm processes lost since a warm launch last worked
_off: str | None = None  # why warm start stays off until restart_warm()
MAX_LOST_IN_A_ROW = 3  # replaced that often without a warm launch between, warm start stays off


FIRST_LAUNCH = (
    "cold start: the first launch in this kernel starts fresh Python processes, each importing torch "
    "(seconds); a warm process now starts in the background, and the next launches fork from it"
)


def _once(note: str) -> str | None:
    if note in _said:
        return None
    _said.add(note)
    return note


def warm_launch(
    run_dir: RunDir, env: Mapping[str, str], cwd: str, *, preload: Sequence[str], rank_env: Mapping[str, str]
) -> tuple[WarmLauncher | None, str | None]:
    """A launcher forked by the warm process, or None and the note that says why not
    (None when that reason was already said in this kernel). Starts or replaces the warm
    process for the next launch where that helps."""
    global _pending, _lost_in_a_row
    wanted = import_time_environment(rank_env, tuple(preload))
    if _off is not None:
        return None, _once(f"warm start is off for this kernel: {_off}; nbshard.restart_warm() tries again")
    if _current is None:
        _pending = (rank_env, tuple(preload), cwd)
        return None, _once(FIRST_LAUNCH)
    if _current.preload != tuple(preload) or _current.signature != wanted:
        differs = sorted(k for k in {*wanted, *_current.signature} if wanted.get(k) != _current.signature.get(k))
        _pending = (rank_env, tuple(preload), cwd)
        what = f"the environment differs in {', '.join(differs)}, read at import" if differs else "the preloads changed"
        return None, f"cold start: {what}; the warm process is being replaced to match"
    status, unable = _current.status(), _current.unable()
    if unable is not None and status["state"] != "failed":  # it was ready, or starting
        return None, _lost(_current, f"the warm process (pid {_current.pid}) {unable}", rank_env, preload, cwd)
    if status["state"] == "starting":
        return None, _once("cold start: the warm process is still importing; the next launches fork from it")
    if status["state"] != "ready":
        return None, _once(
            f"warm start is off for this kernel: {status['reason']} (see {status['log']}); once that is "
            "fixed, nbshard.restart_warm() starts a new warm process"
        )
    launched = _current.launch(run_dir, env, cwd)
    if isinstance(launched, Refusal):
        if launched.lost:
            return None, _lost(_current, launched.reason, rank_env, preload, cwd)
        if launched.replace:
            _pending = (rank_env, tuple(preload), cwd)
            return None, f"cold start: {launched.reason}; the warm process is being replaced"
        return None, f"cold start: {launched.reason}"
    _lost_in_a_row = 0
    return launched, None


def _lost(process: WarmProcess, why: str, rank_env: Mapping[str, str], preload: Sequence[str], cwd: str) -> str:
    """The warm process cannot answer: it goes (its launchers, in sessions of their own, run on)
    and a new one starts after this cold launch, unless the last ones were lost too; the note
    says so, once for this event."""
    global _current, _pending, _lost_in_a_row, _off
    process.close(kill=True)
    _current = None
    _lost_in_a_row += 1
    if _lost_in_a_row > MAX_LOST_IN_A_ROW:
        _off = f"{MAX_LOST_IN_A_ROW + 1} warm processes in a row were lost before a job could use them (the last: {why})"
        return f"cold start: {why}; warm start is now off for this kernel; nbshard.restart_warm() tries again"
    _pending = (rank_env, tuple(preload), cwd)
    return f"cold start: {why}; a new warm process is starting in the background for the next launches"


def start_pending_warm() -> None:
    """Start (or replace) the warm process that ``warm_launch`` found wanting; called after
    the cold launch, so the two do not compete for the CPU before the job starts."""
    global _pending
    if _pending is not None:
        _replace(*_pending)
        _pending = None


def _replace(env: Mapping[str, str], preload: Sequence[str], cwd: str) -> None:
    global _current
    if _current is not None:
        _current.close()
    _current = WarmProcess(env, preload, cwd)


def warm_status() -> dict[str, Any]:
    """The warm process's state: ``starting``, ``ready`` (pid, seconds it took, preloads),
    ``failed`` (why), ``exited``, or ``none`` before the first launch."""
    return _current.status() if _current is not None else {"state": "none"}


def restart_warm(env: Mapping[str, str], preload: Sequence[str], cwd: str) -> None:
    """Replace the warm process now (e.g. after installing a package)."""
    global _off, _lost_in_a_row
    _off, _lost_in_a_row = None, 0
    _replace(env, preload, cwd)


def close_warm() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None
