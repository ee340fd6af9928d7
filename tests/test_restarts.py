"""max_restarts: a failed job starts every rank again, as torchrun's --max-restarts does."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

import nbshard
import restart_jobs
from conftest import wait_until_gone

pytestmark = pytest.mark.timeout(180)


def test_a_job_that_fails_once_resumes_from_its_checkpoint_and_succeeds(tmp_path, capsys):
    handle = nbshard.submit(restart_jobs.train_with_checkpoints, str(tmp_path), 6, 3, 1, 1, nproc=2, max_restarts=2)
    handle.watch()
    result = handle.result()
    # The second attempt (TORCHELASTIC_RESTART_COUNT=1) started at the checkpoint of step 3, and
    # the sum over all six steps (2 ranks x (1 + ... + 6)) is whole: no step ran twice or not at all.
    assert result == {"step": 6, "total": 42.0, "resumed_from": 3, "restart_count": 1, "max_restarts": 2}
    [attempt] = handle.attempts
    assert attempt.attempt == 1 and attempt.rank == 1
    assert attempt.cause == "on rank 1: RuntimeError: boom at step 3 in attempt 0"
    kept = Path(attempt.files)
    assert kept.parent == handle.run_dir and (kept / "error-1.json").exists()
    assert not (handle.run_dir / "error-1.json").exists()  # the first attempt's error does not mix with the result
    shown = capsys.readouterr().out
    assert "attempt 1 failed on rank 1: RuntimeError: boom at step 3 in attempt 0; starting every rank again" in shown
    assert "(restart 1 of 2, TORCHELASTIC_RESTART_COUNT=1)" in shown
    log = handle.logs(1)
    assert log.index("attempt 0 starts at step 0") < log.index("[nbshard] attempt 1 failed") < log.index("attempt 1 starts at step 3")
    assert "restarted 1x" in handle.summary()


def test_a_job_that_keeps_failing_raises_once_restarts_run_out_naming_each_attempt(tmp_path):
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(restart_jobs.train_with_checkpoints, str(tmp_path), 6, 2, 1, 10, nproc=2, max_restarts=2)
    message = str(caught.value)
    assert message.startswith("The job failed on rank 1.\nThis was attempt 3, after 2 restarts: ")
    assert "attempt 1 failed on rank 1: RuntimeError: boom at step 2 in attempt 0; " in message
    assert "attempt 2 failed on rank 1: RuntimeError: boom at step 2 in attempt 1." in message
    assert str(caught.value.__cause__) == "boom at step 2 in attempt 2"  # the last attempt's own error
    assert not wait_until_gone(caught.value.run_dir, within=5)


def test_a_rank_killed_by_a_signal_is_restarted_too():
    handle = nbshard.submit(restart_jobs.killed_in_first_attempt, int(signal.SIGKILL), nproc=2, max_restarts=1, return_all=True)
    assert handle.result(timeout=120) == [1, 1]
    assert handle.attempts[0].cause == "on rank 1: killed by SIGKILL"


def test_a_cancelled_job_is_never_restarted(tmp_path):
    marker = tmp_path / "second-attempt"
    handle = nbshard.submit(restart_jobs.fails_in_first_attempt_then_sleeps, str(marker), nproc=2, max_restarts=5)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    handle.cancel()
    assert time.monotonic() - started < 5
    assert isinstance(handle.exception(), nbshard.JobCancelled)
    assert len(handle.attempts) == 1  # the failed first attempt; the cancelled second one is not restarted
    assert "This was attempt 2, after 1 restart: attempt 1 failed on rank " in str(handle.exception())
    assert "ValueError: first attempt fails" in handle.attempts[0].cause
    assert not wait_until_gone(handle.run_dir, within=5)


def test_a_timeout_is_not_restarted():
    with pytest.raises(nbshard.JobTimedOut):
        nbshard.run(restart_jobs.fails_in_first_attempt_then_sleeps, "/dev/null", nproc=1, max_restarts=3, timeout=8)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_max_restarts_must_be_a_whole_number(bad):
    with pytest.raises(ValueError, match="max_restarts must be a whole number of restarts"):
        nbshard.Job(print, max_restarts=bad)


def test_a_session_refuses_a_job_with_restarts():
    session = nbshard.session("restarts", nproc=1)
    try:
        with pytest.raises(TypeError, match="a session keeps its ranks between calls"):
            session.run(nbshard.Job(print, max_restarts=1))
    finally:
        session.close()


def test_the_restart_line_names_the_rank_that_raised_first_not_the_one_seen_first(tmp_path):
    # Rank 1 raised; rank 0 failed because of it (its peer was gone) but its exit was seen first
    # (by another node's launcher, or in the same tick): the line names rank 1, as the final error does.
    from nbshard.process import attempts
    from nbshard.contracts import RankOutcome
    from nbshard.files import write_json
    from nbshard.run_dir import RunDir

    errors = RunDir(tmp_path)
    write_json(errors.error(1), {"rank": 1, "time": 100.0, "exc_type": "builtins.RuntimeError", "message": "boom at step 2"})
    write_json(errors.error(0), {"rank": 0, "time": 100.4, "exc_type": "builtins.RuntimeError",
                                 "message": "[pair.cc:553] Connection closed by peer [127.0.0.1]:21391"})
    seen = [
        RankOutcome(rank=0, ok=False, stopped=False, ended=100.5, exitcode=1),
        RankOutcome(rank=1, ok=False, stopped=False, ended=100.9, exitcode=1),
        RankOutcome(rank=2, ok=False, stopped=True, ended=99.0, exitcode=-15),  # stopped by nbshard: not a cause
    ]
    assert attempts.first_cause(tmp_path, seen) == (1, "on rank 1: RuntimeError: boom at step 2")
    # Without error files (killed by a signal), the exit seen first is the cause.
    assert attempts.first_cause(tmp_path / "none", seen) == (0, "on rank 0: exited with code 1")
    assert attempts.first_cause(tmp_path, [RankOutcome(rank=0, ok=True, stopped=False, ended=1.0, exitcode=0)]) == (
        None, "(no rank reported why)"
    )
