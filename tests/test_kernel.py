"""nbshard.run in a real Jupyter kernel: output in the cell, tracebacks, interrupts, a dying kernel."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import processes_of, wait_until_gone
from nbshard.run_dir import RunDir

pytestmark = pytest.mark.timeout(180)

DEFINE_TRAIN = '''
import nbshard

def helper(rank):
    if rank == 1:
        raise ValueError(f"loss is nan on rank {rank}")

def train(lines, fail=False):
    import os
    rank = int(os.environ["RANK"])
    for index in range(lines):
        print(f"line {index}")
    if fail:
        helper(rank)
    return "done"
'''


def test_output_of_every_rank_appears_in_the_cell_in_few_messages(kernel):
    assert kernel.execute(DEFINE_TRAIN).status == "ok"
    result = kernel.execute("print(nbshard.run(train, 2000, nproc=2))")
    assert result.status == "ok", result.traceback
    shown = [line.rsplit("\r", 1)[-1] for line in result.stdout.split("\n")]  # as the notebook renders it
    for rank in (0, 1):
        lines = [line for line in shown if line.startswith(f"[rank{rank}]: ")]
        assert lines == [f"[rank{rank}]: line {index}" for index in range(2000)]
    assert result.stdout.rstrip().endswith("done")
    streams = [m for m in result.messages if m["msg_type"] == "stream"]
    assert len(streams) < 100, "4000 lines must be batched far below Jupyter's rate limit"


def test_a_failing_rank_shows_the_cells_source_in_the_notebook_traceback(kernel):
    defined = kernel.execute(DEFINE_TRAIN)
    started = time.monotonic()
    result = kernel.execute("nbshard.run(train, 3, kwargs={'fail': True}, nproc=2)")
    assert result.status == "error" and result.error["ename"] == "JobFailed"
    text = result.traceback
    assert 'raise ValueError(f"loss is nan on rank {rank}")' in text  # cell source, from the kernel's linecache
    assert "helper(rank)" in text
    assert "ValueError: loss is nan on rank 1" in text
    assert text.index("ValueError: loss is nan") < text.index("JobFailed: The job failed on rank 1.")
    # named as the notebook names the cell that defined them, and nothing of nbshard around it
    assert f"Cell In[{defined.execution_count}], line 5, in helper" in text  # IPython drops the leading blank line
    assert f"Cell In[{defined.execution_count}], line 13, in train" in text
    kernel.assert_reads_as_a_local_error(result)
    assert time.monotonic() - started < 60
    assert kernel.execute("print(nbshard.run(lambda: 'again', nproc=1))").user_stdout.strip() == "again"


def test_interrupting_the_kernel_stops_every_rank_and_the_next_cell_works(kernel, runs_dir):
    defined = kernel.execute(
        "import nbshard\n"
        "def forever():\n"
        "    import time\n"
        "    print('working', flush=True)\n"
        "    while True: time.sleep(0.1)\n"
    )
    msg_id = kernel.submit("nbshard.run(forever, nproc=2)")
    kernel.collect(msg_id, until=("[rank0]: working", "[rank1]: working"))
    run_dir = next(runs_dir.iterdir())
    kernel.manager.interrupt_kernel()
    interrupted_at = time.monotonic()
    result = kernel.collect(msg_id)
    assert not wait_until_gone(run_dir, within=max(0.0, 5 - (time.monotonic() - interrupted_at)))
    kernel.assert_short_interrupt(result, f"Cell In[{defined.execution_count}], line 5, in forever")
    assert "while True: time.sleep(0.1)" in result.traceback
    for rank in (0, 1):  # the full dumps stay in the logs
        assert "Current thread" in (run_dir / f"rank-{rank}.log").read_text()
    assert kernel.execute("print(nbshard.run(lambda: 'next', nproc=2))").user_stdout.strip() == "next"


def test_the_stop_button_on_ranks_that_returned_but_do_not_exit_gives_the_cell_its_value(kernel, runs_dir):
    kernel.execute(
        "import nbshard\n"
        "def hangs_at_exit():\n"
        "    import atexit, time\n"
        "    atexit.register(time.sleep, 600)\n"
        "    return 'the value'\n"
    )
    msg_id = kernel.submit("value = nbshard.run(hangs_at_exit, nproc=2)\nprint('got', value)")
    deadline = time.monotonic() + 60
    while not (runs := list(runs_dir.glob("*-hangs_at_exit-*"))) or not all(RunDir(runs[0]).result(rank).exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, "the ranks never returned"
        time.sleep(0.05)
    kernel.manager.interrupt_kernel()
    result = kernel.collect(msg_id, timeout=30)
    assert result.error is None, result.traceback
    assert "got the value" in result.user_stdout
    assert "the job was cancelled after every rank had returned: stopping ranks 0, 1" in result.stdout
    assert not wait_until_gone(runs[0], within=5)


def test_interrupting_a_wait_for_a_result_leaves_the_job_and_its_handle_working(kernel, runs_dir):
    kernel.execute("import nbshard, time\nhandle = nbshard.submit(time.sleep, 4, nproc=2)")
    msg_id = kernel.submit("print('waiting', flush=True)\nhandle.result()")
    kernel.collect(msg_id, until="waiting")
    time.sleep(0.3)
    kernel.manager.interrupt_kernel()
    interrupted_at = time.monotonic()
    result = kernel.collect(msg_id, timeout=30)
    assert result.error is not None and result.error["ename"] == "KeyboardInterrupt", result.traceback
    assert time.monotonic() - interrupted_at < 2.0
    # Only the wait was interrupted: the job runs on, and the same handle still ends with it.
    done = kernel.execute("print(handle.result(timeout=60), handle.status)")
    assert done.status == "ok" and done.user_stdout.strip() == "None succeeded", done.traceback


def test_a_killed_kernel_takes_its_jobs_along_within_5_seconds(kernel, runs_dir):
    kernel.execute("import nbshard, time\nhandle = nbshard.submit(time.sleep, 600, nproc=2)")
    deadline = time.monotonic() + 30
    while not runs_dir.exists() or len(processes_of(runs_dir)) < 3:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    os.kill(kernel.pid, signal.SIGKILL)  # as the out-of-memory killer would
    assert not wait_until_gone(runs_dir, within=5.0)
