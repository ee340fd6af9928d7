"""Many runs, concurrent runs, ports, run directories: nothing leaks, nothing collides."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

import nbshard
import programs
from conftest import nbshard_processes

pytestmark = pytest.mark.timeout(300)


def test_50_runs_back_to_back_leave_no_processes_descriptors_or_extra_run_dirs(monkeypatch, runs_dir):
    monkeypatch.setattr(nbshard.settings, "keep_runs", 3)
    nbshard.run(programs.rank_and_value, 1, nproc=2)  # warm up what a first run opens once (zmq context)
    descriptors = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))
    for index in range(50):
        assert nbshard.run(programs.rank_and_value, index, nproc=2, return_all=True) == [0, index]
    time.sleep(0.2)
    assert len(os.listdir("/proc/self/fd")) <= descriptors
    assert len(os.listdir("/proc/self/task")) <= threads
    assert not [pid for pid, cmd in nbshard_processes().items() if str(runs_dir) in cmd]
    assert len(list(runs_dir.iterdir())) <= 3 + 1  # kept ones, plus the newest run that pruned them


def test_concurrent_jobs_from_one_kernel_get_their_own_ports():
    handles = [nbshard.submit(programs.allreduce_sum, nproc=2) for _ in range(3)]
    assert sorted(nbshard.jobs(), key=id) == sorted(handles, key=id)
    assert [h.result(timeout=120).item() for h in handles] == [3.0, 3.0, 3.0]
    ports = [json.loads((h.run_dir / "outcome.json").read_text())["master_port"] for h in handles]
    assert len(set(ports)) == 3
    assert nbshard.jobs() == []


def test_cancel_all_stops_every_running_job():
    handles = [nbshard.submit(programs.sleep_forever, nproc=2) for _ in range(2)]
    stopped = nbshard.cancel_all()
    assert sorted(stopped, key=id) == sorted(handles, key=id)
    for handle in handles:
        assert isinstance(handle.exception(), nbshard.JobCancelled)
    assert nbshard.jobs() == []


def test_a_taken_master_port_is_replaced_by_a_free_one():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        used = nbshard.run(programs.uses_port, nproc=2, master_port=port)
    assert int(used) != port


def test_a_port_the_jobs_own_code_finds_taken_fails_the_job_without_restarts():
    # Not MASTER_PORT: the job's own store (accelerate's notebook_launcher used 29500 in each
    # rank) clashed, and nbshard took it for its port, restarting the ranks twice in vain.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handle = nbshard.submit(programs.store_on_port, port, nproc=2)
        with pytest.raises(nbshard.JobFailed, match="EADDRINUSE|address already in use"):
            handle.result(timeout=120)
    outcome = json.loads((handle.run_dir / "outcome.json").read_text())
    assert not any("was taken" in note for note in outcome["notes"]) and outcome["master_port"] != port


def test_a_port_taken_between_choice_and_use_is_retried(tmp_path):
    # Rank 0 itself takes MASTER_PORT on the first attempt, as another program could
    # between the launcher's check and rank 0's bind: its TCPStore then fails with
    # EADDRINUSE, and the launcher restarts every rank on a fresh port.
    handle = nbshard.submit(programs.grab_master_port_once, str(tmp_path / "grabbed"), nproc=2)
    total, port, restarts = handle.result(timeout=120)
    assert total == 3.0 and restarts == "1"
    outcome = json.loads((handle.run_dir / "outcome.json").read_text())
    assert outcome["master_port"] == int(port)
    assert any("was taken" in note for note in outcome["notes"])
