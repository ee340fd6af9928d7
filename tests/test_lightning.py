"""Lightning inside the ranks: it sees torchrun's environment and does not launch again."""

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


@pytest.mark.gpu
def test_trainer_strategy_fsdp_on_gpus():
    assert nbshard.run(lightning_jobs.trainer_fsdp_on_gpus, 2, nproc=min(gpu_count(), 2)) == min(gpu_count(), 2)
