"""Backends start the launchers of a run; they know nothing else.

A backend is a function ``start(run_dir, env, cwd, *, preload) -> NodeLauncher``
(``backends/base.py`` says what it must do). "subprocess" (the default) runs the launcher as a
child of the kernel and the ranks as the launcher's children; "ray" starts the same launcher on
each node through a Ray actor, "slurm" through one srun task per node. A multi-node run's
launcher is a ``NodeGroup`` over the nodes' (``backends/nodes.py``); what nodes on other machines
share, both ends of their relay and their files coming home, is in ``backends/relay.py``.
"""

from __future__ import annotations

from nbshard.backends.base import Backend, NodeLauncher
from nbshard.backends.local import LauncherProcess, start_local
from nbshard.backends.nodes import NodeGroup
from nbshard.backends.ray import start_ray
from nbshard.backends.slurm import start_slurm
from nbshard.backends.warm_launcher import WarmLauncher

__all__ = ["BACKENDS", "Backend", "LauncherProcess", "NodeGroup", "NodeLauncher", "WarmLauncher", "get_backend", "register_backend"]

BACKENDS: dict[str, Backend] = {"subprocess": start_local, "ray": start_ray, "slurm": start_slurm}


def register_backend(name: str, start: Backend) -> None:
    """Make ``backend=name`` start runs with ``start`` (see ``backends/base.py``)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a backend's name must be a non-empty string, got {name!r}")
    if not callable(start):
        raise TypeError(f"backend {name!r}: start must be callable (run_dir, env, cwd, *, preload) -> launcher, got {start!r}")
    BACKENDS[name] = start


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}. "
            "Use backend='subprocess' to run the ranks on this machine."
        ) from None
