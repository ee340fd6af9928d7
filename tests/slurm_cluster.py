"""A real Slurm cluster of two nodes on this machine, for the slurm backend's tests: munged,
slurmctld and two slurmd (nodes n1 and n2, both at 127.0.0.1 on ports of their own), with
their configuration, state and logs in one directory. Needs root and Debian's slurm-wlm."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from nbshard.ports import pick_port

CONFIG = """\
ClusterName=nbshardtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
ReturnToService=2
MpiDefault=none
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1_port} CPUs=1 RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2_port} CPUs=1 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    absent = [name for name in ("munged", "slurmctld", "slurmd", "srun") if shutil.which(name) is None]
    if absent:
        return "Slurm is not installed (apt-get install slurm-wlm munge)"
    return None


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o755)  # munged wants its socket's directories searchable by everyone
        for folder in ("state", "spool/n1", "spool/n2"):
            (root / folder).mkdir(parents=True)
        ports = {name: pick_port() for name in ("ctld_port", "d_port", "n1_port", "n2_port")}
        self.conf = root / "slurm.conf"
        self.conf.write_text(CONFIG.format(root=root, host=os.uname().nodename, **ports))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        key = root / "munge.key"  # our own: the system's belongs to the munge user, which munged as root refuses
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.daemons = [
            subprocess.Popen(["munged", "-F", f"--socket={root}/munge.sock", f"--pid-file={root}/munged.pid", f"--key-file={key}",
                              f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"], env=self.env),
        ]
        self._wait_for(lambda: (root / "munge.sock").exists(), "munged")
        self.daemons.append(subprocess.Popen(["slurmctld", "-D", "-c", "-i"], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
        for node in ("n1", "n2"):
            self.daemons.append(subprocess.Popen(["slurmd", "-D", "-N", node], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait_for(self._nodes_idle, "two idle Slurm nodes")

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=self.env, capture_output=True, text=True).stdout
        return out.split() == ["idle", "2"]

    def _wait_for(self, condition, what: str, within: float = 60) -> None:
        deadline = time.monotonic() + within
        while not condition():
            if time.monotonic() > deadline or any(d.poll() is not None for d in self.daemons):
                logs = "\n".join(p.read_text()[-2000:] for p in self.root.glob("*.log"))
                self.stop()
                raise RuntimeError(f"{what} did not come up within {within:g} s (or a daemon exited):\n{logs}")
            time.sleep(0.2)

    def jobs(self) -> str:
        return subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True).stdout.strip()

    def stop(self) -> None:
        subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=30)
        for daemon in reversed(self.daemons):
            daemon.terminate()
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
