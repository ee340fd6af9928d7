"""The "subprocess" backend: the launcher as a child of the kernel, in its own session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

from nbshard.backends.channel import Channel
from nbshard.backends.nodes import NodeGroup
from nbshard.backends.relay import importable_env, move_rank_files, node_outcome, read_log
from nbshard.backends.warm import start_pending_warm, warm_launch
from nbshard.backends.warm_launcher import WarmLauncher
from nbshard.contracts import LaunchSpec, RunOutcome
from nbshard.files import mkdir_private, open_private, write_atomic
from nbshard.process.fresh import cold_command
from nbshard.environment import rank_environment
from nbshard.run_dir import RunDir
from nbshard.ports import pick_port

__all__ = ["LauncherProcess", "LocalNode", "start_cold", "start_local", "start_node"]


class LauncherProcess:
    """The launcher of one run, seen from the kernel.

    Its stdin is a socket only the kernel holds the other end of (``Channel``): a line on it
    is a command, and its end-of-file, when the kernel dies however it dies, tells the
    launcher to stop every rank. No ``preexec_fn`` (unsafe in the threaded kernel) and no
    ``PR_SET_PDEATHSIG`` (it follows threads, not processes).
    """

    note: str | None = None  # why this launch is cold, when the kernel asked for a warm one

    def __init__(self, popen: subprocess.Popen[bytes], channel: Channel) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.channel = channel

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._popen.wait(timeout)

    def request(self, command: bytes) -> None:
        """Write a command line to the launcher (see nbshard.job.CANCEL and KILL)."""
        self.channel.request(command)

    def signal(self, signum: int) -> None:
        """Pass a signal on to the launcher (itself: it stops its ranks as for a cancel from outside)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signum)

    def end_input(self) -> None:
        """End the launcher's input as a kernel's death would: the launcher stops its ranks."""
        self.channel.end_input()

    def kill(self) -> None:
        """SIGKILL the launcher and everything in its process group: every rank."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """The run is over: SIGKILL whatever its ranks left in the process group, drop the channel."""
        self.kill()
        self.channel.close()


def start_cold(run_dir: RunDir, env: Mapping[str, str], cwd: str) -> LauncherProcess:
    channel = Channel()
    try:
        with open_private(run_dir.launcher_log, "wb") as log:
            popen = subprocess.Popen(
                cold_command("nbshard.launcher", str(run_dir.path)),
                stdin=channel.launcher_end.fileno(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
    except BaseException:
        channel.close()
        raise
    finally:
        channel.launcher_started()
    return LauncherProcess(popen, channel)


def start_local(
    run_dir: RunDir, env: Mapping[str, str], cwd: str, *, preload: Sequence[str] | None = None
) -> LauncherProcess | WarmLauncher | NodeGroup:
    """The launcher of ``run_dir``: forked by the warm process when ``preload`` is given (the
    modules it imports) and it can, else a fresh interpreter; ``.note`` says why it is cold.
    A multi-node run gets one launcher per node, all on this machine, behind a ``NodeGroup``."""
    spec = LaunchSpec.read(run_dir.launch)
    if spec.nnodes > 1:
        return _start_nodes(run_dir, spec, env, cwd, preload)
    return start_node(run_dir, env, cwd, preload)


class LocalNode:
    """One node of a multi-node run on this machine: its launcher and its run directory."""

    def __init__(self, launcher: LauncherProcess | WarmLauncher, node_dir: RunDir) -> None:
        self.launcher, self.node_dir = launcher, node_dir
        self.poll, self.request, self.kill, self.close = launcher.poll, launcher.request, launcher.kill, launcher.close

    def outcome(self) -> RunOutcome | None:
        return node_outcome(self.node_dir)

    def lost(self) -> str | None:
        return None  # a launcher on this machine is lost when it exits without an outcome

    def bring_home(self, run_dir: RunDir) -> None:
        move_rank_files(self.node_dir, run_dir)

    def live_log(self, rank: int) -> bytes:
        return read_log(self.node_dir, rank)


def _start_nodes(run_dir: RunDir, spec: LaunchSpec, env: Mapping[str, str], cwd: str, preload: Sequence[str] | None) -> NodeGroup:
    """Each node a launcher of its own, in its own directory under the run's."""

    def launch(restart_count: int) -> list[LocalNode]:
        port = pick_port(spec.master_port)  # node 0's, for every node
        nodes: list[LocalNode] = []
        try:
            for node_rank in range(spec.nnodes):
                node_dir = run_dir.node(node_rank)
                mkdir_private(node_dir.path)
                write_atomic(node_dir.key, run_dir.key.read_bytes())
                if run_dir.job.exists():
                    os.link(run_dir.job, node_dir.job)
                spec.replace(node_rank=node_rank, master_port=port, restart_count=restart_count).write(node_dir.launch)
                nodes.append(LocalNode(start_node(node_dir, env, cwd, preload), node_dir))
        except BaseException:
            for node in nodes:
                node.kill()
            raise
        return nodes

    nodes = launch(0)
    group = NodeGroup(run_dir, nodes, spec.nproc_per_node, spec.address, relaunch=launch, max_restarts=spec.max_restarts)
    group.note = next((node.launcher.note for node in nodes if node.launcher.note), None)
    return group


def start_node(
    run_dir: RunDir, env: Mapping[str, str], cwd: str, preload: Sequence[str] | None
) -> LauncherProcess | WarmLauncher:
    env = importable_env(env)
    if preload is None:
        return start_cold(run_dir, env, cwd)
    spec = LaunchSpec.read(run_dir.launch)
    rank_env = rank_environment(env, rank=0, nproc=spec.nproc_per_node, master_port=0, run_id="", run_dir=run_dir)
    cwd = os.path.abspath(cwd)
    launched, note = warm_launch(run_dir, env, cwd, preload=preload, rank_env=rank_env)
    if launched is not None:
        return launched
    launcher = start_cold(run_dir, env, cwd)
    launcher.note = note
    start_pending_warm()
    return launcher
