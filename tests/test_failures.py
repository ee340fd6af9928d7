"""Every way a job can end badly: what the kernel sees, and that no process stays behind."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import traceback

import pytest

import nbshard
import programs
from conftest import processes_of, wait_until_gone

pytestmark = pytest.mark.timeout(120)


def wait_for_output(handle: nbshard.JobHandle, text: str, ranks: range, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not all(text in handle.logs(rank) for rank in ranks):
        assert time.monotonic() < deadline, f"{text!r} never appeared: {handle.logs()}"
        assert not handle.done(), f"the job ended early: {handle.exception()}"
        time.sleep(0.05)


def test_a_raising_rank_fails_the_job_fast_with_its_traceback_first():
    handle = nbshard.submit(programs.raise_on_rank, 1, "loss is nan", 0.5, nproc=2)
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=60)
    error = caught.value
    root, other = error.failures
    assert (root.rank, root.exc_type, root.message) == (1, "builtins.ValueError", "loss is nan")
    # Rank 0 waited in a barrier: nbshard killed it, or gloo failed it first when rank 1 left.
    assert other.rank == 0 and (other.stopped or other.time >= root.time)
    assert handle.ended - root.time < 2.0, "the kernel must learn of a failure within a second or two"
    cause = error.__cause__
    assert type(cause) is ValueError
    text = "".join(traceback.format_exception(cause))
    assert "in raise_on_rank" in text and "in helper_that_raises" in text
    assert "raise ValueError(message)" in text  # the source line, looked up in the kernel
    assert str(error).splitlines()[0] == "The job failed on rank 1."


def test_an_error_whose_text_cannot_be_made_is_still_reported_as_raised():
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(programs.raise_unprintable, nproc=1)
    root = caught.value.failures[0]
    assert (root.exc_type, root.message) == ("programs.Unprintable", "<exception str() failed: RuntimeError>")
    assert type(caught.value.__cause__) is programs.Unprintable


def test_a_rank_killed_by_a_signal_is_named_with_the_likely_cause():
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(programs.kill_self, 1, signal.SIGKILL, nproc=2)
    root = caught.value.failures[0]
    assert (root.rank, root.signal) == (1, "SIGKILL")
    assert "rank 1 was killed by SIGKILL: likely out of memory" in str(caught.value)


@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_that_calls_os_exit_is_a_failure(code):
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(programs.exit_hard, 0, code, nproc=2)
    root = caught.value.failures[0]
    assert (root.rank, root.exitcode) == (0, code)
    assert "os._exit()" in str(caught.value)


def test_timeout_stops_the_job_and_shows_where_each_rank_was():
    started = time.monotonic()
    with pytest.raises(nbshard.JobTimedOut) as caught:
        nbshard.run(programs.sleep_forever, nproc=2, timeout=3)
    assert time.monotonic() - started < 3 + 5
    message = str(caught.value)
    assert "timeout of 3 s" in message
    assert message.count("in sleep_forever") == 2 and "Thread 0x" not in message  # where, in a few lines
    for failure in caught.value.failures:
        assert "in sleep_forever" in failure.stacks  # faulthandler's dump, taken before the kill
    assert isinstance(caught.value, nbshard.JobFailed)


def test_result_with_a_timeout_only_stops_waiting():
    handle = nbshard.submit(programs.sleep_forever, nproc=2)
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.2)
    assert not handle.done() and handle in nbshard.jobs()
    handle.cancel()


def test_cancel_stops_every_process_within_5_seconds_and_the_next_run_works():
    handle = nbshard.submit(programs.wait_in_collective, nproc=2)
    wait_for_output(handle, "ready", range(2))
    started = time.monotonic()
    assert handle.cancel() is True
    assert time.monotonic() - started < 5
    assert not processes_of(handle.run_dir)
    with pytest.raises(nbshard.JobCancelled) as caught:
        handle.result()
    assert isinstance(caught.value, concurrent.futures.CancelledError)
    assert not isinstance(caught.value, nbshard.JobFailed)
    assert "in wait_in_collective" in caught.value.failures[0].stacks
    assert handle.cancel() is False  # already over
    assert nbshard.run(programs.rank_and_value, 2, nproc=2, return_all=True) == [0, 2]


def test_cancel_while_ranks_start_says_so_and_kills_none_by_its_stack_request():
    """A cancel that comes before a rank can answer for its stack (SIGUSR1, whose default
    kills) stops it like any other, and says it had not started its function yet."""
    for _ in range(3):
        handle = nbshard.submit(programs.sleep_forever, nproc=2)
        handle.cancel()
        with pytest.raises(nbshard.JobCancelled) as caught:
            handle.result()
        for failure in caught.value.failures:
            assert failure.signal != "SIGUSR1", failure.describe()
            assert failure.stopped, failure.describe()
        assert not processes_of(handle.run_dir)


def test_cancel_sends_sigterm_first_so_ranks_can_checkpoint(tmp_path):
    checkpoint = tmp_path / "ckpt"
    handle = nbshard.submit(programs.terminate_checkpoint, str(checkpoint), nproc=2)
    wait_for_output(handle, "ready", range(2))
    handle.cancel()
    assert sorted(p.name for p in tmp_path.glob("ckpt.*")) == ["ckpt.0", "ckpt.1"]


def test_interrupting_run_stops_the_job_and_the_next_run_works(script, runs_dir):
    kernel = script(
        """
        import nbshard, programs
        try:
            nbshard.run(programs.sleep_forever, nproc=2)
        except KeyboardInterrupt as interrupt:
            print("interrupted; still running:", nbshard.jobs(), flush=True)
            print(f"said: {interrupt}", flush=True)
        print("next run:", nbshard.run(programs.rank_and_value, 7, nproc=2, return_all=True), flush=True)
        """
    )
    kernel.wait_for("working")
    kernel.wait_for("working")  # both ranks are in their function
    run_dir = next(runs_dir.iterdir())
    kernel.process.send_signal(signal.SIGINT)
    started = time.monotonic()
    assert kernel.wait_for("interrupted;").strip() == "interrupted; still running: []"
    assert not wait_until_gone(run_dir, within=max(0.0, 5 - (time.monotonic() - started)))
    code, out = kernel.finish()
    assert code == 0, out
    assert "next run: [0, 7]" in out
    # Where each rank was, in a few lines of the user's code; the full dumps only in the logs.
    assert "said: " in out, out
    said = out[out.index("said: "):out.index("next run:")]
    for rank in (0, 1):
        assert f"rank {rank} was stopped by nbshard at:" in said
    assert said.count("in sleep_forever") == 2 and said.count("time.sleep(0.1)") == 2
    assert "Thread 0x" not in out and "worker.py" not in out and "runpy" not in out and "threading" not in out
    assert len(said.splitlines()) <= 10
    for rank in (0, 1):
        assert "Current thread" in (run_dir / f"rank-{rank}.log").read_text()


def test_kernel_killed_takes_launcher_and_ranks_along_within_5_seconds(script, runs_dir):
    kernel = script(
        """
        import nbshard, programs
        handle = nbshard.submit(programs.wait_in_collective, nproc=2)
        handle.watch()
        """
    )
    kernel.wait_for("ready")
    run_dir = next(runs_dir.iterdir())
    assert len(processes_of(run_dir)) == 3  # the launcher and two ranks
    kernel.process.kill()
    assert not wait_until_gone(run_dir, within=5.0)


def test_launcher_killed_takes_the_ranks_along_and_the_job_fails():
    handle = nbshard.submit(programs.sleep_forever, nproc=2)
    wait_for_output(handle, "working", range(2))
    launcher_pid = int((handle.run_dir / "launcher.pid").read_text())
    os.kill(launcher_pid, signal.SIGKILL)
    with pytest.raises(nbshard.JobFailed, match="launcher was killed by SIGKILL"):
        handle.result(timeout=10)
    assert not wait_until_gone(handle.run_dir, within=5.0)


def test_a_job_that_deletes_its_run_directory_ends_saying_so_and_leaves_nothing_running():
    started = time.monotonic()
    handle = nbshard.submit(programs.remove_own_run_dir, nproc=2)
    with pytest.raises(nbshard.JobError, match="the run directory .* is gone or was replaced") as caught:
        handle.result(timeout=30)
    assert time.monotonic() - started < 15
    assert "full log is in" not in str(caught.value)  # its logs went with it
    assert not wait_until_gone(handle.run_dir, within=5.0)
