"""A job whose pickle is large: a warning that names what makes it so.

A function defined in a cell carries the notebook's globals it reads, by value: a dataset or
a model loaded in the notebook travels with every launch, and each rank loads its own copy.
It works, but slowly and at a cost in memory that the cell does not show.
"""

from __future__ import annotations

import itertools
import os
import sys
import types
import warnings
from typing import Any

from nbshard.errors import PACKAGE_DIR
from nbshard.job import Job
from nbshard.kernel.cell import run_cell
from nbshard.pickling import dump_job

__all__ = ["LARGE_JOB", "LargeJob", "pickled_job", "warn_if_large"]

LARGE_JOB = 64 << 20  # bytes of pickled job from which the cell is told what makes it large
_SAMPLED = 1000  # items of a container looked at; the rest are taken to be alike
_DEPTH = 8


class LargeJob(UserWarning):
    """A job that pickles to more than ``LARGE_JOB`` bytes: every rank loads its own copy, and
    every launch sends it again."""


def pickled_job(job: Job) -> bytes:
    """``job`` pickled for its ranks; a ``LargeJob`` warning where that makes it large."""
    payload = dump_job(job.fn, job.args, dict(job.kwargs), tuple(job.pickle_by_value))
    warn_if_large(job.fn, job.args, dict(job.kwargs), len(payload), tuple(job.pickle_by_value))
    return payload


def warn_if_large(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], size: int, by_value: tuple[Any, ...] = ()) -> None:
    """Warn (``LargeJob``) where the pickled job takes ``size`` >= ``LARGE_JOB`` bytes, naming its
    largest parts: the notebook's globals the function reads, its arguments (``by_value``: the
    modules whose functions were pickled with their globals besides the notebook's)."""
    if size < LARGE_JOB:
        return
    parts = _parts(fn, args, kwargs, by_value)
    sized = sorted(((_estimate_or_none(value), name) for name, value in parts), reverse=True)
    named = [f"{name} ({_mib(estimate)})" for estimate, name in sized[:3] if estimate >= size / 10]
    warnings.warn(
        f"the job pickles to {_mib(size)}{', mostly ' + ', '.join(named) if named else ''}: each rank loads its "
        "own copy, and every launch (every session call) sends it again. Load or build such data inside "
        "the function (from a path), or keep it in a session's ranks (set it with 'global' in one call, use it in "
        "the next). warnings.filterwarnings('ignore', category=nbshard.LargeJob) silences this.",
        LargeJob, stacklevel=_caller_level(),
    )


def _mib(size: float) -> str:
    return f"{size / 2**20:,.0f} MiB"


def _parts(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], by_value: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """What the pickle carries, by the name the notebook knows it by."""
    if fn is run_cell:  # a %%shard_train cell: the notebook's values it reads, by name
        return [(repr(name), value) for name, value in kwargs["values"].items()]
    parts = [(f"args[{i}]", arg) for i, arg in enumerate(args)] + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    if not isinstance(fn, types.FunctionType):
        return [("the function", fn), *parts]
    seen: set[int] = set()
    pending = [fn] if _travels_by_value(fn, by_value) else []
    while pending:  # the function, and the notebook's functions it reads, each by value
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        cells = zip(function.__code__.co_freevars, function.__closure__ or ())
        named = [(name, cell.cell_contents) for name, cell in cells if _filled(cell)]
        named += [(name, function.__globals__[name]) for name in _names_read(function.__code__) if name in function.__globals__]
        for name, value in named:
            if isinstance(value, types.FunctionType):
                if _travels_by_value(value, by_value):
                    pending.append(value)
            elif not isinstance(value, (types.ModuleType, type)):
                parts.append((repr(name), value))
    return parts


def _travels_by_value(function: types.FunctionType, by_value: tuple[Any, ...]) -> bool:
    """cloudpickle's rule: a function its module cannot give back by name (the notebook's, a
    closure, a lambda) or one of a module pickled by value travels with the globals it reads."""
    module = sys.modules.get(function.__module__ or "")
    if module is None or module.__name__ == "__main__" or module in by_value:
        return True
    found: Any = module
    for part in function.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is not function


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _names_read(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def _estimate_or_none(value: Any) -> float:
    try:
        return _estimate(value)
    except Exception:  # noqa: BLE001 - an object that cannot be looked into is not named
        return 0


def _estimate(value: Any, depth: int = 0, seen: set[int] | None = None) -> float:
    """About how many bytes ``value`` pickles to: arrays, tensors and bytes exactly, containers
    and objects by what they hold (large containers from a sample)."""
    seen = set() if seen is None else seen
    if id(value) in seen or depth > _DEPTH:
        return 0
    seen.add(id(value))
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 - a tensor without storage (meta, a subclass)
            return 0
    if type(value).__module__ == "numpy" and isinstance(getattr(value, "nbytes", None), int):
        return value.nbytes
    if isinstance(value, (int, float, complex, bool)) or value is None:
        return 9
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif isinstance(value, (type, types.ModuleType, types.FunctionType)):
        return 0
    else:
        held = getattr(value, "__dict__", None)
        slots = getattr(type(value), "__slots__", ())
        slots = (slots,) if isinstance(slots, str) else slots
        items = [*(held.values() if isinstance(held, dict) else ()), *(getattr(value, s) for s in slots if hasattr(value, s))]
    sample = list(itertools.islice(items, _SAMPLED))
    total = sum(_estimate(item, depth + 1, seen) for item in sample)
    return total * len(items) / len(sample) if sample else 0


def _caller_level() -> int:
    """The stack level of the first frame outside nbshard and IPython's magic machinery: the
    warning points at the user's line (a cell magic's: the cell's first line)."""
    ipython = sys.modules.get("IPython")
    skipped = (PACKAGE_DIR, "<decorator-gen-", *([os.path.dirname(ipython.__file__) + os.sep] if ipython and ipython.__file__ else []))
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    return level
