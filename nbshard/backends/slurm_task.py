"""A node's side of the "slurm" backend: one ``srun`` task (``python -m
nbshard.backends.slurm_task RUN_DIR RESTART_COUNT``), which makes its node's directory, meets
the other nodes (node 0 publishes the rendezvous address), relays its ranks' frames to its
stdout (srun brings them to the kernel), says it is alive, and runs the node's launcher."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nbshard.backends.relay import NodeRelay
from nbshard.contracts import LaunchSpec
from nbshard.files import mkdir_private, read_json, write_atomic, write_json
from nbshard.ports import pick_port
from nbshard.run_dir import RunDir

__all__ = ["ALIVE_EVERY", "ALIVE_PREFIX", "FRAME_PREFIX", "main"]

FRAME_PREFIX = "NBSHARD-FRAME "
ALIVE_PREFIX = "NBSHARD-ALIVE "
ALIVE_EVERY = 1.0  # seconds between a task's signs of life
MASTER_WAIT = 120.0  # seconds a node waits for node 0 to publish the rendezvous address


def _node_address(name: str) -> str:
    """The address Slurm reaches this node at (its NodeAddr), else its name resolved."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True, timeout=10).stdout
        for field in out.split():
            if field.startswith("NodeAddr="):
                return field.split("=", 1)[1]
    return socket.gethostbyname(name)


def _rendezvous(run_dir: RunDir, node_rank: int) -> tuple[str, int]:
    """Node 0 publishes its address and a port free on it; the other nodes read them."""
    published = run_dir.path / "nodes" / "master.json"
    if node_rank == 0:
        where: dict[str, Any] = {"addr": _node_address(os.environ.get("SLURMD_NODENAME", socket.gethostname())), "port": pick_port(None)}
        write_json(published, where)
        return where["addr"], where["port"]
    deadline = time.monotonic() + MASTER_WAIT
    while not published.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"node 0 never published the rendezvous address in {published}: is the run directory on a filesystem every node shares?")
        time.sleep(0.05)
    where = read_json(published)
    return where["addr"], where["port"]


class _Stdout:
    """This task's stdout, one whole line at a time from any thread (srun brings it home)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            sys.stdout.buffer.write((text + "\n").encode())
            sys.stdout.buffer.flush()




def _say_alive(node_rank: int, out: _Stdout) -> None:
    with contextlib.suppress(OSError, ValueError):
        while True:
            out.line(f"{ALIVE_PREFIX}{node_rank}")
            time.sleep(ALIVE_EVERY)


def _pass_on(launcher: Any) -> None:
    """What srun brings to this task's stdin (the kernel's cancel or kill, then its end of file
    when the kernel dies) goes to the launcher, as a kernel on this node would write it."""
    with contextlib.suppress(OSError):
        while data := os.read(sys.stdin.fileno(), 64):
            launcher.request(data)
    launcher.end_input()


# srun's step variables would tell Lightning (SLURMEnvironment) that srun started the ranks,
# one task per node; the ranks are torchrun-style instead. The job's own variables stay.
_STEP_VARIABLES = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_", "SLURM_TASK", "SLURM_NNODES")


def main(run_dir: str, restart_count: int = 0) -> int:
    """One srun task: this node's directory, the rendezvous, the relay, then the launcher."""
    from nbshard.backends.local import start_cold

    paths = RunDir(Path(run_dir))
    spec = LaunchSpec.read(paths.launch)
    node_rank = int(os.environ["SLURM_NODEID"])
    node_dir = paths.node(node_rank)
    mkdir_private(node_dir.path, exist_ok=True)
    master_addr, port = _rendezvous(paths, node_rank)
    out = _Stdout()
    relay = NodeRelay(node_dir.path, lambda frames: out.line(FRAME_PREFIX + " ".join(base64.b64encode(f).decode() for f in frames)))
    address = relay.address  # the ranks' only way out
    threading.Thread(target=_say_alive, args=(node_rank, out), daemon=True).start()
    write_atomic(node_dir.key, paths.key.read_bytes())
    if paths.job.exists():
        write_atomic(node_dir.job, paths.job.read_bytes())
    spec.replace(
        node_rank=node_rank, master_addr=master_addr, master_port=spec.master_port or port,
        address=address, kernel_pid=os.getpid(), restart_count=restart_count,
    ).write(node_dir.launch)
    # The launcher's stdin is this task's: srun's, which carries the kernel's words and its end.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STEP_VARIABLES)}
    launcher = start_cold(node_dir, env, spec.cwd if os.path.isdir(spec.cwd) else str(node_dir.path))
    # Slurm signals every process of the step (scancel, a time limit): this task passes the signal on
    # (the launcher may be in a session of its own) and ends after its launcher, so srun ends only
    # once the launcher has written how its ranks ended, and the kernel reads "stopped from outside".
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, _: launcher.signal(received))
    threading.Thread(target=_pass_on, args=(launcher,), daemon=True).start()
    code = launcher.wait()
    time.sleep(0.5)  # the launcher's last frames, through the relay
    launcher.close()
    relay.close()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
