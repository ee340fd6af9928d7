"""A running job shown as it runs: ``JobHandle.watch`` and ``JobHandle.show_live``.

``watch`` prints the ranks' lines as they arrive, with a live view of each rank's memory
and metrics above them in a notebook (a memory line now and then in a terminal), asks the
person about a rank's debugger prompt, and turns an interrupt into a cancel. ``show_live``
keeps one notebook output updated in place from a thread, without blocking the cell.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from nbshard.job import Job
from nbshard.kernel.backlog import LiveBacklog
from nbshard.kernel.debugging import QUIT_COMMANDS, RankDebugger
from nbshard.kernel.display import LinePrinter, LiveDisplay, TailView, human_bytes, in_notebook, render_html, render_text
from nbshard.kernel.interrupts import deferred_interrupts
from nbshard.kernel.plots import charts_html, charts_of
from nbshard.kernel.profiles import ProfileReport
from nbshard.kernel.telemetry import Telemetry

__all__ = ["Watched", "show_live", "watch"]

LIVE_LINES_PER_TICK = 1_000  # lines written to a notebook cell per 0.1 s: far more than a person reads,
# and below Jupyter's output rate limit; a faster flood waits in the backlog, then is dropped from the
# cell (never from the log) and the cell says how many. A terminal takes all, woken as lines arrive.
LIVE_VIEW_INTERVAL = 1.0  # seconds between updates of a notebook's live view while run() blocks
MEMORY_TEXT_INTERVAL = 30.0  # seconds between memory lines printed in a terminal
RANKS_LISTED = 8  # ranks named one by one in a memory line; more are summed up as a range
MIN_CHART_SECONDS = 1.0  # the live view draws a memory chart once its samples span this long (handle.plot() always does)
LIVE_CHART_SIZE = (300, 160)  # pixels of each chart in a live view (handle.plot() draws them larger)


class Watched(Protocol):
    """What showing a job needs of its handle (a ``JobHandle``; its private parts are these
    helpers' to read, not the person's)."""

    job: Job
    world_size: int
    started: float
    run_dir: Path
    _live: LiveBacklog
    _done: threading.Event
    _debugger: RankDebugger
    _telemetry: Telemetry

    def done(self) -> bool: ...
    def cancel(self, wait: bool = True) -> bool: ...
    def kill(self) -> None: ...
    def summary(self) -> str: ...
    def profile(self) -> ProfileReport: ...
    def add_done_callback(self, fn: Callable[[Any], Any]) -> None: ...
    def _interrupted(self) -> BaseException | None: ...


def watch(handle: Watched, out: Any) -> None:
    """Print ``handle``'s lines to ``out`` until the job ends (``JobHandle.watch`` says what else)."""
    printer = LinePrinter(handle.job.show_ranks)
    live = LazyView(lambda: render_view(handle)) if out is sys.stdout and in_notebook() else None
    next_memory_text = time.monotonic() + MEMORY_TEXT_INTERVAL
    most = LIVE_LINES_PER_TICK if live is not None else None
    backlog, debugger = handle._live, handle._debugger
    backlog.patient = live is None  # a terminal takes every line: the drain waits for it
    debugger.watched = True

    def show(text: str | None = None, most: int | None = LIVE_LINES_PER_TICK) -> None:
        chunks = backlog.feed(printer, most)
        if text:
            chunks.append(printer.note(text))
        if chunks:
            if live is not None:
                live.shown()  # above the lines
            out.write("".join(chunks))
            out.flush()

    with deferred_interrupts() as interrupts:  # the stop button raises at the loop's checks, not in a lock
        try:
            while not backlog.wait(handle._done, paced=live is not None):
                interrupts.check()
                show(most=most)
                while debugger.waiting():
                    show(most=None)
                    if live is not None:
                        live.update()
                    _answer_prompt(handle, out, show, interrupts.raising_in(input))
                if live is not None:
                    live.update(LIVE_VIEW_INTERVAL)
                elif time.monotonic() > next_memory_text:
                    next_memory_text += MEMORY_TEXT_INTERVAL
                    show(memory_text(handle, peak=False))
        except KeyboardInterrupt:
            show(f"interrupted: stopping {handle.job.label} (interrupt again to kill it now)")
            try:
                handle.cancel(wait=False)
                while not handle._done.wait(0.1):
                    interrupts.check()
                    show()
            except KeyboardInterrupt:
                handle.kill()
                handle._done.wait()
            if (interrupted := handle._interrupted()) is not None:  # else it returned all the same: its value stands
                raise interrupted from None
        finally:
            backlog.patient = debugger.watched = False
            show(None if live is not None else memory_text(handle, peak=True), most=None)
            if ending := printer.close():
                out.write(ending)
                out.flush()
            if live is not None:
                live.update()  # the summary stays in the cell
            if handle.job.profile and handle.done():
                _show_profile(handle, out, in_notebook_cell=live is not None)


