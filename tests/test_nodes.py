"""nnodes: one launcher per node, supervised from the kernel as one job (here every node runs on
this machine, as torchrun's nodes can; the engines place them elsewhere)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import nbshard
import programs
import restart_jobs
from conftest import node_launcher, processes_of, wait_until_gone
from test_failures import wait_for_output

pytestmark = pytest.mark.timeout(120)


def node_environment():
    import torch
    import torch.distributed as dist

    import nbshard

    nbshard.init_process_group()
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} on node {os.environ['GROUP_RANK']}", flush=True)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {**{name: os.environ[name] for name in names}, "sum": total.item()}


def test_each_rank_gets_torchruns_multi_node_environment_and_one_store():
    handle = nbshard.submit(node_environment, nproc=2, nnodes=2, return_all=True)
    envs = handle.result(timeout=90)
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["NODE_RANK"]) for e in envs] == [
        ("0", "0", "0", "0"), ("1", "1", "0", "0"), ("2", "0", "1", "1"), ("3", "1", "1", "1"),
    ]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in envs} == {("4", "2", "2")}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and all(e["sum"] == 6.0 for e in envs)  # one group of 4
    for rank in range(4):
        assert f"rank {rank} of 4 on node {rank // 2}" in handle.logs(rank)  # every log came home
    assert sorted(handle.peak_memory()) == [0, 1, 2, 3]
    assert handle.summary().startswith("node_environment on 4 ranks (2 nodes x 2): succeeded")  # the header says nodes


def test_a_rank_failing_on_one_node_stops_every_node_and_leads_the_error():
    handle = nbshard.submit(programs.raise_on_rank, 3, "diverged on node 1", 1.0, nproc=2, nnodes=2)
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=90)
    root, *others = caught.value.failures
    assert (root.rank, root.message) == (3, "diverged on node 1")
    assert sorted(f.rank for f in others) == [0, 1, 2]
    assert str(caught.value).splitlines()[0] == "The job failed on rank 3."
    assert not wait_until_gone(handle.run_dir, within=5.0)


def test_a_lost_node_is_its_own_failure_ahead_of_what_it_causes():
    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2)
    wait_for_output(handle, "ready", range(2))
    os.kill(node_launcher(handle.run_dir.name, 1), signal.SIGKILL)
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=30)
    message = str(caught.value)
    assert message.startswith("The job failed because node 1 was lost: its launcher exited (code -9)")
    assert "The errors of the other nodes' ranks follow from it" in message.splitlines()[0]
    assert caught.value.failures[0].rank == 1 and "node 1 was lost" in caught.value.failures[0].describe()
    assert not wait_until_gone(handle.run_dir, within=5.0)


def test_cancel_stops_every_node_within_5_seconds():
    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2)
    wait_for_output(handle, "ready", range(2))
    started = time.monotonic()
    assert handle.cancel() is True
    assert time.monotonic() - started < 5
    assert isinstance(handle.exception(), nbshard.JobCancelled)
    assert not wait_until_gone(handle.run_dir, within=5.0)


def test_a_timeout_stops_every_node():
    with pytest.raises(nbshard.JobTimedOut):
        nbshard.run(programs.wait_in_collective, nproc=1, nnodes=2, timeout=6)


def test_a_killed_kernel_takes_every_node_along(script, runs_dir):
    kernel = script(
        """
        import nbshard, programs
        handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2)
        handle.watch()
        """
    )
    kernel.wait_for("ready")
    kernel.wait_for("ready")
    run_dir = next(runs_dir.iterdir())
    assert len(processes_of(run_dir)) == 4  # two launchers, two ranks
    kernel.process.kill()
    assert not wait_until_gone(run_dir, within=5.0)


def test_nnodes_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="nnodes must be a positive integer"):
        nbshard.Job(print, nnodes=0)


def test_a_failure_on_one_node_restarts_every_node_from_the_checkpoint(tmp_path, capsys):
    handle = nbshard.submit(restart_jobs.train_with_checkpoints, str(tmp_path), 6, 3, 1, 1, nproc=1, nnodes=2, max_restarts=2)
    handle.watch()
    assert handle.result() == {"step": 6, "total": 42.0, "resumed_from": 3, "restart_count": 1, "max_restarts": 2}
    [attempt] = handle.attempts
    assert (attempt.rank, attempt.cause) == (1, "on rank 1: RuntimeError: boom at step 3 in attempt 0")
    kept = Path(attempt.files)
    assert (kept / "error-1.json").exists() and (kept / "nodes" / "node-1" / "outcome.json").exists()
    assert "attempt 1 failed on rank 1: RuntimeError: boom at step 3 in attempt 0; starting every node again" in capsys.readouterr().out
    log = handle.logs(1)  # every attempt, in order
    assert log.index("attempt 0 starts at step 0") < log.index("[nbshard] attempt 1 failed") < log.index("attempt 1 starts at step 3")


def test_a_multi_node_job_out_of_restarts_names_every_attempt(tmp_path):
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(restart_jobs.train_with_checkpoints, str(tmp_path), 6, 2, 1, 10, nproc=1, nnodes=2, max_restarts=1)
    assert str(caught.value).startswith(
        "The job failed on rank 1.\nThis was attempt 2, after 1 restart: attempt 1 failed on rank 1: RuntimeError: boom at step 2 in attempt 0."
    )
    assert not wait_until_gone(caught.value.run_dir, within=5.0)


def test_launchers_signalled_from_outside_say_so(tmp_path):
    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2)
    wait_for_output(handle, "ready", range(2))
    for pid, cmd in processes_of(handle.run_dir).items():
        if "nbshard.launcher" in cmd:
            os.kill(pid, signal.SIGTERM)  # as Slurm's scancel signals every process of a step
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=30)
    assert str(caught.value).startswith(
        "The job was stopped from outside: the launchers were signalled (node 0's got SIGTERM, node 1's got SIGTERM)"
    )
    assert not wait_until_gone(handle.run_dir, within=5.0)
