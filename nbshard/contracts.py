"""What crosses a process or a backend, as types: each built and parsed here, in one place.

- ``LaunchSpec``: what the kernel tells a node's launcher (``launch.json``), versioned.
- ``Status``: how a run, a node or a session call ended.
- ``RankOutcome`` / ``RunOutcome``: how each rank ended and what the launcher (or the node
  group) saw (``outcome.json``), modelled on torch elastic's ``RunResult``.

``nproc_per_node`` is ranks on one node (torchrun's ``--nproc-per-node``); ``world_size`` is
ranks on all nodes. Pure: nothing here reads the machine; a file is read only when asked.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from pathlib import Path
from typing import Any

from nbshard.files import read_json, write_json

__all__ = ["EXITING_EVENT", "LAUNCH_SPEC_VERSION", "NODES_FAILED", "OTHER_VERSION", "Attempt", "LaunchSpec", "RankOutcome", "RunOutcome", "Status"]

LAUNCH_SPEC_VERSION = 2  # 2: each wire message is one frame (a kernel and launcher of version 1 send two)
OTHER_VERSION = "another version of nbshard"  # how a contract read by a mismatched nbshard says so
NODES_FAILED = "supervising the nodes failed"  # how the kernel's side of a multi-node run says it broke
EXITING_EVENT = "exiting"  # ranks slow to exit after they returned: {"seconds": {rank: since}, "stacks": {rank: dump}}


class Status(str, enum.Enum):
    """How a run (or one node of it, or one call of a session) ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    KERNEL_GONE = "kernel_gone"  # nobody waits for the run any more
    INTERRUPTED = "interrupted"  # a session call stopped by the kernel's interrupt; the session lives
    LOST = "lost"  # a session whose ranks had to be stopped
    CLOSED = "closed"  # a session closed by the kernel

    def __str__(self) -> str:
        return self.value


def _plain(value: Any) -> Any:
    """``value`` as JSON's types: a dataclass as a dict of its fields (``dataclasses.asdict``
    without its deep copies, a session call's end is built on every call), keys as strings."""
    if dataclasses.is_dataclass(value):
        cls: type = type(value)
        return {name: _plain(getattr(value, name)) for name in _field_names(cls)}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def _from_fields(cls: type, data: dict[str, Any], what: str) -> Any:
    unknown = data.keys() - _field_names(cls)
    if unknown:
        raise ValueError(
            f"{what} holds fields this nbshard does not know ({', '.join(sorted(unknown))}): it was written by "
            f"{OTHER_VERSION}. Use the same nbshard in the kernel and on every node."
        )
    return cls(**data)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What a node's launcher (and each of its ranks) reads from ``launch.json``."""

    address: str  # the socket the ranks' messages go to (the kernel's, or the node's relay)
    run_id: str
    cwd: str
    nproc_per_node: int
    timeout: float | None = None
    grace: float = 2.0
    master_port: int | None = None  # None: the launcher picks a free one (node 0's, for every node)
    master_addr: str = "127.0.0.1"
    nnodes: int = 1
    node_rank: int = 0
    max_restarts: int = 0
    restart_count: int = 0
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    gpus: list[int | str] | None = None  # indices or GPU UUIDs
    backend_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    return_all: bool = False
    sys_path: list[str] = dataclasses.field(default_factory=list)
    sample_interval: float | None = 1.0
    profile: bool = False  # each rank runs the job under torch.profiler
    kernel_pid: int | None = None  # the launcher's parent that waits for the run (a kernel, an actor, a task)
    kernel: str | None = None  # the kernel as "pid:start time" (runs.py prunes dead kernels' runs)
    session: bool = False  # the ranks stay up and run call after call
    interrupt_grace: float = 0.0  # a session's: how long ranks get to leave an interrupted call
    version: int = LAUNCH_SPEC_VERSION

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def first_rank(self) -> int:
        """The global rank of this node's local rank 0."""
        return self.node_rank * self.nproc_per_node

    def replace(self, **changes: Any) -> LaunchSpec:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchSpec:
        version = data.get("version")
        if version != LAUNCH_SPEC_VERSION:
            raise ValueError(
                f"launch.json has version {version!r}, this nbshard reads version {LAUNCH_SPEC_VERSION}: the launcher "
                f"runs {OTHER_VERSION} than the kernel. Install the same nbshard where the ranks run."
            )
        return _from_fields(cls, data, "launch.json")

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> LaunchSpec:
        return cls.from_json(read_json(path))


@dataclasses.dataclass
class RankOutcome:
    """How one rank ended: returned (``ok``), failed, stopped by nbshard, or lost with its node."""

    rank: int
    exitcode: int | None
    ok: bool
    ended: float  # when its end was seen (epoch seconds)
    stopped: bool = False  # nbshard stopped it (another rank failed, a cancel, a timeout)
    stacks: str = ""  # its threads' stacks when it was stopped
    lost: str | None = None  # why its node was lost


@dataclasses.dataclass
class Attempt:
    """A failed attempt that ``max_restarts`` started again."""

    attempt: int
    rank: int | None
    cause: str
    files: str  # the folder its error and stack files were set aside in


@dataclasses.dataclass
class RunOutcome:
    """What a launcher (or a node group, or a session call) writes last, as ``outcome.json``."""

    status: Status
    ranks: list[RankOutcome] = dataclasses.field(default_factory=list)
    storage_error: str | None = None  # why the run's files could not be written (a full disk)
    start_error: str | None = None  # why a rank could not be started (a process limit)
    first_failure: int | None = None
    master_port: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    signal_received: str | None = None  # a signal from outside stopped the launcher (scancel)
    dropped_lines: dict[int, int] = dataclasses.field(default_factory=dict)  # not streamed, by rank
    lines_sent: dict[int, int] = dataclasses.field(default_factory=dict)  # streamed, by rank
    lost_nodes: dict[int, str] = dataclasses.field(default_factory=dict)
    stopped_from_outside: dict[int, str] = dataclasses.field(default_factory=dict)  # node -> signal
    reason: str | None = None  # why a session was lost
    diverged: bool = False  # a session call that failed on some ranks and returned on others
    unsent: list[int] = dataclasses.field(default_factory=list)  # a session call's ranks that returned a value it could not send

    def to_json(self) -> dict[str, Any]:
        data = _plain(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunOutcome:
        data = dict(data)
        data["status"] = Status(data["status"])
        data["ranks"] = [_from_fields(RankOutcome, entry, "outcome.json") for entry in data.get("ranks", [])]
        data["attempts"] = [_from_fields(Attempt, entry, "outcome.json") for entry in data.get("attempts", [])]
        for name in ("dropped_lines", "lines_sent", "lost_nodes", "stopped_from_outside"):
            data[name] = {int(key): value for key, value in data.get(name, {}).items()}
        return _from_fields(cls, data, "outcome.json")

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> RunOutcome | None:
        """The outcome in ``path``, or None when there is none (yet) or it cannot be read."""
        try:
            return cls.from_json(read_json(path))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def succeeded(self) -> bool:
        return self.status is Status.SUCCEEDED
