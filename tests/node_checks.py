"""What every backend with several nodes must do, checked the same way for each (the engines'
own tests call these with their backend name)."""

from __future__ import annotations

import time

import pytest

import nbshard
import programs
from conftest import run_gone_within
from test_failures import wait_for_output


def a_failure_on_node_1_stops_node_0_and_leads_the_error(backend: str) -> None:
    handle = nbshard.submit(programs.raise_on_rank, 1, "bad batch on node 1", 0.5, nproc=1, nnodes=2, backend=backend)
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=120)
    assert (caught.value.failures[0].rank, caught.value.failures[0].message) == (1, "bad batch on node 1")
    assert str(caught.value.__cause__) == "bad batch on node 1"
    assert run_gone_within(handle.run_dir.name, 5)


def cancel_stops_every_node_within_5_seconds(backend: str) -> None:
    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend=backend)
    wait_for_output(handle, "ready", range(2))  # handle.logs reads each rank's log from its node while it runs
    started = time.monotonic()
    handle.cancel()
    assert time.monotonic() - started < 5
    assert isinstance(handle.exception(), nbshard.JobCancelled)
    assert run_gone_within(handle.run_dir.name, 5)
