"""A rank's raw output bytes as lines: finished ones, and the one still being written.

Terminal semantics: ``\r`` rewrites the current line, so a progress bar is one
line whose last rewrite is what counts. Bytes split anywhere (mid-line, mid
UTF-8 character) by pipe reads come out whole.
"""

from __future__ import annotations

import codecs
from typing import Any

__all__ = ["MAX_LINE", "OPEN_LINE_DELAY", "LineSplitter"]

OPEN_LINE_DELAY = 0.5  # an unfinished line without \r is shown once it waited this long
MAX_LINE = 10_000  # characters of one line sent live; the log keeps all


def _visible(line: str) -> str:
    """What a terminal shows of a line with carriage returns: its last rewrite."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def _shown(line: str, finished: bool = True) -> str:
    """``line`` as it is sent live: past MAX_LINE characters, cut, and saying so (how long a
    finished line is; an open one still grows, and is sent again only when what it shows changed)."""
    if len(line) <= MAX_LINE:
        return line
    length = f": {len(line):,} characters" if finished else ""
    return f"{line[:MAX_LINE]} ... [cut{length}; the rank's log keeps the whole line]"


class LineSplitter:
    """Turns one output stream's bytes into finished lines and its open (unfinished) line."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._partial = ""
        self._partial_since = 0.0  # when the unfinished line last changed
        self._sent_open: str | None = None

    def feed(self, data: bytes, now: float) -> list[list[Any]]:
        """The lines ``data`` finished, each ``[now, stream, text, False]``."""
        return [[now, self.stream, line, False] for line in self.feed_texts(data, now)]

    def feed_texts(self, data: bytes, now: float) -> list[str]:
        """The texts of the lines ``data`` finished (what a terminal shows of each, cut past
        MAX_LINE, saying so); ``data`` empty: the stream ended."""
        text = self._partial + self._decoder.decode(data, final=not data)
        *finished, partial = text.split("\n")
        if "\r" in partial:  # a progress bar: keep what a terminal shows, however often it is redrawn
            partial = "\r" + _visible(partial) + ("\r" if partial.endswith("\r") else "")
        if finished or partial != self._partial:
            self._partial, self._partial_since = partial, now
        if not data and self._partial:  # end of stream: an unterminated last line
            finished.append(self._partial)
            self._partial = ""
        if len(self._partial) > 100 * MAX_LINE:  # no newline for a long time
            finished.append(self._partial)
            self._partial = ""
        if finished:
            self._sent_open = None
        if "\r" not in text and max(map(len, finished), default=0) <= MAX_LINE:  # most output: each line as it is
            return finished
        # A bar cleared and then ended (tqdm's close with leave=False) is no line of output.
        return [_shown(_visible(line)) for line in finished if "\r" not in line or _visible(line).strip()]

    def end_line(self, now: float) -> list[Any] | None:
        """The unfinished line as a finished one (a session's call ended after printing it)."""
        partial, self._partial, self._sent_open = self._partial, "", None
        visible = _shown(_visible(partial))
        return [now, self.stream, visible, False] if visible.strip() else None

    def open_line(self, now: float) -> list[Any] | None:
        """The unfinished line, if it changed since it was last sent and is worth showing.

        It is when it rewrites itself with ``\r`` (a progress bar) or has waited
        OPEN_LINE_DELAY for its newline (``print(..., end="")``); a line merely
        cut by a pipe read is completed long before that.
        """
        visible = _shown(_visible(self._partial), finished=False)
        if not visible or visible == self._sent_open:
            return None
        if "\r" not in self._partial and now - self._partial_since < OPEN_LINE_DELAY:
            return None
        self._sent_open = visible
        return [now, self.stream, visible, True]
