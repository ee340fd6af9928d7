"""Serialization of jobs (kernel to ranks); results (ranks to kernel) are ``results.py``.

Jobs use cloudpickle, so functions, classes and lambdas defined in notebook
cells travel by value. When something cannot be pickled, the error names the
object and the path by which it was reached (``train.__globals__['lock']``),
before any process starts.
"""

from __future__ import annotations

import collections
import contextlib
import io
import linecache
import os
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cloudpickle_internals

from nbshard.files import read_json, write_json
from nbshard.run_dir import RunDir

__all__ = [
    "Pickler", "ProcessLocalState", "describe_unpicklable", "dump_job", "find_unpicklable", "is_notebook_code",
    "notebook_sources", "register_sources", "write_sources",
]

_MAX_DEPTH = 6


def is_notebook_code(value: Any) -> bool:
    """A function or class defined in the notebook: code the person edits, shipped fresh each call."""
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__"


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, child) pairs a pickler would visit inside ``obj``."""
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                yield f" (closure variable {name!r})", cell.cell_contents
        for name in _global_names(code):
            if name in obj.__globals__:
                yield f".__globals__[{name!r}]", obj.__globals__[name]
        for index, default in enumerate(obj.__defaults__ or ()):
            yield f".__defaults__[{index}]", default
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for index, item in enumerate(obj):
            yield f"[{index}]", item
    elif isinstance(obj, (type, types.ModuleType)):
        return
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            for key, value in state.items():
                yield f".{key}", value


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _pickle_error(obj: Any) -> Exception | None:
    try:
        _dumps(obj)
    except Exception as error:  # noqa: BLE001 - any failure is what we are looking for
        return error
    return None


def find_unpicklable(obj: Any, path: str, depth: int = 0) -> tuple[str, Any, Exception] | None:
    """The innermost part of ``obj`` that cannot be pickled, as (path, object, error)."""
    error = _pickle_error(obj)
    if error is None:
        return None
    if depth < _MAX_DEPTH:
        for suffix, child in _children(obj):
            found = find_unpicklable(child, path + suffix, depth + 1)
            if found is not None:
                return found
    return path, obj, error


SENDING_HINT = (
    "Likely cause: an object tied to this process (a lock, an open file or socket, a generator, "
    "a CUDA handle) is referenced by the function or its arguments. What to do: create it inside "
    "the function, or pass what is needed to build it (a path, a config)."
)


def describe_unpicklable(found: tuple[str, Any, Exception], what: str, hint: str = SENDING_HINT) -> str:
    path, obj, error = found
    if isinstance(error, ProcessLocalState):
        hint = ""  # its own message says what to do
    elif isinstance(error, RecursionError) or "recursion" in str(error):
        hint = (
            "Likely cause: it nests deeper than pickle can follow (a list in a list in a list ..., or a long "
            f"linked chain of objects; Python's recursion limit here is {sys.getrecursionlimit()}). What to do: "
            "flatten it (one list of the items), or raise the limit with sys.setrecursionlimit() on both sides."
        )
    return f"{what}: {path} (a {type(obj).__module__}.{type(obj).__qualname__}) cannot be pickled: {error}. {hint}"


def _code_reduce_keeping_filename(code: types.CodeType) -> Any:
    """cloudpickle's code reducer, minus its renaming of every file to ``<dynamic-code>``.

    The file name is what lets the kernel show the source lines of a remote
    traceback (IPython keeps each cell's source in linecache under it).
    """
    rebuild, args = _cloudpickle_internals._code_reduce(code)
    return rebuild, tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)


class ProcessLocalState(TypeError):
    """An object whose whole meaning is this process's distributed setup (accelerate's state)."""


# Cached device and process-group state that transformers' TrainingArguments sets up on first
# use (``args.device``); dropped on the way, each rank sets it up again under its own torchrun
# environment instead of training alone with the kernel's world size of 1.
_TRAINING_ARGS_DEVICE_STATE = ("_setup_devices", "distributed_state", "_n_gpu")
_ACCELERATE_STATE = ("accelerate.state", ("PartialState", "AcceleratorState", "GradientState"))
_ACCELERATE_ACCELERATOR = ("accelerate.accelerator", ("Accelerator",))


def _loaded_classes(module: str, names: tuple[str, ...]) -> tuple[type, ...]:
    """Those of ``names`` in ``module`` if the program imported it; nothing is imported here."""
    found = sys.modules.get(module)
    return tuple(cls for name in names if isinstance(cls := getattr(found, name, None), type))


def _set_up_devices_again(obj: Any, state: dict[str, Any]) -> None:
    """Unpickling in a rank: the state without the sender's devices, then this rank's devices
    set up as ``TrainingArguments.__post_init__`` does (a cached property)."""
    vars(obj).update(state)
    obj._setup_devices  # noqa: B018 - the access is the setup


def _process_local_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The classes whose objects carry this process's distributed state, among those imported:
    (transformers' TrainingArguments, accelerate's states and Accelerator)."""
    return (
        _loaded_classes("transformers.training_args", ("TrainingArguments",)),
        _loaded_classes(*_ACCELERATE_STATE) + _loaded_classes(*_ACCELERATE_ACCELERATOR),
    )


