"""A node's side of the "ray" backend: the actor that lives on one node, starts that node's
launcher (warm once it has run a job) and holds its ranks' signed frames until the kernel's
side pumps them; its ranks' files are read from it in chunks when the node ends."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from nbshard.backends.relay import NodeRelay, node_outcome, read_log
from nbshard.contracts import LaunchSpec
from nbshard.environment import without_rays_debugger
from nbshard.files import mkdir_private, write_atomic
from nbshard.leftovers import hold_alive, sweep_temp
from nbshard.ports import pick_port
from nbshard.run_dir import RANK_FILES, RunDir

__all__ = ["CHUNK", "NodeAgent"]

CHUNK = 8 << 20  # bytes of a file per call when a node's files come home
RELAYED_FRAMES = 20_000  # frames a node holds for the kernel; past that, the oldest go (the logs keep every line)


class NodeAgent:
    """Lives on one node as a Ray actor: starts that node's launcher and relays its frames."""

    def __init__(self) -> None:
        sweep_temp()  # what lost nodes and dead kernels left on this node
        self.folder = Path(tempfile.mkdtemp(prefix="nbshard-node-"))
        self._alive = hold_alive(self.folder)  # until this actor dies, however it dies
        self.launcher: Any = None
        self.run_dir: RunDir | None = None
        self.frames: deque[list[bytes]] = deque(maxlen=RELAYED_FRAMES)
        self._relay = NodeRelay(self.folder, self.frames.append)  # the ranks' only way out
        self.address = self._relay.address

    def where(self) -> tuple[str, int]:
        """This node's address for the rendezvous, and a port free on it (used on node 0)."""
        import ray

        return ray.util.get_node_ip_address(), pick_port(None)

    def start(self, spec_json: dict[str, Any], key: bytes, job: bytes | None, env: dict[str, str], preload: list[str] | None) -> None:
        """Start this node's launcher: forked from a warm process of this actor's (started by its
        first job, so a kept actor's later jobs launch warm) when ``preload`` is given."""
        from nbshard.backends.local import start_node

        spec = LaunchSpec.from_json(spec_json)
        self.frames.clear()  # a kept actor: nothing of the last run (or attempt) goes to this one
        self.run_dir = RunDir(self.folder / spec.run_id / f"node-{spec.node_rank}")
        shutil.rmtree(self.run_dir.path, ignore_errors=True)  # a restarted job's last attempt
        mkdir_private(self.run_dir.path)
        write_atomic(self.run_dir.key, key)
        if job is not None:
            write_atomic(self.run_dir.job, job)
        cwd = spec.cwd if os.path.isdir(spec.cwd) else str(self.folder)
        spec.replace(address=self.address, kernel_pid=os.getpid(), cwd=cwd).write(self.run_dir.launch)
        self.launcher = start_node(self.run_dir, {**without_rays_debugger(os.environ), **env}, cwd, preload)

    def pump(self) -> tuple[list[list[bytes]], int | None]:
        """The frames since the last call, and the launcher's exit code once it has ended (read
        before the frames, so the frames of an ended launcher are its last)."""
        code = self.launcher.poll()
        taken = [self.frames.popleft() for _ in range(len(self.frames))]
        return taken, code

    def request(self, command: bytes) -> None:
        self.launcher.request(command)

    def kill(self) -> None:
        self.launcher.kill()

    def outcome(self) -> dict[str, Any] | None:
        """The launcher's outcome as JSON (Ray carries plain data; the kernel parses it)."""
        outcome = node_outcome(self.run_dir) if self.run_dir is not None else None
        return None if outcome is None else outcome.to_json()

    def rank_files(self) -> dict[str, int]:
        if self.run_dir is None:  # asked before start() made it
            return {}
        return {p.name: p.stat().st_size for p in self.run_dir.path.iterdir() if p.name.startswith(RANK_FILES)}

    def log(self, rank: int) -> bytes:
        return read_log(self.run_dir, rank) if self.run_dir is not None else b""

    def read(self, name: str, offset: int) -> bytes:
        if self.run_dir is None:
            return b""
        with open(self.run_dir.path / name, "rb") as file:
            file.seek(offset)
            return file.read(CHUNK)

    def clean(self, keep: bool) -> None:
        """Remove the run's directory (and, unless the actor is kept, the actor's own)."""
        if self.launcher is not None:
            self.launcher.close()
        shutil.rmtree(self.run_dir.path.parent if keep and self.run_dir else self.folder, ignore_errors=True)