class LazyView:
    """A ``LiveDisplay`` made when first needed: before the first line is printed below it, at
    the first paced update, or at the end. A call that ends at once, silent, costs one display,
    not a display and its update (each waits for the kernel's output thread twice)."""

    def __init__(self, render: Callable[[], tuple[str, str]]) -> None:
        self._render = render
        self._display: LiveDisplay | None = None

    def shown(self) -> bool:
        """Make the display if it is not there yet; True where it was made now (so is current)."""
        if self._display is None:
            self._display = LiveDisplay(self._render)
            return True
        return False

    def update(self, min_interval: float = 0.0) -> None:
        if not self.shown():
            self._display.update(min_interval)  # type: ignore[union-attr]


def show_live(handle: Watched, refresh: float) -> None:
    """One notebook output of ``handle`` updated every ``refresh`` seconds from a thread, and
    once more when the job ended."""
    tail = TailView(handle.job.show_ranks)
    live = LiveDisplay(lambda: render_view(handle, tail))
    lock = threading.Lock()

    def update(_: Any = None) -> None:
        with lock:
            handle._live.feed(tail)
            live.update()

    def refresh_until_done() -> None:
        while not handle._done.wait(refresh):
            update()

    threading.Thread(target=refresh_until_done, name=f"nbshard-view-{handle.run_dir.name}", daemon=True).start()
    handle.add_done_callback(update)  # the last view, after earlier callbacks (e.g. pulls) ran


def render_view(handle: Watched, tail: TailView | None = None) -> tuple[str, str]:
    """(HTML, text) of the live view: summary, each rank's memory and metrics, their charts
    once there is a curve to draw, newest lines."""
    title, views = handle.summary(), handle._telemetry.views()
    lines = tail.render() if tail is not None else ""
    text = render_text(title, views) + (f"\n{lines}" if lines else "")
    return render_html(title, views, lines, _live_charts(handle)), text


def memory_text(handle: Watched, peak: bool) -> str | None:
    """One line of each rank's memory (now, or its peak), or None before any sample; past
    ``RANKS_LISTED`` ranks, the range over them per kind of memory, and the rank that holds most."""
    views = [v for v in handle._telemetry.views() if v.device]
    if not views:
        return None
    label = "peak memory" if peak else "memory"
    if len(views) <= RANKS_LISTED:
        return f"{label}: " + ", ".join(f"rank {v.rank} {v.device} {human_bytes(v.peak if peak else v.current)}" for v in views)
    by_device: dict[str, list[Any]] = {}
    for view in views:
        by_device.setdefault(view.device, []).append(view)
    parts = []
    for device, group in by_device.items():
        amounts = {v.rank: (v.peak if peak else v.current) or 0.0 for v in group}
        most = max(amounts, key=amounts.__getitem__)
        parts.append(f"{len(group)} ranks {device} {human_bytes(min(amounts.values()))} to {human_bytes(amounts[most])} (most: rank {most})")
    return f"{label}: " + ", ".join(parts)


def _live_charts(handle: Watched) -> str:
    memory, metrics = handle._telemetry.memory(), handle._telemetry.metrics()
    times = [record["time"] for record in memory if record["time"] >= handle.started]
    if not metrics and (len(memory) < 2 * handle.world_size or not times or max(times) - min(times) < MIN_CHART_SECONDS):
        return ""  # a memory chart of one point per rank, or of a moment, says less than the table
    return charts_html(charts_of(memory, metrics, handle.started), LIVE_CHART_SIZE[0], LIVE_CHART_SIZE[1])


def _answer_prompt(handle: Watched, out: Any, show: Callable[[str], None], ask: Callable[[str], str]) -> None:
    """Ask the person about a rank's debugger prompt with ``ask`` (pdb's output shown first)."""
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    line = handle._debugger.answer(write, handle.done, ask)
    if line is not None and line.strip() in QUIT_COMMANDS:
        show(f"stopping {handle.job.label}: a rank's debugger was quit")


def _show_profile(handle: Watched, out: Any, in_notebook_cell: bool) -> None:
    report = handle.profile()
    if in_notebook_cell:
        from IPython.display import display

        display(report)
    else:
        out.write(f"{report!r}\n")
        out.flush()
