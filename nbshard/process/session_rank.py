"""A rank of a persistent session: run call after call in one namespace.

The launcher holds the other ends of two pipes: on one it writes ``CALL DIGEST ALL [JOB]``
lines (the call's files are in ``calls/CALL`` of the session's run directory; its pickled job,
which must hash to DIGEST, is JOB in base64, or the file ``calls/CALL/job.pkl`` without it) and
``interrupt CALL``, on the other this rank answers ``ready`` once, then ``CALL STATUS
COLLECTIVES VALUE SAMPLE`` when each call is over (STATUS: ``ok``; ``error``: the function raised;
``unsent``: it returned, but its value could not be sent back; ``interrupted``; VALUE: the call's pickled value in base64
where the kernel asked for it and it took at most ``VALUE_INLINE_MAX`` bytes, else ``-`` and
the file ``calls/CALL/result-RANK.pkl``; SAMPLE: the rank's memory sample as JSON, ``null``
where memory is not sampled). ``postmortem`` opens pdb at the last failed call's error (its
traceback is kept until the next call), answered as ``postmortem done - - null`` once pdb is
left (``none``: no call failed here). End-of-file on the first closes the session.
Nothing arrives on a socket, and nothing is unpickled that the kernel did not hash.
"""

from __future__ import annotations

import base64
import bdb
import binascii
import hashlib
import json
import os
import signal
import sys
import types
from pathlib import Path
from typing import Any

from nbshard.contracts import LaunchSpec
from nbshard.files import write_json
from nbshard.pickling import is_notebook_code
from nbshard.job import POST_MORTEM
from nbshard.run_dir import RunDir

__all__ = ["PIPES_ENV", "collectives_issued", "in_session", "serve"]

PIPES_ENV = "NBSHARD_SESSION_FDS"  # "READ,WRITE": this rank's ends of its two pipes to the launcher
VALUE_INLINE_MAX = 16 * 1024  # bytes: a call's pickled value up to this size rides in the rank's answer, no file


class _State:
    """Where the rank is: an interrupt stops a call, never the loop that waits for the next one."""

    assigned = False  # from reading a call's command until its function starts: an interrupt waits
    in_call = False  # in the call's function: an interrupt raises KeyboardInterrupt there
    pending = False
    interrupted = False
    returned = False  # the call's function returned (its value may still fail to pickle)
    failure: types.TracebackType | None = None  # the last failed call's traceback, for a post-mortem


def _on_interrupt(signum: int, frame: Any) -> None:
    if _State.in_call:
        raise KeyboardInterrupt
    if _State.assigned:  # the call is still being loaded: it starts interrupted
        _State.pending = True


