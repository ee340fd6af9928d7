"""The launchers of a multi-node run, seen from the kernel as one launcher.

Every node runs the one launcher there is, for its own ranks. ``NodeGroup`` supervises them
from the kernel: the first node that ends without success stops the others, a node that is
lost (its launcher gone without an outcome, or an engine that says it died) is a failure of
its own that ranks ahead of the errors it causes elsewhere, and when every node has ended
their files come home and their outcomes merge into the run's ``outcome.json``, so the job
handle reads a multi-node run as it reads any other.

A node is any object with ``poll``, ``request``, ``kill``, ``close`` (the node-launcher
interface), ``outcome()`` (its launcher's outcome, or None), ``lost()`` (why it is lost, or
None), ``bring_home(run_dir)`` (move its ranks' files into the kernel's run directory) and
``live_log(rank)`` (a running rank's log).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

from nbshard.contracts import NODES_FAILED, RankOutcome, RunOutcome, Status
from nbshard.backends.relay import append_home
from nbshard.files import open_private
from nbshard.job import CANCEL, KILL
from nbshard.run_dir import RunDir
from nbshard.process.supervision import RestartPolicy
from nbshard.wire import Sender

__all__ = ["Node", "NodeGroup", "merge_outcomes"]

POLL = 0.05
END_SEND_WAIT = 2.0  # the kernel's own socket: it reads unless it is gone


class Node(Protocol):
    def poll(self) -> int | None: ...
    def request(self, command: bytes) -> None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...
    def outcome(self) -> RunOutcome | None: ...
    def lost(self) -> str | None: ...
    def bring_home(self, run_dir: RunDir) -> None: ...
    def live_log(self, rank: int) -> bytes: ...


class NodeGroup:
    """The nodes of one run behind the launcher interface (``poll``, ``wait``, ``request``,
    ``kill``, ``close``); it tells the kernel's socket (``address``) of restarts and, last, the end."""

    note: str | None = None

    def __init__(
        self, run_dir: RunDir, nodes: Sequence[Node], nproc_per_node: int, address: str, cleanup: Any = None,
        *, relaunch: Any = None, max_restarts: int = 0,
    ) -> None:
        self.nodes = list(nodes)
        self._cleanup = cleanup  # what the backend frees once, when the run is over
        self._relaunch = relaunch  # relaunch(restart_count) -> fresh nodes, for max_restarts
        self._policy = RestartPolicy(run_dir, max_restarts if relaunch is not None else 0, "every node", self._mark_log)
        self._address = address  # the kernel's socket
        self._run_dir = run_dir
        self._nproc_per_node = nproc_per_node
        self._asked: bytes | None = None  # what the kernel asked for (a cancel, a kill)
        self._stopping_for: int | None = None  # the node whose end stopped the others
        self._ended: dict[int, float] = {}
        self._lost: dict[int, str] = {}
        self._done = threading.Event()
        self._code = 0  # 1 once supervising failed (see _broke)
        self._thread = threading.Thread(target=self._supervise, name=f"nbshard-nodes-{run_dir.path.name}", daemon=True)
        self._thread.start()

    # -- the launcher interface --------------------------------------------

    def poll(self) -> int | None:
        return self._code if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("nbshard nodes", timeout or 0)
        return self._code

    def request(self, command: bytes) -> None:
        if command in (CANCEL, KILL):  # not an answer to a rank's debugger: every node's launcher picks its own
            self._asked = command
        for node in self.nodes:
            node.request(command)

    def kill(self) -> None:
        self._asked = KILL
        for node in self.nodes:
            node.kill()

    def live_log(self, rank: int) -> bytes:
        """A rank's log so far, from the node that runs it (the run's directory has it once the run ended)."""
        with contextlib.suppress(Exception):
            return self.nodes[rank // self._nproc_per_node].live_log(rank)
        return b""

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup()

    # -- supervising -------------------------------------------------------

    def _supervise(self) -> None:
        try:
            outcome = self._policy.run(
                self._run_attempt, 0, final=lambda: self._asked is not None, restarting=self._restart,
                also=[self._run_dir.path / "nodes"],  # the failed attempt's node directories
            )
            outcome.write(self._run_dir.outcome)
            self._send({"kind": "end", "status": outcome.status, "storage_error": outcome.storage_error})
        except Exception as error:  # noqa: BLE001 - a backend's node that raises must end the run, and say why
            self._broke(error)
        finally:
            self._done.set()

    def _broke(self, error: Exception) -> None:
        """Stop every node, and leave the reason where the kernel reads a launcher's own failure
        (its log's last line, with a non-zero exit)."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.kill()
        self._code = 1
        with contextlib.suppress(OSError), open_private(self._run_dir.launcher_log, "a") as log:
            log.write("".join(traceback.format_exception(error)))
            log.write(f"{NODES_FAILED}: {type(error).__name__}: {error}\n")

    def _restart(self, text: str, restart_count: int) -> None:
        self._send({"kind": "event", "event": "note", "text": text})
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()
        self.nodes = self._relaunch(restart_count)
        self._stopping_for, self._ended, self._lost = None, {}, {}
        if self._asked is not None:  # a cancel that came while the nodes restarted
            self.request(self._asked)

    def _mark_log(self, rank: int, text: str) -> None:
        with contextlib.suppress(OSError):
            append_home(self._run_dir, self._run_dir.log(rank).name, text.encode())

    def _run_attempt(self, restart_count: int) -> tuple[RunOutcome, int]:
        """Supervise the nodes until each has ended; their files home, their outcomes merged."""
        while len(self._ended) < len(self.nodes):
            for index, node in enumerate(self.nodes):
                if index not in self._ended:
                    self._check(index, node)
            time.sleep(POLL)
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.bring_home(self._run_dir)
        return merge_outcomes(
            [None if i in self._lost else node.outcome() for i, node in enumerate(self.nodes)],
            self._lost, self._ended, self._nproc_per_node, cancelled=self._asked is not None and self._stopping_for is None,
        ), restart_count

    def _send(self, message: dict[str, Any]) -> None:
        """One message to the kernel's socket, signed with the run's key."""
        with contextlib.suppress(Exception):
            sender = Sender(self._address, self._run_dir.key.read_bytes())
            sender.send(message, wait=END_SEND_WAIT)
            sender.close()

    def _check(self, index: int, node: Node) -> None:
        why = node.lost()
        if why is None and node.poll() is None:
            return
        self._ended[index] = time.time()
        outcome = node.outcome() if why is None else None
        if why is None and outcome is None:
            why = f"its launcher exited (code {node.poll()}) without saying how the job ended"
        if why is not None:
            self._lost[index] = why
            node.kill()
        failed = why is not None or outcome is None or not outcome.succeeded
        if failed and self._stopping_for is None and self._asked is None:
            self._stopping_for = index
            for other, peer in enumerate(self.nodes):
                if other not in self._ended:
                    peer.request(CANCEL)  # with stacks: where each rank was when another node failed


def merge_outcomes(
    outcomes: Sequence[RunOutcome | None], lost: dict[int, str], ended: dict[int, float],
    nproc_per_node: int, *, cancelled: bool,
) -> RunOutcome:
    """One outcome for the run from each node's (None for a lost node, whose ranks become
    failures of their own, timed when the node was found lost)."""
    ranks: list[RankOutcome] = []
    for node, outcome in enumerate(outcomes):
        if outcome is None:
            ranks += [
                RankOutcome(node * nproc_per_node + local, None, False, ended.get(node, time.time()),
                            lost=f"node {node} was lost: {lost.get(node, 'no outcome')}")
                for local in range(nproc_per_node)
            ]
        else:
            ranks += outcome.ranks
    statuses = {outcome.status for outcome in outcomes if outcome is not None}
    if statuses == {Status.SUCCEEDED} and not lost:
        status = Status.SUCCEEDED  # a cancel that came once every rank had returned stopped only their exits
    elif cancelled:
        status = Status.CANCELLED
    elif lost or Status.FAILED in statuses:
        status = Status.FAILED
    elif Status.TIMED_OUT in statuses:
        status = Status.TIMED_OUT
    elif statuses == {Status.SUCCEEDED}:
        status = Status.SUCCEEDED
    else:
        status = Status.FAILED  # a node cancelled by another's end, or the kernel gone
    known = [outcome for outcome in outcomes if outcome is not None]
    return RunOutcome(
        status=status,
        storage_error=next((o.storage_error for o in known if o.storage_error), None),
        master_port=known[0].master_port if known and outcomes[0] is not None else None,
        notes=[note for o in known for note in o.notes],
        lost_nodes=dict(lost),
        # Launchers stopped by a signal the kernel did not send (a scheduler's scancel, a user's kill).
        stopped_from_outside={} if cancelled else {
            node: o.signal_received for node, o in enumerate(outcomes) if o is not None and o.signal_received
        },
        dropped_lines={k: v for o in known for k, v in o.dropped_lines.items()},
        lines_sent={k: v for o in known for k, v in o.lines_sent.items()},
        ranks=sorted(ranks, key=lambda entry: entry.rank),
    )
