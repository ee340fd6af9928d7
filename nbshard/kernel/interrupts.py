"""Interrupts that land where the kernel waits for them, never inside a lock.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread runs when SIGINT
comes, and that can be inside ``threading.Event.wait`` (or ipykernel's output flush, which
waits on one): just after it took the event's lock and before the block that releases it,
the lock stays held, and every later ``wait`` or ``set`` of that event hangs (the thread that
ends the job blocks in ``set``: the cell never ends); just after it released the lock, the
block releases it again and a ``RuntimeError`` replaces the interrupt. So while the kernel
waits for a job, SIGINT is only counted, and the wait raises ``KeyboardInterrupt`` itself
between slices of at most ``WAIT_SLICE`` seconds. Only where SIGINT would raise anyway
(Python's own handler, in the main thread); an interrupt still counted when the wait ends
is raised then.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["WAIT_SLICE", "Deferred", "deferred_interrupts", "wait"]

WAIT_SLICE = 0.1  # seconds: at most this long from the stop button to the wait's KeyboardInterrupt


class Deferred:
    """SIGINT counted, while active, for ``check()`` to raise."""

    def __init__(self) -> None:
        self.pending = 0
        self._previous: Any = None  # the handler this one stands in for; None: not active

    @property
    def active(self) -> bool:
        return self._previous is not None

    def _count(self, signum: int, frame: Any) -> None:
        self.pending += 1

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` for an interrupt that came since the last check."""
        if self.pending:
            self.pending -= 1
            raise KeyboardInterrupt

    def raising_in(self, fn: Callable[[str], str]) -> Callable[[str], str]:
        """``fn`` called with interrupts raising as usual (``input()``, which waits for a person,
        is left by one), the rest of the wait still counting them."""
        def call(text: str) -> str:
            if not self.active:
                return fn(text)
            signal.signal(signal.SIGINT, self._previous)
            try:
                self.check()
                return fn(text)
            finally:
                signal.signal(signal.SIGINT, self._count)
        return call


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[Deferred]:
    """SIGINT counted inside (where it would raise ``KeyboardInterrupt`` at any bytecode), raised
    by ``check()``; one left unchecked is raised at the end, unless an exception leaves already."""
    deferred = Deferred()
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        deferred._previous = signal.signal(signal.SIGINT, deferred._count)
    try:
        yield deferred
    finally:
        if deferred.active:
            signal.signal(signal.SIGINT, deferred._previous)
            deferred._previous = None
    deferred.check()


def wait(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)``, where an interrupt raises ``KeyboardInterrupt`` between slices of
    the wait rather than inside the event's lock."""
    with deferred_interrupts() as interrupts:
        if not interrupts.active:
            return event.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - time.monotonic())
            if event.wait(max(0.0, left)):
                return True
            interrupts.check()
            if deadline is not None and time.monotonic() >= deadline:
                return False
