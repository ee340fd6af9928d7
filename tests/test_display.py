"""Streamed lines rendered as a terminal would show them, and split as a terminal would."""

from __future__ import annotations

import socket

from nbshard.kernel.display import LinePrinter, TailView
from nbshard.ports import pick_port
from nbshard.process.lines import MAX_LINE, LineSplitter


def render(text: str) -> list[str]:
    """What Jupyter's stream output (and a terminal) shows: ``\\r`` returns to the start of the
    line and what follows overwrites it, keeping the tail of a longer old text."""
    shown = []
    for line in text.replace("\r\n", "\n").split("\n"):
        screen = ""
        for part in line.split("\r"):
            screen = part + screen[len(part):]
        shown.append(screen.rstrip())
    return [line for line in shown if line]


def test_finished_lines_are_prefixed_like_torchrun():
    printer = LinePrinter()
    assert printer.line(1, "out", "hello", False) == "[rank1]: hello\n"


def test_a_progress_bar_stays_on_one_line():
    printer = LinePrinter()
    out = "".join(printer.line(0, "err", f"{p}%|{'#' * (p // 10)}", True) for p in (10, 50, 100))
    out += printer.line(0, "err", "100%|##########| done", False)
    assert render(out) == ["[rank0]: 100%|##########| done"]


def test_finished_lines_go_above_the_live_bar_which_stays_one_line():
    printer = LinePrinter()
    out = printer.line(0, "err", "50%", True) + printer.line(1, "out", "hello", False)
    out += printer.line(0, "err", "60%", True)
    out += printer.note("stopping") + printer.close()
    assert render(out) == ["[rank1]: hello", "[nbshard]: stopping", "[rank0]: 60%"]


def test_a_trainer_bar_on_stderr_with_logs_on_stdout_reads_as_in_a_terminal():
    # What a Hugging Face Trainer writes: a tqdm bar on stderr, which tqdm clears (a blank
    # rewrite) before each log line on stdout and draws again after it.
    printer, out = LinePrinter(), ""
    for step in range(1, 4):
        out += printer.line(0, "err", f"{step * 10}%|{'#' * step}| {step}/10 [00:0{step}<00:10, 1.00it/s]", True)
        out += printer.line(0, "err", " " * 40, True)  # tqdm clears the bar
        out += printer.line(0, "out", f"{{'loss': {1 / step:.2f}}}", False)
    out += printer.line(0, "err", "100%|##########| 10/10 [00:10<00:00, 1.00it/s]", True)
    out += printer.close()
    assert render(out) == [
        "[rank0]: {'loss': 1.00}", "[rank0]: {'loss': 0.50}", "[rank0]: {'loss': 0.33}",
        "[rank0]: 100%|##########| 10/10 [00:10<00:00, 1.00it/s]",
    ]


def test_show_ranks_filters_live_output():
    printer = LinePrinter(show_ranks=[0])
    assert printer.line(1, "out", "hidden", False) == ""
    assert printer.line(0, "out", "shown", False) == "[rank0]: shown\n"


def test_splitter_keeps_the_last_rewrite_of_each_line():
    splitter = LineSplitter("err")
    assert splitter.feed(b"\r 10%", 1.0) == []
    assert splitter.open_line(1.0) == [1.0, "err", " 10%", True]
    assert splitter.open_line(1.1) is None  # unchanged: not sent again
    assert splitter.feed(b"\r 20%\r 30%\nnext\n", 2.0) == [[2.0, "err", " 30%", False], [2.0, "err", "next", False]]


def test_splitter_joins_chunks_and_multibyte_characters_split_across_reads():
    splitter = LineSplitter("out")
    data = "héllo wörld\n".encode()
    assert splitter.feed(data[:2], 1.0) == []
    assert splitter.feed(data[2:], 1.0) == [[1.0, "out", "héllo wörld", False]]
    assert splitter.feed(b"no newline at the end", 1.0) == []
    assert splitter.feed(b"", 2.0) == [[2.0, "out", "no newline at the end", False]]