def _reduce_process_local(obj: Any, set_up_again: bool, classes: tuple[tuple[type, ...], tuple[type, ...]]) -> Any:
    """How to pickle an object that carries this process's distributed state, or NotImplemented.

    ``set_up_again``: in a job (the receiver is a rank), TrainingArguments set up their devices
    on arrival; in a result (the receiver is the kernel, which must stay GPU-free) they do so
    only when asked, and meanwhile report no distributed state. ``classes``: from
    ``_process_local_classes``.
    """
    training_args, accelerate = classes
    if training_args and isinstance(obj, training_args) and any(k in vars(obj) for k in _TRAINING_ARGS_DEVICE_STATE):
        reduced: Any = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # a tuple: such classes do not reduce to a name
        rebuild, args, state, *_ = reduced
        state = {k: v for k, v in state.items() if k not in _TRAINING_ARGS_DEVICE_STATE}
        if set_up_again:
            return rebuild, args, state, None, None, _set_up_devices_again
        return rebuild, args, {**state, "distributed_state": None}
    if accelerate and isinstance(obj, accelerate):
        raise ProcessLocalState(
            f"a {type(obj).__name__} describes the distributed setup of the process that made it (here: "
            "one process, no process group), so each rank would train alone with it. Create it inside "
            "the job, where each rank sets it up under its own RANK and WORLD_SIZE."
        )
    return NotImplemented


class Pickler(cloudpickle.Pickler):
    """cloudpickle keeping code's file names (for tracebacks) and rebuilding process-local state."""

    dispatch_table = collections.ChainMap(
        # Only where this cloudpickle has the reducer we wrap (a private name, checked here).
        {types.CodeType: _code_reduce_keeping_filename} if hasattr(_cloudpickle_internals, "_code_reduce") else {},
        cloudpickle.Pickler.dispatch_table,
    )

    set_up_again = True  # what it pickles is for a rank

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._process_local = _process_local_classes()  # looked up once per pickle, not per object

    def reducer_override(self, obj: Any) -> Any:
        reduced = _reduce_process_local(obj, self.set_up_again, self._process_local)
        return super().reducer_override(obj) if reduced is NotImplemented else reduced


def _dumps(value: Any, pickler: type[cloudpickle.Pickler] = Pickler) -> bytes:
    buffer = io.BytesIO()
    pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def dump_job(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], by_value: tuple[types.ModuleType, ...] = ()) -> bytes:
    """The pickled ``(fn, args, kwargs)``; TypeError naming the culprit if any part cannot be."""
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        try:
            return _dumps((fn, args, kwargs))
        except Exception as error:
            parts = [(getattr(fn, "__qualname__", "fn"), fn)]
            parts += [(f"args[{i}]", arg) for i, arg in enumerate(args)]
            parts += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
            for path, part in parts:
                found = find_unpicklable(part, path)
                if found is not None:
                    raise TypeError(describe_unpicklable(found, "Cannot send the job to the ranks")) from error
            raise TypeError(f"Cannot send the job to the ranks: {error}") from error
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def notebook_sources(payload: bytes) -> dict[str, str]:
    """The source of each notebook cell (IPython registers cells with the line cache, not as
    files) whose code ``payload`` carries, by the file name its code objects hold. One pass
    over the payload per cell folder: ipykernel names every cell in one temporary folder."""
    cells = {name: entry for name, entry in list(linecache.cache.items()) if len(entry) == 4 and entry[1] is None}
    found: dict[str, str] = {}
    for folder in {os.path.dirname(name) for name in cells if os.path.isabs(name)}:
        marker, start = (folder + os.sep).encode(), 0
        while (at := payload.find(marker, start)) != -1:
            start = at + len(marker)
            for name in (name for name in cells if name.startswith(folder) and payload.startswith(name.encode(), at)):
                found[name] = "".join(cells[name][2])
    return found


def write_sources(run_dir: RunDir, payload: bytes, sent: dict[str, str] | None = None) -> None:
    """Keep the notebook cells ``payload``'s code comes from beside it (``RunDir.sources``).
    ``sent``: the cells the same ranks were given before (a session's, whose ranks keep them),
    left out, and the ones written now added."""
    sources = notebook_sources(payload)
    if sent is not None:
        sources = {name: text for name, text in sources.items() if sent.get(name) != text}
    if sources:
        write_json(run_dir.sources, sources)
        if sent is not None:
            sent.update(sources)


_cells: dict[str, tuple[int, None, list[str], str]] = {}  # every cell this rank was given (a session's are sent once)


def register_sources(run_dir: RunDir) -> None:
    """In a rank: the job's notebook cells into the line cache, as IPython keeps them in the kernel
    (again each call: code the person ran may have cleared the cache)."""
    with contextlib.suppress(FileNotFoundError):
        for name, text in read_json(run_dir.sources).items():
            _cells[name] = (len(text), None, text.splitlines(keepends=True), name)
    linecache.cache.update(_cells)
