"""A rank's exception rebuilt in the kernel: the same object where it unpickles from modules
the kernel has, else one of the same type name and message; either way with the rank's frames
as a genuine traceback, whose lines come from the kernel's own line cache (where the source of
notebook cells lives), so IPython renders it exactly as a local one."""

from __future__ import annotations

import base64
import builtins
import io
import linecache
import pickle
import sys
from typing import Any

from nbshard.errors import RankFailure

__all__ = ["RemoteError", "remote_exception"]


class RemoteError(Exception):
    """An exception raised in a rank whose class the kernel does not rebuild.

    Subclassed on the fly with the remote class's name and module, so the
    traceback reads ``torch.distributed.DistBackendError: ...`` without the
    kernel importing torch.
    """


def _remote_class(module: str, name: str) -> type[BaseException]:
    return type(name, (RemoteError,), {"__module__": module, "__qualname__": name})


def _exception_class(qualified_name: str) -> type[BaseException]:
    module, _, name = qualified_name.rpartition(".")
    if module == "builtins":
        cls = getattr(builtins, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls
    return _remote_class(module or "builtins", name)


class _Marker(Exception):
    pass


def _raise_marker() -> None:
    raise _Marker


def _traceback_entry(frame: dict[str, Any]) -> Any:
    """A genuine traceback entry for one remote frame.

    The way tblib rebuilds tracebacks: run code compiled under the frame's
    file name that fails at its line, in a call spanning the frame's columns
    (or the whole line, so no misleading carets are drawn). Printing it looks
    the source up in the kernel's linecache, where IPython keeps cell sources.
    """
    filename, lineno = str(frame["filename"]), max(int(frame["lineno"]), 1)
    colno, end_colno = frame.get("colno"), frame.get("end_colno")
    if colno is None or end_colno is None or end_colno - colno < 3:
        line = linecache.getline(filename, lineno).rstrip()
        colno = len(line) - len(line.lstrip())
        end_colno = max(len(line), colno + 3)
    call = "_(" + " " * (end_colno - colno - 3) + ")"
    text = call if colno == 0 else "(" + " " * (colno - 1) + call + ")"
    # Line numbers count from the function's first line, as in the real code object,
    # so tools that show the whole function (IPython, inspect) find it in linecache.
    first = min(max(int(frame.get("firstlineno") or 1), 1), lineno)
    code = compile("\n" * (lineno - first) + text, filename, "exec")
    name = str(frame["name"])
    names: dict[str, Any] = {"co_name": name, **({"co_qualname": name} if hasattr(code, "co_qualname") else {})}
    code = code.replace(co_firstlineno=first, **names)
    try:
        exec(code, {"_": _raise_marker})
    except _Marker as marker:
        entry = marker.__traceback__.tb_next if marker.__traceback__ else None  # skip this function's own frame
        if entry is not None:
            entry.tb_next = None  # and _raise_marker's
            return entry
    raise RuntimeError("unreachable: the compiled code always raises, from a frame below this one")


class _KernelModulesOnly(pickle.Unpickler):
    """Unpickles what refers only to modules the kernel has already imported: an exception of
    torch's would otherwise import torch into a kernel that must stay torch-free."""

    def find_class(self, module: str, name: str) -> Any:
        if module not in sys.modules:
            raise pickle.UnpicklingError(f"its class comes from {module}, which the kernel has not imported")
        return super().find_class(module, name)


def _unpickled_exception(failure: RankFailure) -> tuple[BaseException | None, str]:
    """The rank's own exception object, or None and why it is not available."""
    if not failure.pickled:
        return None, failure.pickle_problem or "the rank sent only its text"
    try:
        exc = _KernelModulesOnly(io.BytesIO(base64.b64decode(failure.pickled))).load()
    except Exception as problem:  # noqa: BLE001 - any failure here only means: rebuild it from its text
        return None, f"it could not be unpickled in the kernel ({type(problem).__name__}: {problem})"
    if not isinstance(exc, BaseException):
        return None, f"it unpickled as a {type(exc).__name__}, not an exception"
    return exc, ""


def remote_exception(failure: RankFailure) -> BaseException:
    """The exception a rank raised, with the rank's traceback: the same object (class, args,
    attributes; unpickled) where it can be, else one equal in type name and message, with a
    note that says why it is only that."""
    if failure.exc_type is None:
        raise ValueError(f"rank {failure.rank} raised no exception: {failure.describe()}")
    exc, problem = _unpickled_exception(failure)
    if exc is None:
        cls = _exception_class(failure.exc_type)
        try:
            exc = cls(failure.message)
        except Exception:  # a builtin with an unusual constructor, e.g. UnicodeDecodeError
            exc = _remote_class("builtins", cls.__name__)(failure.message)
    traceback = None
    for frame in reversed(failure.frames):
        entry = _traceback_entry(frame)
        entry.tb_next = traceback
        traceback = entry
    exc.__traceback__ = traceback
    if hasattr(exc, "add_note"):  # Python 3.11+
        for note in failure.notes:
            if note not in getattr(exc, "__notes__", ()):  # an unpickled exception has its own already
                exc.add_note(note)
        exc.add_note(f"(raised in rank {failure.rank})")
        if problem:
            exc.add_note(f"(nbshard rebuilt this exception from its text: {problem}; its args and attributes are not the rank's)")
    return exc
