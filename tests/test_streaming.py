"""Output from the ranks: complete, in order, never stalling training, progress bars on one line."""

from __future__ import annotations

import io
import re
import signal
import time

import pytest

import nbshard
import programs

pytestmark = pytest.mark.timeout(180)


def shown_lines(text: str, rank: int) -> list[str]:
    prefix = f"[rank{rank}]: "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def test_a_flood_of_200000_lines_arrives_complete_and_in_order_per_rank():
    count = 100_000  # per rank, two ranks
    handle = nbshard.submit(programs.print_lines, count, 20, nproc=2)
    shown = io.StringIO()
    handle.watch(shown)
    assert handle.result() == count
    text = shown.getvalue()
    assert "not shown live" not in text
    for rank in (0, 1):
        expected = [f"{rank}:{index}:{'x' * 20}" for index in range(count)]
        assert shown_lines(text, rank) == expected
        assert handle.logs(rank).splitlines() == expected


def test_a_progress_bar_arrives_as_updates_of_one_line():
    handle = nbshard.submit(programs.progress_bar, 50, nproc=1)
    shown = io.StringIO()
    handle.watch(shown)
    handle.result()
    text = shown.getvalue()
    rewrites = text.count("\r")
    assert 2 <= rewrites < 50, "updates are throttled, not one message per rewrite"
    visible = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n") if line.startswith("[rank")]
    assert visible == ["[rank0]: progress 50/50", "[rank0]: finished"]
    assert handle.logs(0).count("\r") == 51  # the log keeps every byte


def test_show_ranks_limits_live_output_but_every_log_is_kept():
    handle = nbshard.submit(programs.print_lines, 3, 5, nproc=2, show_ranks=[0])
    shown = io.StringIO()
    handle.watch(shown)
    handle.result()
    assert len(shown_lines(shown.getvalue(), 0)) == 3
    assert shown_lines(shown.getvalue(), 1) == []
    assert len(handle.logs(1).splitlines()) == 3


def test_a_frozen_kernel_never_stalls_the_ranks(script, runs_dir):
    # The kernel process is stopped (SIGSTOP, like a kernel paused in a debugger)
    # while the ranks print far more than any queue holds: they must finish anyway.
    kernel = script(
        """
        import nbshard, programs
        handle = nbshard.submit(programs.print_lines, 300_000, 100, nproc=2)
        print("submitted", flush=True)
        handle.watch()
        print("result:", handle.result(), flush=True)
        """
    )
    kernel.wait_for("submitted")
    kernel.process.send_signal(signal.SIGSTOP)
    try:
        run_dir = next(runs_dir.iterdir())
        deadline = time.monotonic() + 90
        while not (run_dir / "outcome.json").exists():
            assert time.monotonic() < deadline, "the ranks stalled while the kernel was frozen"
            time.sleep(0.2)
    finally:
        kernel.process.send_signal(signal.SIGCONT)
    code, out = kernel.finish(timeout=120)
    assert code == 0, out[-2000:]
    assert "result: 300000" in out
    dropped = re.findall(r"(\d+) lines of rank (\d) were not shown live because the kernel read too slowly; "
                         r"the full log is (\S+)", out)
    assert dropped, "dropping must be said, with where the full log is"
    for rank in (0, 1):
        log = (run_dir / f"rank-{rank}.log").read_text().splitlines()
        assert len(log) == 300_000 and log[-1].startswith(f"{rank}:299999:")
