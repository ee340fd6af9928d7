"""Libraries' own process launchers, inside a rank: the function runs in the rank itself.

What a notebook's training code calls to start its processes: Lightning's fork- and spawn-based
strategies (``ddp_notebook``, what its documentation tells notebook users to pick, ``ddp_fork``,
``ddp_spawn``; ``Fabric.launch(fn)`` with them) and accelerate's ``notebook_launcher``. In a rank
of nbshard's, already one process of the group and with torchrun's environment, every rank
would start that many more: their rendezvous ports clash ("address already in use") or the
spawned copies cannot load the notebook's classes, and the job fails with an error that names
neither. In a rank they call the function in place, as Lightning's ``ddp`` does under torchrun
(its cluster environment "creates processes externally") and as ``notebook_launcher`` does for
one process; rank 0 says so once. Asked for another number of processes than nbshard started,
they say so instead. In a job of one rank, ``notebook_launcher`` starts its processes as it would
anywhere (they clash with no other rank's). No library is imported here: a launcher's module is
patched when the job imports it (or at the rank's start, where a warm process imported it).
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["LAUNCHER_MODULES", "install"]

_LIGHTNING = (
    "lightning.pytorch.strategies.launchers.multiprocessing",
    "lightning.fabric.strategies.launchers.multiprocessing",
    "pytorch_lightning.strategies.launchers.multiprocessing",  # the standalone packages
    "lightning_fabric.strategies.launchers.multiprocessing",
)
_ACCELERATE = "accelerate.launchers"
LAUNCHER_MODULES = frozenset({*_LIGHTNING, _ACCELERATE})
_PATCHED = "__nbshard_in_rank__"


def install() -> None:
    """Patch the launcher modules already imported (a warm rank's), and each one imported later."""
    for name in LAUNCHER_MODULES & sys.modules.keys():
        _patch(sys.modules[name])
    if not any(isinstance(finder, _LauncherFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LauncherFinder())


def _patch(module: ModuleType) -> None:
    if module.__name__ == _ACCELERATE:
        _patch_notebook_launcher(module)
    else:
        _patch_lightning(module)


def _patch_lightning(module: ModuleType) -> None:
    launcher: Any = getattr(module, "_MultiProcessingLauncher", None)
    launch = getattr(launcher, "launch", None)
    if launch is None or getattr(launch, _PATCHED, False):
        return  # another Lightning than the one this was written against: left as it is

    @functools.wraps(launch)
    def launch_in_rank(self: Any, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        strategy = getattr(self, "_strategy", None)
        if not getattr(getattr(strategy, "cluster_environment", None), "creates_processes_externally", False):
            return launch(self, function, *args, **kwargs)
        devices, nodes = getattr(strategy, "num_processes", None), getattr(strategy, "num_nodes", 1)
        if isinstance(devices, int) and isinstance(nodes, int) and devices * nodes != _world_size():
            raise ValueError(
                f"Lightning was asked for {devices * nodes} processes (devices={devices}, num_nodes={nodes}), but nbshard "
                f"started {_world_size()} rank{'s' * (_world_size() > 1)}, one per device: make them agree (nproc={devices} "
                f"for nbshard, or devices={_world_size() // max(nodes, 1) or 1} for Lightning)"
            )
        _say_once(f"Lightning's {getattr(self, '_start_method', '?')}-based strategy runs in the ranks nbshard started "
                  "(as strategy='ddp' does under torchrun) instead of starting processes of its own")
        kwargs.pop("trainer", None)  # the Trainer's launcher gets it to copy results back from its workers
        return function(*args, **kwargs)

    setattr(launch_in_rank, _PATCHED, True)
    launcher.launch = launch_in_rank


def _patch_notebook_launcher(module: ModuleType) -> None:
    original = getattr(module, "notebook_launcher", None)
    if original is None or getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def notebook_launcher_in_rank(function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int | None = None,
                                  mixed_precision: Any = "no", *_: Any, **__: Any) -> None:
        if _world_size() == 1:  # the only rank: its processes clash with no other rank's
            return original(function, args, num_processes, mixed_precision, *_, **__)
        from accelerate.utils import PrecisionType

        try:
            precision = PrecisionType(str(getattr(mixed_precision, "value", mixed_precision)).lower())
        except ValueError:  # as notebook_launcher says it
            raise ValueError(f"Unknown mixed_precision mode: {mixed_precision}. Choose between {PrecisionType.list()}.") from None
        if num_processes not in (None, _world_size()):
            raise ValueError(
                f"notebook_launcher was asked for num_processes={num_processes}, but nbshard started {_world_size()} ranks, "
                f"and runs the function in each: make them agree (nproc={num_processes} for nbshard, or "
                f"num_processes={_world_size()})"
            )
        _say_once(f"accelerate's notebook_launcher runs the function in each of the {_world_size()} ranks nbshard started")
        previous = os.environ.get("ACCELERATE_MIXED_PRECISION")
        os.environ["ACCELERATE_MIXED_PRECISION"] = precision.value  # what notebook_launcher sets for its processes
        try:
            function(*args)  # notebook_launcher returns nothing either
        finally:
            if previous is None:
                os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
            else:
                os.environ["ACCELERATE_MIXED_PRECISION"] = previous

    setattr(notebook_launcher_in_rank, _PATCHED, True)
    setattr(module, "notebook_launcher", notebook_launcher_in_rank)
    package = sys.modules.get("accelerate")
    if getattr(package, "notebook_launcher", None) is original:  # imported from it already (a warm rank)
        package.notebook_launcher = notebook_launcher_in_rank  # type: ignore[union-attr]


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@functools.cache
def _say_once(what: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"nbshard: {what}", file=sys.stderr)


class _LauncherFinder(importlib.abc.MetaPathFinder):
    """Finds a launcher module with the finders after it, and patches it once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in LAUNCHER_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)
