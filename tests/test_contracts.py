"""The typed contracts between processes: built and parsed in one place, versioned."""

from __future__ import annotations

import json

import pytest

from nbshard.contracts import LAUNCH_SPEC_VERSION, Attempt, LaunchSpec, RankOutcome, RunOutcome, Status


def test_a_launch_spec_round_trips_through_its_file(tmp_path):
    spec = LaunchSpec(address="ipc:///x", run_id="r", cwd="/", nproc_per_node=2, nnodes=3, env={"A": "1"}, gpus=[0, 1])
    spec.write(tmp_path / "launch.json")
    read = LaunchSpec.read(tmp_path / "launch.json")
    assert read == spec and read.version == LAUNCH_SPEC_VERSION
    assert (read.world_size, read.replace(node_rank=2).first_rank()) == (6, 4)


def test_a_launch_spec_of_another_version_or_with_unknown_fields_says_so(tmp_path):
    data = LaunchSpec(address="a", run_id="r", cwd="/", nproc_per_node=1).to_json()
    with pytest.raises(ValueError, match=f"version 99, this nbshard reads version {LAUNCH_SPEC_VERSION}: the launcher runs another version of nbshard"):
        LaunchSpec.from_json({**data, "version": 99})
    with pytest.raises(ValueError, match=r"fields this nbshard does not know \(nproc\)"):
        LaunchSpec.from_json({**data, "nproc": 2})


def test_an_outcome_round_trips_with_typed_status_ranks_and_int_keys(tmp_path):
    outcome = RunOutcome(
        status=Status.FAILED, first_failure=1, master_port=29500,
        ranks=[RankOutcome(0, -15, False, 1.5, stopped=True, stacks="s"), RankOutcome(1, 1, False, 1.0)],
        attempts=[Attempt(1, 1, "on rank 1: ValueError", "/x/attempt-0")],
        dropped_lines={1: 3}, lost_nodes={2: "gone"},
    )
    outcome.write(tmp_path / "outcome.json")
    on_disk = json.loads((tmp_path / "outcome.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["dropped_lines"] == {"1": 3} and on_disk["lost_nodes"] == {"2": "gone"}
    read = RunOutcome.read(tmp_path / "outcome.json")
    assert read == outcome and read.status is Status.FAILED and not read.succeeded
    assert RunOutcome.read(tmp_path / "missing.json") is None
