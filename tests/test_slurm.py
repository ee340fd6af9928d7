"""backend="slurm": srun starts one task per node, and each runs nbshard's launcher. A real Slurm
cluster of two nodes (munged, slurmctld, two slurmd) on this machine, on loopback."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

import nbshard
import node_checks
import programs
from conftest import node_launcher, parent_of, run_gone_within, wait_for_ranks
from slurm_cluster import SlurmCluster, missing
from test_nodes import node_environment

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture(scope="module")
def cluster():
    # Not under pytest's private temporary directories: munged wants every directory above its socket searchable.
    root = Path(tempfile.mkdtemp(prefix="nbshard-slurm-"))
    root.chmod(0o755)
    started = SlurmCluster(root / "cluster")
    yield started
    started.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm(cluster, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    yield cluster
    deadline = time.monotonic() + 20
    while cluster.jobs() and time.monotonic() < deadline:  # every allocation a test made is released
        time.sleep(0.2)
    assert not cluster.jobs(), f"Slurm jobs left behind: {cluster.jobs()}"


def test_each_srun_task_runs_a_nodes_ranks_with_the_multi_node_environment(slurm, capsys):
    handle = nbshard.submit(node_environment, nproc=1, nnodes=2, backend="slurm", return_all=True)
    handle.watch()
    envs = handle.result()
    assert [(e["RANK"], e["GROUP_RANK"], e["NODE_RANK"]) for e in envs] == [("0", "0", "0"), ("1", "1", "1")]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and all(e["sum"] == 1.0 for e in envs)  # Slurm's NodeAddr
    assert "[rank1]: rank 1 of 2 on node 1" in capsys.readouterr().out  # streamed through srun's output
    assert "rank 1 of 2 on node 1" in handle.logs(1)
    assert sorted(handle.peak_memory()) == [0, 1]


def test_a_failure_on_one_node_stops_the_other_and_leads_the_error(slurm):
    node_checks.a_failure_on_node_1_stops_node_0_and_leads_the_error("slurm")


def test_cancel_stops_every_node_within_5_seconds(slurm):
    node_checks.cancel_stops_every_node_within_5_seconds("slurm")


def test_scancel_of_the_allocation_fails_the_job_saying_the_scheduler_stopped_it(slurm):
    import subprocess

    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend="slurm")
    wait_for_ranks(handle, 2)
    subprocess.run(["scancel", f"--name=nbshard-{handle.run_dir.name}"], env=slurm.env, check=True)
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=60)
    # Slurm signals every process of the step. Whichever takes SIGTERM first (srun's task, the
    # launchers, the ranks), each task ends after its launcher has said how its ranks ended, so the
    # person is told one thing: the job was stopped from outside, on every node.
    message = str(caught.value)
    assert message.startswith("The job was stopped from outside: the launchers were signalled (node 0's got SIGTERM, "
                              "node 1's got SIGTERM)"), message
    assert "was lost" not in message, message
    assert run_gone_within(handle.run_dir.name, 5)


def test_a_killed_kernel_takes_every_node_along(slurm, script):
    kernel = script(
        """
        import nbshard, programs
        handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend="slurm")
        print("run", handle.run_dir.name, flush=True)
        handle.watch()
        """
    )
    run_id = kernel.wait_for("run ").split()[1]
    kernel.wait_for("ready")
    kernel.wait_for("ready")
    kernel.process.kill()
    assert run_gone_within(run_id, 5), "a launcher or rank outlived the kernel"  # srun's stdin ends, then every launcher


def test_a_failure_restarts_every_node_with_a_new_srun(slurm, tmp_path):
    import restart_jobs

    handle = nbshard.submit(restart_jobs.train_with_checkpoints, str(tmp_path), 6, 3, 1, 1,
                            nproc=1, nnodes=2, backend="slurm", max_restarts=1)
    assert handle.result(timeout=120) == {"step": 6, "total": 42.0, "resumed_from": 3, "restart_count": 1, "max_restarts": 1}
    assert handle.attempts[0].cause == "on rank 1: RuntimeError: boom at step 3 in attempt 0"
    assert "attempt 1 starts at step 3" in handle.logs(1)
    assert run_gone_within(handle.run_dir.name, 5)


def test_a_frozen_node_is_lost_after_its_heartbeat(slurm):
    import contextlib
    import os
    import signal

    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend="slurm", backend_options={"heartbeat": 3})
    wait_for_ranks(handle, 2)
    task = parent_of(node_launcher(handle.run_dir.name, 1))  # the launcher's parent: node 1's srun task
    os.kill(task, signal.SIGSTOP)  # node 1's task stops answering; its launcher and rank run on
    try:
        with pytest.raises(nbshard.JobFailed) as caught:
            handle.result(timeout=60)
        assert "node 1 was lost: its srun task was not heard from for 3 s" in str(caught.value)
        assert run_gone_within(handle.run_dir.name, 20)  # srun stopped; Slurm ends the frozen task's step
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(task, signal.SIGCONT)
