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
    import nbshard.process.calls
    import nbshard.process.worker
    from nbshard.stacks import STARTING, where_stopped

    worker, calls, threading_py = nbshard.process.worker.__file__, nbshard.process.calls.__file__, threading_file()
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
        f'  File "{calls}", line 160 in call_job\n'
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


def rank_dump(main: list[tuple[str, int, str]], *others: list[tuple[str, int, str]]) -> str:
    """A rank's faulthandler dump: its main thread's frames and other threads', innermost first."""
    def frames(thread: list[tuple[str, int, str]]) -> str:
        return "".join(f'  File "{filename}", line {line} in {name}\n' for filename, line, name in thread)
    threads = [f"Thread 0x{0xbb + n:016x} (most recent call first):\n{frames(thread)}\n" for n, thread in enumerate(others)]
    return f"main thread 0x{0xaa:016x}\n{''.join(threads)}Current thread 0x{0xaa:016x} (most recent call first):\n{frames(main)}"


def nbshard_file(module: str) -> str:
    import importlib

    return importlib.import_module(f"nbshard.{module}").__file__


def test_a_warm_ranks_start_is_not_taken_for_a_sessions_wait_between_calls():
    from nbshard.stacks import BETWEEN_CALLS, STARTING, where_stopped

    # A rank forked from the warm process runs inside that process's own loop, which is also named serve.
    warm = [(nbshard_file("process.calls"), 200, "run_job"), (nbshard_file("process.worker"), 145, "run_forked"),
            (nbshard_file("process.forking"), 41, "fork_child"), (nbshard_file("process.forkserver"), 180, "serve"),
            (nbshard_file("process.forkserver"), 280, "main")]
    assert where_stopped(rank_dump(warm)) == [STARTING]
    between = [(nbshard_file("process.session_rank"), 110, "next"), (nbshard_file("process.session_rank"), 180, "serve"), *warm[1:]]
    assert where_stopped(rank_dump(between)) == [BETWEEN_CALLS]


def test_a_rank_slow_to_exit_is_shown_waiting_for_its_exit_handler_or_its_thread(cell_in_linecache):
    from nbshard.stacks import EXITING, not_exited_note, where_stopped, why_not_exited

    exiting = [(nbshard_file("process.worker"), 110, "_exit"), (nbshard_file("process.worker"), 145, "run_forked")]
    in_handler = rank_dump([(CELL, 2, "<lambda>"), (threading_file(), 1, "_run_exitfuncs"), *exiting])
    assert why_not_exited(in_handler) == ["it runs an exit handler (atexit), at:", f'File "{CELL}", line 2, in <lambda>', "    loss = compute(cfg)"]
    assert where_stopped(in_handler)[0] == f"{EXITING}: it runs an exit handler (atexit), at:"
    assert why_not_exited(rank_dump(exiting)) == ["it runs an exit handler (atexit)"]  # a handler in C (time.sleep)

    monitor = [(threading_file(), 331, "wait"), (nbshard_file("rank.monitor"), 73, "_sample_until_stopped")]
    idle_pool = [(threading_file(), 331, "wait"), (threading_file(), 1000, "_worker")]
    spinning = [(CELL, 2, "spin"), (threading_file(), 1000, "run")]
    joining = rank_dump([(threading_file(), 1590, "_shutdown"), (nbshard_file("process.worker"), 98, "_join_threads"), *exiting],
                        monitor, idle_pool, spinning)
    assert why_not_exited(joining) == [  # nbshard's own threads are daemons; the job's own code first
        "Python waits for the threads the job started that are not daemon threads; one of the job's threads is at:",
        f'File "{CELL}", line 2, in spin', "    loss = compute(cfg)",
    ]
    assert why_not_exited("main thread 0x1\n") == []  # a rank that did not answer
    # The rank lists the threads it waits for, by name, as it begins to wait: the note names the one shown.
    named = joining.replace("\n", f"\nthread named 0x{0xbd:016x} uploader\nthread named 0x{0xbc:016x} pool\n", 1)
    assert why_not_exited(named)[0].endswith("one of the job's threads ('uploader') is at:")

    note = not_exited_note({"0": 10.4, "1": 10.6, "2": 10.5}, {"0": joining, "1": joining, "2": in_handler})
    lines = [line.strip() for line in note.splitlines()]
    assert lines[0] == "ranks 0, 1 returned 11 s ago and have not exited: " + why_not_exited(joining)[0]
    assert "rank 2 returned 10 s ago and has not exited: it runs an exit handler (atexit), at:" in lines
    assert lines[-1].startswith("The values are kept: the stop button (handle.cancel())")


def test_a_huge_error_message_is_shortened_in_the_summary_of_every_rank():
    from nbshard.errors import MESSAGE_SHOWN

    error = JobFailed("The job failed on rank 1.", [failure(message="x" * 5_000_000), failure(rank=0, message="y" * 5_000_000)], "/runs/x")
    text = str(error)
    assert len(text) < 3 * MESSAGE_SHOWN
    assert f"... ({5_000_000 - MESSAGE_SHOWN:,} characters more: the whole message ends the rank's traceback)" in text
    assert str(JobFailed("The job failed on rank 1.", [failure()], "/runs/x")).splitlines()[1].strip() == "rank 1 raised ValueError: loss is nan"


def threading_file():
    import threading

    return threading.__file__
