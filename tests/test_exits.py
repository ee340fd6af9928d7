"""A rank leaves as a script does once its function returned: its threads that are not
daemons finish, its atexit handlers run. One slow to do so is shown where it waits, and a stop
(the timeout, a cancel) ends those exits with the job's values kept."""

from __future__ import annotations

import time

import pytest

import nbshard
import programs
from conftest import wait_until_gone
from test_warm import warm_ready
from nbshard.process.exits import NOTE_AFTER
from nbshard.run_dir import RunDir

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_work_left_in_threads_and_executors_is_finished_before_a_rank_exits(tmp_path, monkeypatch, warm):
    monkeypatch.setattr(nbshard.settings, "warm", warm)
    if warm:
        warm_ready()
    handle = nbshard.submit(programs.finish_in_background, str(tmp_path / "written"), nproc=2)
    assert handle.result(timeout=60) == 0 and handle.warm is warm, getattr(handle._launcher, "note", None)
    # As after `python script.py`: both files are there once the job ended, not some time later.
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("written")) == [
        f"written-{kind}-{rank}" for kind in ("pool", "thread") for rank in (0, 1)
    ]


def test_a_rank_that_raised_does_not_wait_for_its_threads():
    started = time.monotonic()
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(programs.leave_a_thread_spinning, 1, nproc=2, timeout=60)
    root = caught.value.failures[0]
    assert (root.rank, root.message) == (1, "raised beside a thread that never ends")
    assert time.monotonic() - started < 20  # not the timeout: the failure stopped rank 0's wait too


def test_a_rank_slow_to_exit_is_shown_where_it_waits_and_the_timeout_keeps_the_values(capsys):
    started = time.monotonic()
    handle = nbshard.submit(programs.leave_a_thread_spinning, nproc=2, timeout=NOTE_AFTER + 3, return_all=True)
    handle.watch()
    assert handle.result() == ["value of rank 0", "value of rank 1"]
    assert handle.status == "succeeded"
    assert time.monotonic() - started < NOTE_AFTER + 15
    out = capsys.readouterr().out
    note = out[out.index("[nbshard]: ranks 0, 1 returned"):]
    assert "have not exited: Python waits for the threads the job started that are not daemon threads; one of the job's threads ('spinning') is at:" in note
    assert "in spin_forever" in note and "time.sleep(0.05)" in note  # the thread's own place and line
    assert "the job ran past its timeout of 13 s after every rank had returned: stopping ranks 0, 1" in out
    assert not wait_until_gone(handle.run_dir, within=5)


@pytest.mark.parametrize("nnodes", [1, 2])
def test_cancelling_a_job_whose_ranks_only_exit_returns_its_value(nnodes):
    handle = nbshard.submit(programs.hang_at_exit, "the value", nproc=2 // nnodes, nnodes=nnodes)
    # On several nodes, each node's files stay in its own folder until the job ends.
    folders = [handle.run_dir / "nodes" / f"node-{rank}" if nnodes > 1 else handle.run_dir for rank in (0, 1)]
    results = [RunDir(folder).result(rank) for rank, folder in enumerate(folders)]
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in results):
        assert time.monotonic() < deadline and not handle.done(), "the ranks never returned"
        time.sleep(0.05)
    assert not handle.done()  # each rank waits in its atexit handler
    handle.cancel()
    assert handle.result(timeout=30) == "the value"
    assert not wait_until_gone(handle.run_dir, within=5)


def test_a_job_cancelled_before_every_rank_returned_is_still_cancelled():
    handle = nbshard.submit(programs.sleep_forever, nproc=2)
    deadline = time.monotonic() + 60
    while not all("working" in handle.logs(rank) for rank in (0, 1)):
        assert time.monotonic() < deadline, handle.logs()
        time.sleep(0.05)
    handle.cancel()
    with pytest.raises(nbshard.JobCancelled):
        handle.result(timeout=30)