def collectives_issued() -> int | None:
    """How many collectives this rank has issued on the default process group (None without
    one). Ranks whose counts differ would pair the wrong tensors in the next collective."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a backend without sequence numbers: nothing to compare
        return None




def in_session(fn: Any, namespace: dict[str, Any]) -> dict[str, Any] | None:
    """Let a notebook function see the session's names: those it reads that the session holds
    win over the notebook's values (its functions and classes are taken fresh), and what it
    binds (``global model``) stays. Returns the globals to keep after it (None for others)."""
    if not isinstance(fn, types.FunctionType) or fn.__module__ != "__main__":
        return None
    shipped = fn.__globals__
    for name, value in namespace.items():
        if name.startswith("__"):
            continue
        if name not in shipped or not is_notebook_code(shipped[name]):
            shipped[name] = value
    return shipped


def _keep(namespace: dict[str, Any], shipped: dict[str, Any] | None) -> None:
    if shipped is not None and shipped is not namespace:
        namespace.update((name, value) for name, value in shipped.items() if not name.startswith("__"))


class _Commands:
    """The launcher's lines: ``CALL DIGEST ALL`` starts a call, ``interrupt CALL`` stops it
    (also sent in-band, so a call interrupted before its function started never starts it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def next(self) -> str | None:
        """The next command (waiting for it); None once the launcher closed the session."""
        while b"\n" not in self.buffer:
            data = os.read(self.fd, 1 << 16)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def interrupted(self, call: str) -> bool:
        """Whether an interrupt of ``call`` has arrived (without waiting for one)."""
        os.set_blocking(self.fd, False)
        try:
            while data := os.read(self.fd, 4096):
                self.buffer += data
        except BlockingIOError:
            pass
        finally:
            os.set_blocking(self.fd, True)
        return f"interrupt {call}\n".encode() in self.buffer


def _verified(path: Path, digest: str, inline: list[str]) -> bytes | None:
    """The call's job: sent in its line (``inline``) or the file ``path``, if it hashes to ``digest``."""
    try:
        data = base64.b64decode(inline[0], validate=True) if inline else path.read_bytes()
    except binascii.Error:
        return None
    return data if hashlib.sha256(data).hexdigest() == digest else None


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data`` on the pipe: a line over the pipe's atomic size may be written in parts
    (a signal arriving mid-write), and the launcher must never read half an answer as whole."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(run_dir: RunDir, rank: int, launch: LaunchSpec) -> int:
    """Answer the launcher's calls until it closes the session; returns the exit code."""
    from nbshard.process import calls, debugger
    from nbshard.rank import monitor

    read_fd, write_fd = (int(fd) for fd in os.environ.pop(PIPES_ENV).split(","))
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, False)
    commands = _Commands(read_fd)
    signal.signal(signal.SIGINT, _on_interrupt)
    os.write(write_fd, b"ready\n")  # from now on an interrupt is this module's to handle
    namespace = vars(sys.modules["__main__"])
    namespace["rank"], namespace["world_size"] = rank, int(os.environ["WORLD_SIZE"])

    def call_in_session(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        shipped = in_session(fn, namespace)
        _State.in_call, _State.assigned = True, False
        try:
            if _State.pending or commands.interrupted(call):
                raise KeyboardInterrupt
            value = calls.call_job(fn, args, kwargs)
            _State.returned = True
            return value
        except (KeyboardInterrupt, bdb.BdbQuit):  # an interrupt, or a quit in this rank's debugger
            _State.interrupted = True
            raise
        except BaseException as error:
            _State.failure = calls.user_traceback(error.__traceback__)  # its frames (and their locals) stay for %shard_debug
            raise
        finally:
            _State.in_call = False
            _keep(namespace, shipped)

    names_sent: list[str] | None = None  # rank 0's names as the kernel last read them
    while (line := commands.next()) is not None:
        if line.startswith("interrupt "):
            continue  # for a call that has ended
        if line == POST_MORTEM:
            found = _State.failure is not None
            if found:
                debugger.post_mortem(_State.failure)  # type: ignore[arg-type]
            os.write(write_fd, f"{POST_MORTEM} {'done' if found else 'none'} - - null\n".encode())
            continue
        call, digest, return_all, *inline = line.split()
        paths = RunDir(run_dir.path / "calls" / call)
        _State.assigned, _State.pending, _State.interrupted, _State.returned, _State.failure = True, False, False, False, None
        signal.signal(signal.SIGINT, _on_interrupt)  # a call may have set its own (Lightning ignores it)
        payload = _verified(paths.job, digest, inline)
        value = None
        if payload is None:
            sent = "the job sent with the call" if inline else f"the job file {paths.job}"
            calls.write_error(paths, rank, ValueError(f"{sent} is not the one the kernel wrote"))
            status = "error"
        else:
            code, value = calls.run_job(
                paths, rank, payload, keep_result=rank == 0 or return_all == "1", mark_success=False, call=call_in_session, announce=False,
                keep=lambda name, value: not is_notebook_code(value), main_file=run_dir.notebook_main(rank), inline_max=VALUE_INLINE_MAX,
            )
            status = "interrupted" if _State.interrupted else "ok" if code == 0 else "unsent" if _State.returned else "error"
        _State.assigned = False
        if rank == 0 and (names := sorted(name for name in namespace if not name.startswith("__"))) != names_sent:
            write_json(paths.names, names)  # the kernel keeps the last call's names when a call writes none
            names_sent = names
        count = collectives_issued()
        # What the rank holds after the call rides with its answer: the kernel has it before the call's end.
        sample = monitor.take_sample()
        sent = "-" if value is None else base64.b64encode(value).decode()
        _write_all(write_fd, f"{call} {status} {'-' if count is None else count} {sent} {json.dumps(sample, separators=(',', ':'))}\n".encode())
    return 0
