"""Unknown option names, answered with the one meant: the name a peer launcher uses for it
(torchrun, ``torch.multiprocessing.spawn``, accelerate, Lightning) or a close spelling."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["meant", "unknown_options"]

# Peers' names for nbshard's options: what a newcomer types first.
PEER_NAMES = {
    "nprocs": "nproc",  # torch.multiprocessing.spawn
    "nproc_per_node": "nproc",  # torchrun
    "num_processes": "nproc",  # accelerate's notebook_launcher
    "devices": "nproc",  # Lightning's Trainer / Fabric
    "world_size": "nproc",
    "num_nodes": "nnodes",  # Lightning
    "num_machines": "nnodes",  # accelerate
    "max_retries": "max_restarts",
    "port": "master_port",
    "use_port": "master_port",  # accelerate's notebook_launcher
}
# Peers' names for what is no option here, with where it goes instead.
NOT_OPTIONS = {
    # torch.multiprocessing.spawn(fn, args=...) and notebook_launcher(fn, args=...)
    "args": "the function's positional arguments go after it, as run(fn, *args) takes them",
}


def meant(name: str, known: Iterable[str]) -> str | None:
    """The known option ``name`` most likely stands for, or None."""
    known = sorted(known)
    key = name.lstrip("-").replace("-", "_").lower()
    if key in known:
        return key
    peer = PEER_NAMES.get(key)
    if peer in known:
        return peer
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_options(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``"nprocs (did you mean nproc?), foo"``: each unknown name, with the one it likely means."""
    known = sorted(known)

    def said(name: str) -> str:
        if name in NOT_OPTIONS:
            return f"{name} ({NOT_OPTIONS[name]})"
        guess = meant(name, known)
        return f"{name} (did you mean {guess}?)" if guess else name

    return ", ".join(said(name) for name in sorted(unknown))
