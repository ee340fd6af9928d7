"""Failures described for a person, and remote tracebacks rebuilt from frames."""

from __future__ import annotations

import linecache
import os
import pickle
import sysconfig
import traceback

import pytest

from nbshard.errors import JobFailed, RankFailure, likely_cause, signal_name
from nbshard.kernel.remote import RemoteError, remote_exception

CELL = "/tmp/ipykernel_4242/1234567.py"  # how ipykernel names cell code
CELL_SOURCE = "def train(cfg):\n    loss = compute(cfg)\n    raise ValueError('loss is nan')\n"


@pytest.fixture
def cell_in_linecache():
    # What IPython does for every executed cell: the source lives only in linecache.
    linecache.cache[CELL] = (len(CELL_SOURCE), None, CELL_SOURCE.splitlines(True), CELL)
    yield
    linecache.cache.pop(CELL, None)


def failure(**changes) -> RankFailure:
    fields = dict(
        rank=1, time=10.0, exc_type="builtins.ValueError", message="loss is nan",
        frames=({"filename": CELL, "lineno": 3, "name": "train"},),
    )
    fields.update(changes)
    return RankFailure(**fields)


def test_remote_traceback_shows_the_cell_source_from_the_kernels_linecache(cell_in_linecache):
    exc = remote_exception(failure())
    text = "".join(traceback.format_exception(exc))
    assert type(exc) is ValueError
    assert f'File "{CELL}", line 3, in train' in text
    assert "raise ValueError('loss is nan')" in text
    assert "ValueError: loss is nan" in text
    assert "^" not in text  # no carets pointing at the wrong columns


def test_remote_traceback_keeps_column_ranges(cell_in_linecache):
    frames = ({"filename": CELL, "lineno": 2, "name": "train", "colno": 11, "end_colno": 23},)
    text = "".join(traceback.format_exception(remote_exception(failure(frames=frames))))
    source_line, carets = text.splitlines()[2:4]
    assert source_line.strip() == "loss = compute(cfg)"
    assert carets.strip() == "^" * len("compute(cfg)")
    assert source_line.index("compute") == carets.index("^")


def test_exceptions_the_kernel_does_not_import_keep_their_names():
    exc = remote_exception(failure(exc_type="torch.distributed.DistBackendError", message="NCCL error"))
    assert isinstance(exc, RemoteError)
    assert "torch.distributed.DistBackendError: NCCL error" in "".join(traceback.format_exception(exc))


def test_builtin_exceptions_with_unusual_constructors_still_render():
    exc = remote_exception(failure(exc_type="builtins.UnicodeDecodeError", message="bad byte"))
    assert "UnicodeDecodeError: bad byte" in "".join(traceback.format_exception(exc))


def test_signals_name_the_likely_cause():
    assert signal_name(9) == "SIGKILL"
    assert "out of memory" in likely_cause("SIGKILL")
    killed = RankFailure(rank=0, time=1.0, exitcode=-9, signal="SIGKILL")
    assert killed.describe().startswith("rank 0 was killed by SIGKILL: likely out of memory")
    early = RankFailure(rank=1, time=1.0, exitcode=0)
    assert "os._exit()" in early.describe()


def test_job_failed_lists_the_root_cause_first_and_survives_pickling():
    root = failure()
    stopped = RankFailure(rank=0, time=11.0, exitcode=-15, signal="SIGTERM", stopped=True)
    error = JobFailed("The job failed on rank 1.", [root, stopped], "/runs/x")
    lines = str(error).splitlines()
    assert lines[0] == "The job failed on rank 1."
    assert lines[1].strip() == "rank 1 raised ValueError: loss is nan"
    assert lines[2].strip() == "rank 0 was stopped by nbshard"
    assert "/runs/x" in lines[3]
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error)


def test_where_stopped_shows_the_main_threads_user_frames_only(cell_in_linecache):
    import nbshard.process.worker
    from nbshard.stacks import STARTING, where_stopped

    worker, threading_py = nbshard.process.worker.__file__, threading_file()
    torch_file = os.path.join(sysconfig.get_paths()["purelib"], "torch", "distributed", "distributed_c10d.py")
    stacks = (
        "main thread 0x00007f00000000aa\n"
        "Thread 0x00007f00000000bb (most recent call first):\n"
        f'  File "{threading_py}", line 331 in wait\n'
        '  File "/x/nbshard/monitor.py", line 147 in _sample_until_stopped\n'
        "\n"
        "Current thread 0x00007f00000000aa (most recent call first):\n"
        f'  File "{torch_file}", line 4000 in barrier\n'
        f'  File "{CELL}", line 2 in train\n'
        f'  File "{worker}", line 160 in call_job\n'
        f'  File "{worker}", line 175 in _run\n'
        '  File "<frozen runpy>", line 198 in _run_module_as_main\n'
    )
    assert where_stopped(stacks) == [
        f'File "{CELL}", line 2, in train',  # a cell once IPython names it (tested in a real kernel)
        "    loss = compute(cfg)",
        f"  inside barrier ({torch_file}, line 4000)",
    ]
    in_threading = stacks.replace(torch_file, threading_py).replace("in barrier", "in wait")
    assert where_stopped(in_threading) == where_stopped(stacks)[:2]  # the standard library is not the user's
    assert where_stopped("main thread 0x1\n") == []  # a rank that never answered
    starting = stacks.replace("line 2 in train", "line 747 in _function_getstate").replace("in call_job", "in _install_notebook_main")
    assert where_stopped(starting) == [STARTING]  # stopped while nbshard loaded the job: no library frame shown


def threading_file():
    import threading

    return threading.__file__
