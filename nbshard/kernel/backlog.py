"""The lines and notes that reached the kernel for a live view and are not yet shown: bounded.

The handle's background thread adds what arrives; one reader at a time (``watch``
printing to a cell or a terminal, a ``show_live`` view) takes it. Past
``LIVE_BACKLOG`` entries the oldest are dropped from the live view (never from
the logs) and the next reader is told how many, unless a reader that takes every
line is watching (a terminal): then the adding thread waits for it, and unread
messages queue in the sockets, which are bounded too.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Protocol

__all__ = ["LIVE_BACKLOG", "LiveBacklog"]

LIVE_BACKLOG = 100_000  # entries waiting to be shown (about 25 MB of short lines)


class Sink(Protocol):
    def line(self, rank: int, stream: str, text: str, is_open: bool) -> Any: ...
    def note(self, text: str) -> Any: ...
    # Optional: ``line_run(rank, stream, texts, is_open)``, several lines of one stream at once.


class LiveBacklog:
    def __init__(self, logs_hint: str) -> None:
        # [rank, stream, texts, is_open] for a run of lines as they arrived, (rank, text) for a note
        self._items: collections.deque[list[Any] | tuple[int, str]] = collections.deque()
        self._count = 0  # lines and notes waiting
        self._logs_hint = logs_hint  # where every line is, for the note about dropped ones
        self._dropped = 0
        self._dropped_said = 0
        self._arrived = threading.Event()  # set when entries arrive, to wake a reader that is not paced
        self._taken = threading.Event()  # set when a reader took entries, to wake a waiting adder
        self.patient = False  # True while a reader that takes every line watches

    def lines(self, rank: int, stream: str, texts: list[str], is_open: bool) -> None:
        """Lines of one stream of a rank (``is_open``: its unfinished current line)."""
        self._items.append([rank, stream, texts, is_open])
        self._count += len(texts)
        self._make_room()

    def note(self, text: str, rank: int = -1) -> None:
        self._items.append((rank, text))
        self._count += 1
        self._make_room()

    def _make_room(self) -> None:
        self._arrived.set()
        while self._count > LIVE_BACKLOG and self.patient:
            self._taken.wait(0.1)
            self._taken.clear()
        while self._count > LIVE_BACKLOG:  # the oldest go
            oldest = self._items[0]
            excess = self._count - LIVE_BACKLOG
            if isinstance(oldest, list) and len(oldest[2]) > excess:
                del oldest[2][:excess]
                gone = excess
            else:
                self._items.popleft()
                gone = len(oldest[2]) if isinstance(oldest, list) else 1
            self._count -= gone
            self._dropped += gone

    def feed(self, sink: Sink, most: int | None = None) -> list[Any]:
        """Hand at most ``most`` entries to ``sink``, oldest first, after a note of any it will
        never see; returns what the sink made of them."""
        fed = []
        dropped = self._dropped
        if dropped > self._dropped_said:
            fed.append(sink.note(
                f"{dropped - self._dropped_said} lines were not shown live (more came than could be shown); "
                f"handle.logs(rank) has every line, the full logs are in {self._logs_hint}"
            ))
            self._dropped_said = dropped
        line_run = getattr(sink, "line_run", None)
        room = float("inf") if most is None else most
        while self._items and room > 0:
            item = self._items[0]
            if not isinstance(item, list):
                self._items.popleft()
                fed.append(sink.note(item[1]))
                taken = 1
            else:
                rank, stream, texts, is_open = item
                if len(texts) > room:  # the rest waits for the next turn
                    texts, item[2] = texts[:int(room)], texts[int(room):]
                else:
                    self._items.popleft()
                if line_run is not None:
                    fed.append(line_run(rank, stream, texts, is_open))
                else:
                    fed.extend(sink.line(rank, stream, text, is_open) for text in texts)
                taken = len(texts)
            room -= taken
            self._count -= taken
        self._taken.set()
        return fed

    def wait(self, done: threading.Event, paced: bool) -> bool:
        """Wait 0.1 s (``paced``: a notebook's rhythm, which batches what it sends to the
        browser) or, for a terminal, until entries arrive, so a line shows within a few
        milliseconds of its print; True once ``done``."""
        if paced:
            return done.wait(0.1)
        self._arrived.wait(0.1)
        self._arrived.clear()
        return done.is_set()

    def wake(self) -> None:
        """Wake a waiting reader (the job ended)."""
        self._arrived.set()
