"""Streamed lines rendered as a terminal would show them, and split as a terminal would."""

from __future__ import annotations

import socket

from nbshard.display import LinePrinter, TailView
from nbshard.launcher import pick_port
from nbshard.lines import LineSplitter


def render(text: str) -> list[str]:
    """What a terminal (or Jupyter's stream output) shows: \r rewrites the current line."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n") if line]


def test_finished_lines_are_prefixed_like_torchrun():
    printer = LinePrinter()
    assert printer.line(1, "out", "hello", False) == "[rank1]: hello\n"


def test_a_progress_bar_stays_on_one_line():
    printer = LinePrinter()
    out = "".join(printer.line(0, "err", f"{p}%|{'#' * (p // 10)}", True) for p in (10, 50, 100))
    out += printer.line(0, "err", "100%|##########| done", False)
    assert render(out) == ["[rank0]: 100%|##########| done"]


def test_another_rank_ends_the_open_line_instead_of_overwriting_it():
    printer = LinePrinter()
    out = printer.line(0, "err", "50%", True) + printer.line(1, "out", "hello", False)
    out += printer.note("stopping") + printer.close()
    assert render(out) == ["[rank0]: 50%", "[rank1]: hello", "[nbshard]: stopping"]


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


def test_pick_port_avoids_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert pick_port(port) != port
    assert pick_port(None) > 0


def test_tail_view_keeps_the_newest_lines_with_a_progress_bar_as_one_line():
    view = TailView(show_ranks=[0, 1], max_lines=3)
    view.line(0, "out", "first", False)
    view.line(0, "err", "10%", True)
    view.line(1, "out", "from rank 1", False)
    view.line(0, "err", "90%", True)  # rewrites rank 0's open line in place
    view.line(2, "out", "hidden", False)
    assert view.render().splitlines() == ["[rank0]: first", "[rank0]: 90%", "[rank1]: from rank 1"]
    view.line(0, "err", "100% done", False)
    view.note("finished")
    assert view.render().splitlines() == ["[rank0]: 100% done", "[rank1]: from rank 1", "[nbshard]: finished"]
