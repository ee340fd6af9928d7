"""Render a run's streamed output as text, for a terminal or a notebook cell.

Pure formatting: the caller decides where the text goes (``sys.stdout`` in
both a terminal and ipykernel, whose stream messages it batches).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

__all__ = ["LinePrinter", "TailView", "rank_prefix"]


def rank_prefix(rank: int) -> str:
    """torchrun's ``--tee`` prefix, so logs from either read the same."""
    return f"[rank{rank}]: "


class LinePrinter:
    """Interleaves the ranks' lines, prefixed, keeping a progress bar on one line.

    An *open* line (one a rank keeps rewriting with ``\\r``) is written without
    its newline and rewritten in place while it is the last thing shown.
    """

    def __init__(self, show_ranks: Sequence[int] | None = None) -> None:
        self.show_ranks = None if show_ranks is None else frozenset(show_ranks)
        self._open: tuple[Any, int] | None = None  # (rank, stream), width shown

    def shows(self, rank: int) -> bool:
        return self.show_ranks is None or rank in self.show_ranks

    def line(self, rank: int, stream: str, text: str, is_open: bool) -> str:
        if not self.shows(rank):
            return ""
        shown = rank_prefix(rank) + text
        lead = ""
        if self._open is not None:
            key, width = self._open
            self._open = None
            if key == (rank, stream):
                lead = "\r"
                shown = shown.ljust(width)  # a terminal would keep the tail of a longer old text
            else:
                lead = "\n"
        if is_open:
            self._open = ((rank, stream), len(shown))
            return lead + shown
        return lead + shown + "\n"

    def note(self, text: str) -> str:
        return self.close() + f"[nbshard]: {text}\n"

    def close(self) -> str:
        """End an open line, if one is shown."""
        if self._open is None:
            return ""
        self._open = None
        return "\n"


class TailView:
    """The newest lines of a run, as a notebook view shows them: a progress bar is one line."""

    def __init__(self, show_ranks: Sequence[int] | None = None, max_lines: int = 30) -> None:
        self.show_ranks = None if show_ranks is None else frozenset(show_ranks)
        self._lines: collections.deque[list[Any]] = collections.deque(maxlen=max_lines)  # [key, text, open]

    def line(self, rank: int, stream: str, text: str, is_open: bool) -> None:
        if self.show_ranks is not None and rank not in self.show_ranks:
            return
        key = (rank, stream)
        for entry in reversed(self._lines):
            if entry[0] == key and entry[2]:  # this rank's unfinished line: rewrite it
                entry[1:] = [rank_prefix(rank) + text, is_open]
                return
        self._lines.append([key, rank_prefix(rank) + text, is_open])

    def note(self, text: str) -> None:
        self._lines.append([None, f"[nbshard]: {text}", False])

    def render(self, title: str) -> str:
        return "\n".join([title, *(text for _, text, _ in self._lines)])
