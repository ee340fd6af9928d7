"""Both ends of a node's relay, and a node's files coming home: what every backend that runs
nodes on other machines shares (Ray, Slurm, and an SSH or Kubernetes backend next).

On the node, ``NodeRelay`` is the ranks' only way out: a private ipc socket (``wire.bind_private``)
in the node's directory whose frames, still signed, go to a callback (into the actor's batches,
onto srun's stdout). In the kernel, ``Forwarder`` puts each relayed frame on the kernel's own
socket, where it is checked against the run's key like a local one. Nothing of nbshard listens
on TCP.
"""

from __future__ import annotations

import contextlib
import os
import site
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import zmq

from nbshard.contracts import RunOutcome
from nbshard.run_dir import RANK_FILES, RunDir
from nbshard.wire import PrivateEndpoint, bind_private

__all__ = [
    "APPENDED", "ENV_ALLOW", "Forwarder", "NodeRelay", "append_home", "importable_env", "move_rank_files",
    "node_environment", "node_outcome", "read_log",
]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

# What of the kernel's environment travels to other machines (their own environment is
# theirs): names starting with these, and what env= and env_allow add.
ENV_ALLOW = ("NCCL_", "TORCH_", "PYTORCH_", "HF_", "TRANSFORMERS_", "WANDB_", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM",
             "PYTHONHASHSEED")


def node_environment(kernel_env: Mapping[str, str], job_env: Mapping[str, str], allow: Sequence[str]) -> dict[str, str]:
    """What of the kernel's environment a remote node gets: the allow-listed names, then env=."""
    prefixes = (*ENV_ALLOW, *allow)
    return {**{k: v for k, v in kernel_env.items() if k.startswith(prefixes)}, **job_env}

def importable_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with nbshard importable, also when it runs from a source checkout."""
    env = dict(env)
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if _PACKAGE_ROOT not in site_dirs:
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if _PACKAGE_ROOT not in paths:
            env["PYTHONPATH"] = os.pathsep.join([*paths, _PACKAGE_ROOT])
    return env


class NodeRelay:
    """The node's socket for its ranks' frames (bound privately in ``directory``); a thread hands
    each frame, as it came, to ``deliver``."""

    def __init__(self, directory: Path, deliver: Callable[[list[bytes]], None]) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._endpoint: PrivateEndpoint = bind_private(self._socket, directory)
        self.address = self._endpoint.address
        self._deliver = deliver
        threading.Thread(target=self._receive, name="nbshard-node-relay", daemon=True).start()

    def _receive(self) -> None:
        with contextlib.suppress(zmq.ZMQError, OSError, ValueError):
            while True:
                self._deliver(self._socket.recv_multipart())

    def close(self) -> None:
        self._endpoint.close()


def move_rank_files(node_dir: RunDir, run_dir: RunDir) -> None:
    """A node's rank files (on this machine or a shared filesystem) into the run's directory."""
    for path in node_dir.path.iterdir():
        if path.name.startswith(RANK_FILES):
            if path.name.startswith(APPENDED):
                append_home(run_dir, path.name, path.read_bytes())
                path.unlink()
            else:
                os.replace(path, run_dir.path / path.name)


APPENDED = ("rank-", "metrics-")  # a rank's log and metrics hold every attempt of a restarted job


def append_home(run_dir: RunDir, name: str, data: bytes) -> None:
    """Add ``data`` to the run's file ``name`` (made private when it is new)."""
    fd = os.open(run_dir.path / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def read_log(node_dir: RunDir, rank: int) -> bytes:
    path = node_dir.log(rank)
    return path.read_bytes() if path.exists() else b""


def node_outcome(node_dir: RunDir) -> RunOutcome | None:
    """A node launcher's outcome, or None when it wrote none."""
    return RunOutcome.read(node_dir.outcome)


class Forwarder:
    """Puts frames relayed from remote nodes, as they came, on the kernel's own socket
    (where they are checked against the run's key like local ones)."""

    def __init__(self, address: str) -> None:
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)

    def send(self, frames: list[bytes]) -> None:
        with self._lock, contextlib.suppress(zmq.ZMQError):
            self._socket.send_multipart(frames)

    def close(self) -> None:
        with self._lock:
            self._socket.close()
            self._context.term()
