"""What a backend is: the one seam between the kernel and however a node's launcher comes to life.

A backend is a function ``start(run_dir, env, cwd, *, preload) -> NodeLauncher``: it reads the
run's ``LaunchSpec`` (``run_dir.launch``), starts nbshard's own launcher for each node
(``python -m nbshard.launcher NODE_DIR``, or ``backends.local.start_node`` on the node), and
returns one object with the node-launcher verbs. A multi-node backend returns a ``NodeGroup``
(``backends/nodes.py``) over ``Node`` objects, which supervises the nodes with the same restart
policy a launcher uses for its ranks. Register it with ``register_backend(name, start)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from nbshard.run_dir import RunDir

__all__ = ["Backend", "NodeLauncher"]


@runtime_checkable
class NodeLauncher(Protocol):
    """A launcher as the kernel holds it, with the method names of ``subprocess.Popen``."""

    note: str | None  # why a launch the kernel asked to be warm is cold, else None

    def poll(self) -> int | None:
        """The exit code once the launcher (every node's, for a group) has ended, else None."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""

    def request(self, command: bytes) -> None:
        """The kernel's words (``job.CANCEL``, ``job.KILL``, a session's command lines)."""

    def kill(self) -> None:
        """Stop every rank now (SIGKILL), however far the launcher is."""

    def close(self) -> None:
        """The run is over: free what the launch holds (processes, pipes, placements)."""


class Backend(Protocol):
    def __call__(self, run_dir: RunDir, env: Mapping[str, str], cwd: str, *, preload: Sequence[str] | None = None) -> NodeLauncher:
        """Start the run's launchers: ``env`` is the kernel's launch environment, ``preload``
        the modules a warm process imports (None: start cold)."""