def test_a_line_longer_than_the_live_view_takes_is_cut_saying_so():
    splitter = LineSplitter("out")
    [(_, _, text, _)] = splitter.feed(b"x" * 25_000 + b"\n", 1.0)
    assert text == "x" * MAX_LINE + " ... [cut: 25,000 characters; the rank's log keeps the whole line]"
    splitter.feed(b"y" * 30_000, 2.0)  # no newline yet: shown as the open line once it waited
    assert splitter.open_line(3.0)[2] == "y" * MAX_LINE + " ... [cut; the rank's log keeps the whole line]"
    pieces = splitter.feed(b"y" * 1_000_000, 4.0)  # past 100 lines' worth without a newline: a piece of its own
    assert [p[2][MAX_LINE:] for p in pieces] == [" ... [cut: 1,030,000 characters; the rank's log keeps the whole line]"]


def test_pick_port_avoids_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert pick_port(port) != port
    assert pick_port(None) > 0


def test_splitter_keeps_a_bar_redrawn_any_number_of_times_as_one_bounded_line():
    splitter = LineSplitter("err")
    for chunk in range(200):  # 200,000 redraws, 5.6 MB, in pipe-sized reads
        data = "".join(f"\r{i:>6}/200000 |" for i in range(chunk * 1000, (chunk + 1) * 1000)).encode()
        assert splitter.feed(data, 1.0) == []  # never cut into pieces
    assert len(splitter._partial) < 100  # only what a terminal shows is kept
    assert splitter.open_line(2.0) == [2.0, "err", "199999/200000 |", True]
    assert splitter.feed(b"\n", 3.0) == [[3.0, "err", "199999/200000 |", False]]


def test_tail_view_keeps_the_newest_lines_and_live_bars_below_them():
    view = TailView(show_ranks=[0, 1], max_lines=3)
    view.line(0, "out", "first", False)
    view.line(0, "err", "10%", True)
    view.line(1, "out", "from rank 1", False)
    view.line(0, "err", "90%", True)  # rewrites rank 0's open line in place
    view.line(2, "out", "hidden", False)
    assert view.lines() == ["[rank0]: first", "[rank1]: from rank 1", "[rank0]: 90%"]
    view.line(0, "err", "   ", True)  # cleared: not shown
    view.line(0, "out", "logged", False)
    assert view.lines() == ["[rank0]: first", "[rank1]: from rank 1", "[rank0]: logged"]
    view.line(0, "err", "100% done", False)
    view.note("finished")
    assert view.lines() == [  # the view says that earlier lines were left out, and where they are
        "[nbshard]: 2 earlier lines not shown here; handle.logs(rank) has every line",
        "[rank0]: logged", "[rank0]: 100% done", "[nbshard]: finished",
    ]


def test_the_live_backlog_keeps_the_newest_lines_and_hands_them_out_in_turns():
    from nbshard.kernel.backlog import LIVE_BACKLOG, LiveBacklog

    backlog = LiveBacklog("/runs/x")
    per_rank = LIVE_BACKLOG * 6 // 10
    for rank in range(3):  # each message a run of lines, as the launcher sends them
        backlog.lines(rank, "out", [f"{rank}:{index}" for index in range(per_rank)], False)
    backlog.note("done")
    printer = LinePrinter()
    first = "".join(backlog.feed(printer, most=1000)).splitlines()
    dropped = 3 * per_rank + 1 - LIVE_BACKLOG
    assert first[0].startswith(f"[nbshard]: {dropped} lines were not shown live")
    newest_kept = 3 * per_rank - LIVE_BACKLOG + 1  # the first line of the newest LIVE_BACKLOG - 1 lines
    assert first[1:] == [f"[rank1]: 1:{index}" for index in range(newest_kept - per_rank, newest_kept - per_rank + 1000)]
    rest = "".join(backlog.feed(printer)).splitlines()
    assert len(first) - 1 + len(rest) == LIVE_BACKLOG and rest[-2:] == [f"[rank2]: 2:{per_rank - 1}", "[nbshard]: done"]
