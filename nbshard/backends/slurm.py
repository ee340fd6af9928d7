"""The "slurm" backend: ``srun`` starts one task per node, and each task runs nbshard's launcher.

The kernel runs ``srun --nodes=N --ntasks-per-node=1 --input=all --kill-on-bad-exit=1`` inside
the allocation it has (or srun asks for one, as it does outside an allocation). The run
directory lives on the filesystem Slurm sites share between nodes (``NBSHARD_RUNS_DIR``; the
default under ``~/.cache`` is in the home directory): each node's launcher works in
``nodes/node-K/`` there, node 0 publishes the rendezvous address and a port free on it, and
the ranks' files are in place when the job ends.

Everything else travels on Slurm's own channels, so the kernel opens no port: what the kernel
writes to srun's stdin (a cancel, a kill, and its end of file when the kernel dies) reaches
every task, which hands it to its launcher as a local kernel would; the ranks' signed frames
go to a Unix socket in their node's directory, read by the node's task, which writes them as
text lines to its stdout, which srun brings to the kernel; the kernel checks them against the
run's key.

Each task also says it is alive every second on that channel; a node not heard from for
``heartbeat`` seconds is lost (a frozen node or a broken network), and srun is stopped.

``backend_options``: ``srun_args`` (a list of extra srun arguments, e.g.
``["--partition=gpu", "--gpus-per-node=8", "--time=2:00:00"]``), ``env_allow`` (more
variable-name prefixes of the kernel's environment to pass on), ``heartbeat`` (seconds,
default 30).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from nbshard.backends.nodes import NodeGroup
from nbshard.backends.relay import ENV_ALLOW, Forwarder, importable_env, move_rank_files, node_outcome, read_log
from nbshard.backends.slurm_task import ALIVE_PREFIX, FRAME_PREFIX
from nbshard.contracts import LaunchSpec, RunOutcome
from nbshard.files import open_private
from nbshard.job import KILL, check_seconds
from nbshard.run_dir import RunDir

__all__ = ["ENV_KEEP", "start_slurm"]

# What of the kernel's environment the tasks get (srun passes its own environment on): what
# finds Python and its libraries on the nodes, the allow-list other backends use, and env=.
ENV_KEEP = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "HOME", "USER", "LANG", "LC_", "TMPDIR", "SLURM_")
_OPTIONS = {"srun_args", "env_allow", "heartbeat"}
KILL_AFTER = 3.0  # seconds srun gets to end the step after a kill before it is stopped
SRUN_END_WAIT = 10.0  # seconds srun gets to end by itself once the nodes have ended
SRUN_TERM_WAIT = 5.0  # seconds between SIGTERM and SIGKILL to srun
OUTCOME_WAIT = 5.0  # seconds a node's outcome may take to show on the shared filesystem once srun ended


# -- the kernel's side ---------------------------------------------------------


class SlurmStep:
    """The one srun of a run: its stdin reaches every node's launcher, its stdout brings frames."""

    def __init__(self, run_dir: RunDir, command: list[str], env: Mapping[str, str], forward: Forwarder, job_name: str) -> None:
        self.job_name = job_name
        self._log = open_private(run_dir.path / "srun.log", "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=dict(env),
            cwd=str(run_dir.path), start_new_session=True,
        )
        self._forward = forward
        self.heard: dict[int, float] = {}  # node rank -> when its task last said it is alive
        self._reader = threading.Thread(target=self._read, name=f"nbshard-srun-{run_dir.path.name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            text = line.decode(errors="replace")
            if text.startswith(FRAME_PREFIX):
                with contextlib.suppress(ValueError):
                    self._forward.send([base64.b64decode(part) for part in text[len(FRAME_PREFIX):].split()])
            elif text.startswith(ALIVE_PREFIX):
                with contextlib.suppress(ValueError):
                    self.heard[int(text[len(ALIVE_PREFIX):])] = time.monotonic()
            else:
                with contextlib.suppress(OSError):
                    self._log.write(line)

    def write(self, command: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.popen.stdin is not None
            self.popen.stdin.write(command)  # a line: the kernel's words end with their newline
            self.popen.stdin.flush()

    def kill(self) -> None:
        """Ask every launcher to kill its ranks now; srun itself goes if it lingers."""
        self.write(KILL)
        timer = threading.Timer(KILL_AFTER, self._kill_srun)
        timer.daemon = True
        timer.start()

    def _kill_srun(self) -> None:
        """SIGTERM, which srun passes to the tasks before it ends the step (and the allocation it
        made, if it made one); then SIGKILL, and scancel of an allocation made under this run's name."""
        for signum, wait in ((signal.SIGTERM, SRUN_TERM_WAIT), (signal.SIGKILL, 0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(wait)
                return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", f"--name={self.job_name}"], capture_output=True, timeout=10)

    def close(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(SRUN_END_WAIT)  # the tasks end right after their launchers' outcomes
        if self.popen.poll() is None:
            self._kill_srun()
        self._reader.join(timeout=2)
        with contextlib.suppress(OSError):
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        self._log.close()


class SlurmNode:
    """One node of the step: its launcher's outcome appears in its directory on the shared filesystem."""

    def __init__(self, step: SlurmStep, node_dir: RunDir, node_rank: int, heartbeat: float) -> None:
        self.step, self.node_dir, self.node_rank, self.heartbeat = step, node_dir, node_rank, heartbeat
        self._outcome: RunOutcome | None = None  # once written, it stays: read no more
        self._srun_ended_at: float | None = None

    def poll(self) -> int | None:
        if self.outcome() is not None:
            return 0
        return self._srun_code()

    def _srun_code(self) -> int | None:
        """srun's exit code once it ended and the node's outcome had ``OUTCOME_WAIT`` s to show (a
        shared filesystem may show a file written on the node a moment later), else None."""
        code = self.step.popen.poll()
        if code is None:
            return None
        self._srun_ended_at = self._srun_ended_at or time.monotonic()
        return code if time.monotonic() - self._srun_ended_at > OUTCOME_WAIT else None

    def lost(self) -> str | None:
        code = self._srun_code()  # before the outcome: a launcher writes it before its task, and so srun, can end
        heard = self.step.heard.get(self.node_rank)  # none before the task started: srun may wait in a queue
        silent = self.step.popen.poll() is None and heard is not None and time.monotonic() - heard > self.heartbeat
        if (code is None and not silent) or self.outcome() is not None:
            return None  # the shared filesystem is read only when srun ended or the node went silent
        if silent:
            return f"its srun task was not heard from for {self.heartbeat:g} s (the node froze or its network failed)"
        return (
            f"srun ended (exit code {code}) before this node's launcher said how its ranks ended: the "
            f"allocation was cancelled (scancel), ran out of time, or the node failed; see {self.step._log.name}"
        )

    def outcome(self) -> RunOutcome | None:
        if self._outcome is None:
            self._outcome = node_outcome(self.node_dir)
        return self._outcome

    def request(self, command: bytes) -> None:
        self.step.write(command)

    def kill(self) -> None:
        self.step.kill()

    def close(self) -> None:
        pass  # the step is closed once, by the group's cleanup

    def bring_home(self, run_dir: RunDir) -> None:
        move_rank_files(self.node_dir, run_dir)

    def live_log(self, rank: int) -> bytes:
        return read_log(self.node_dir, rank)


def start_slurm(run_dir: RunDir, env: Mapping[str, str], cwd: str, *, preload: Sequence[str] | None = None) -> NodeGroup:
    """``srun`` one task per node; each runs ``python -m nbshard.backends.slurm_task RUN_DIR``."""
    srun = shutil.which("srun", path=env.get("PATH"))
    if srun is None:
        raise RuntimeError("backend='slurm' needs Slurm's srun on PATH: run the notebook on a Slurm cluster's node")
    spec = LaunchSpec.read(run_dir.launch)
    unknown = set(spec.backend_options) - _OPTIONS
    if unknown:
        raise ValueError(f"backend_options for slurm: unknown {', '.join(sorted(unknown))}; known: {', '.join(sorted(_OPTIONS))}")
    options = {"srun_args": [], "env_allow": (), "heartbeat": 30.0, **spec.backend_options}
    check_seconds("backend_options['heartbeat']", options["heartbeat"])
    if spec.gpus is not None:
        raise ValueError("backend='slurm' gives each node the GPUs Slurm assigns it: ask with srun_args=['--gpus-per-node=N'], not gpus=")
    keep = (*ENV_KEEP, *ENV_ALLOW, *options["env_allow"])
    task_env = importable_env({**{k: v for k, v in env.items() if k.startswith(keep)}, **spec.env})
    nnodes = spec.nnodes
    job_name = f"nbshard-{run_dir.path.name}"[:120]
    forward = Forwarder(spec.address)
    steps: list[SlurmStep] = []

    def launch(restart_count: int) -> list[SlurmNode]:
        if steps:
            steps[-1].close()  # the failed attempt's srun, ending by itself
        command = [
            srun, f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1", "--input=all", "--kill-on-bad-exit=1",
            f"--job-name={job_name}", *map(str, options["srun_args"]),
            sys.executable, "-m", "nbshard.backends.slurm_task", str(run_dir.path), str(restart_count),
        ]
        steps.append(SlurmStep(run_dir, command, task_env, forward, job_name))
        return [SlurmNode(steps[-1], run_dir.node(k), k, options["heartbeat"]) for k in range(nnodes)]

    def cleanup() -> None:
        steps[-1].close()
        forward.close()

    return NodeGroup(run_dir, launch(0), spec.nproc_per_node, spec.address, cleanup, relaunch=launch, max_restarts=spec.max_restarts)


if __name__ == "__main__":  # the command line of nbshard before slurm_task.py
    from nbshard.backends.slurm_task import main

    sys.exit(main(sys.argv[1], int(sys.argv[2])))
