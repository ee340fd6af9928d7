"""Backends start the ranks of a run; they know nothing else.

Each backend is a callable ``start(run_dir, env, cwd, *, preload) -> launcher`` whose
launcher has ``poll``, ``wait``, ``request``, ``kill`` and ``close``.
"subprocess" (the default) runs the launcher as a child of the kernel and the
ranks as the launcher's children; "ray" starts the same launcher on each node
through a Ray actor, "slurm" through one srun task per node. A multi-node run's launcher is a ``NodeGroup`` over the
nodes' launchers (``backends/nodes.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from nbshard.backends.local import LauncherProcess, start_local
from nbshard.backends.nodes import NodeGroup
from nbshard.backends.ray import start_ray
from nbshard.backends.slurm import start_slurm
from nbshard.backends.warm_launcher import WarmLauncher

__all__ = ["BACKENDS", "LauncherProcess", "NodeGroup", "WarmLauncher", "get_backend"]

Backend = Callable[..., "LauncherProcess | WarmLauncher | NodeGroup"]  # (run_dir, env, cwd, *, preload) -> launcher

BACKENDS: dict[str, Backend] = {"subprocess": start_local, "ray": start_ray, "slurm": start_slurm}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}. "
            "Use backend='subprocess' to run the ranks on this machine."
        ) from None
