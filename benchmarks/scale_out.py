"""Wall time of a 2-node x 1-rank gloo job, launched five ways, alternating in one run.

The job is what every real job starts with: ``import torch``, ``init_process_group("gloo")``,
an all_reduce, return. Two "nodes" on this machine:

- ``nbshard.run(nnodes=2)`` with the subprocess backend (both node launchers here, warm);
- ``nbshard.run(nnodes=2, backend="ray")`` on a local 2-node Ray cluster (two raylets),
  fresh actors each job, and with ``keep=True`` (actors kept between jobs);
- torchrun with two c10d agents (``--nnodes 2 --rdzv-backend c10d``), one per node;
- ``nbshard.run(nnodes=2, backend="slurm")`` when this machine reaches a Slurm cluster with
  two idle nodes (``sinfo``; e.g. the test suite's, ``tests/slurm_cluster.py``);
- for scale, ``nbshard.run(nproc=2)``: the same two ranks on one node (warm).

Prints medians (and min/max) of the total and of the time from the call to the job's first
line, and ratios to torchrun. Needs Ray (pip install 'nbshard[ray]').
Usage: python benchmarks/scale_out.py [rounds]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's nodes on loopback, like the rest

import nbshard  # noqa: E402
from nbshard.ports import pick_port  # noqa: E402

JOB = textwrap.dedent(
    """
    import os, sys, time

    def job(marker_dir):
        import torch
        import torch.distributed as dist
        if not os.path.exists(os.path.join(marker_dir, "first")):  # the job's first line, after its imports
            with open(os.path.join(marker_dir, "first"), "w") as f:
                f.write(repr(time.time()))
        dist.init_process_group("gloo")
        value = torch.ones(1)
        dist.all_reduce(value)
        dist.destroy_process_group()
        return value.item()

    if __name__ == "__main__":
        job(sys.argv[1])
    """
)


def timed(root: Path, launch) -> dict[str, float]:
    marker = Path(tempfile.mkdtemp(dir=root))
    started = time.time()
    launch(str(marker))
    return {"total": time.time() - started, "first line": float((marker / "first").read_text()) - started}


def nbshard_launch(job, **options):
    def launch(marker: str) -> None:
        assert nbshard.run(job, marker, show_ranks=[], sample_interval=None, **options) == 2.0

    return launch


def torchrun_launch(script: Path):
    def launch(marker: str) -> None:
        endpoint = f"127.0.0.1:{pick_port()}"
        agents = [
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", marker[-8:],
                 "--node-rank", str(node), str(script), marker],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            for node in range(2)
        ]
        if any(agent.wait(120) for agent in agents):
            raise RuntimeError("torchrun failed")

    return launch


def slurm_has_two_idle_nodes() -> bool:
    import shutil

    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], capture_output=True, text=True).stdout.split()
    return sum(map(int, out)) >= 2


def main(rounds: int = 5) -> None:
    import ray
    from ray.cluster_utils import Cluster

    # Two CPUs a node: the kept actors hold one on each while the fresh ones take the other.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as folder:
            root = Path(folder)
            script = root / "bench_job.py"
            script.write_text(JOB)
            sys.path.insert(0, folder)
            from bench_job import job  # type: ignore[import-not-found]

            ways = {
                "torchrun, 2 agents": torchrun_launch(script),
                "nbshard 2 local nodes": nbshard_launch(job, nproc=1, nnodes=2),
                "nbshard ray": nbshard_launch(job, nproc=1, nnodes=2, backend="ray"),
                "nbshard ray, kept": nbshard_launch(job, nproc=1, nnodes=2, backend="ray", backend_options={"keep": True}),
                "nbshard 1 node x 2": nbshard_launch(job, nproc=2),
            }
            if slurm_has_two_idle_nodes():
                ways["nbshard slurm"] = nbshard_launch(job, nproc=1, nnodes=2, backend="slurm")
            for launch in ways.values():  # page cache, the warm process, the kept actors
                timed(root, launch)
            times: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
            for _ in range(rounds):
                for name, launch in ways.items():
                    times[name].append(timed(root, launch))
        base = statistics.median(t["total"] for t in times["torchrun, 2 agents"])
        print(f"{rounds} rounds, alternating; 2 nodes x 1 CPU rank on one machine: import torch, gloo all_reduce")
        for name, runs in times.items():
            total = [t["total"] for t in runs]
            median = statistics.median(total)
            first = statistics.median(t["first line"] for t in runs)
            print(f"  {name:24s} median {median:6.3f} s (min {min(total):.3f}, max {max(total):.3f})  "
                  f"ratio to torchrun {median / base:.2f}  first line after {first:.3f} s")
    finally:
        from nbshard.backends.ray import release_kept

        release_kept()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
