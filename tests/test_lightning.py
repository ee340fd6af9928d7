"""Lightning inside the ranks: it sees torchrun's environment and does not launch again (its
process-starting strategies run in the ranks nbshard started)."""

from __future__ import annotations

import pytest

import lightning_jobs
import nbshard
from conftest import gpu_count

pytestmark = pytest.mark.timeout(240)


def test_trainer_with_model_parallel_strategy_trains_sharded():
    result = nbshard.run(lightning_jobs.trainer_model_parallel, 3, nproc=2, show_ranks=[0])
    assert result["launched_by"] == "TorchElasticEnvironment"
    assert result["world_size"] == 2 and result["sharded"]
    assert result["last"] < result["first"]


def test_build_sharded_in_configure_model_trains_with_chunked_embedding_and_head():
    result = nbshard.run(lightning_jobs.trainer_build_sharded_language_model, 4, nproc=2, show_ranks=[0])
    assert result["chunked"] == ["embed", "head"]
    assert result["last"] < result["first"] - 1, result  # a copy task: the loss starts near ln(1001) = 6.9


def test_fabric_with_empty_init_builds_on_meta_and_trains():
    result = nbshard.run(lightning_jobs.fabric_empty_init, 30, nproc=2)
    assert result["on_meta"] and result["world_size"] == 2
    assert result["last"] < result["first"]


@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_spawn"])
def test_trainer_with_a_process_starting_strategy_trains_in_the_ranks_nbshard_started(strategy):
    # ddp_notebook is what Lightning tells notebook users to pick; inside a rank it started a
    # group of its own per rank (ports clashed), and ddp_spawn could not load the notebook's classes.
    handle = nbshard.submit(lightning_jobs.trainer_notebook_strategy, strategy, 5, nproc=2, return_all=True)
    results = handle.result()
    assert [r["global_rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["pids"] == {r["pid"]} for r in results)  # no process of Lightning's own
    assert results[0]["weights"] == results[1]["weights"]  # started apart: DDP kept them one
    assert results[0]["last"] < results[0]["first"]
    assert "runs in the ranks nbshard started" in handle.logs(0)
    assert "nbshard started" not in handle.logs(1)  # said once, by rank 0


def test_a_process_starting_strategy_asked_for_other_processes_than_the_ranks_says_so():
    # One rank and devices=2: Lightning forked two processes that each thought themselves the only one.
    with pytest.raises(nbshard.JobFailed, match=r"asked for 2 processes \(devices=2, num_nodes=1\), but nbshard started 1 rank"):
        nbshard.run(lightning_jobs.trainer_notebook_strategy, "ddp_notebook", 1, 2, nproc=1)


def test_fabric_launch_with_ddp_notebook_runs_the_function_in_each_rank():
    results = nbshard.run(lightning_jobs.fabric_notebook_launch, "ddp_notebook", nproc=2, return_all=True)
    assert [r["global_rank"] for r in results] == [0, 1]
    assert all(r["pid"] == r["rank_pid"] and r["world_size"] == 2 and r["sum"] == 2.0 for r in results)


@pytest.mark.gpu
def test_trainer_strategy_fsdp_on_gpus():
    assert nbshard.run(lightning_jobs.trainer_fsdp_on_gpus, 2, nproc=min(gpu_count(), 2)) == min(gpu_count(), 2)
