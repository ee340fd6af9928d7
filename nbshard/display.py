"""Render a run as text or HTML: its streamed output and its live view.

Pure formatting from plain state: the caller decides where the text goes
(``sys.stdout`` in a terminal and in ipykernel, which batches stream
messages; a display updated in place by its id in a notebook).
"""

from __future__ import annotations

import collections
import dataclasses
import html
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "LinePrinter",
    "LiveDisplay",
    "RankView",
    "TailView",
    "human_bytes",
    "in_notebook",
    "rank_prefix",
    "render_html",
    "render_text",
    "sparkline_svg",
]


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

    def render(self) -> str:
        return "\n".join(text for _, text, _ in self._lines)


@dataclasses.dataclass
class RankView:
    """What the live view shows of one rank: plain data, rendered by the functions below."""

    rank: int
    device: str = ""  # "GPU" or "CPU": which memory ``current`` and ``peak`` count
    current: float | None = None  # bytes
    peak: float | None = None
    history: list[float] = dataclasses.field(default_factory=list)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    last_line: str = ""


def human_bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


def _metrics_text(metrics: dict[str, float]) -> str:
    return " ".join(f"{name}={value:.4g}" for name, value in metrics.items())


def render_text(title: str, ranks: Sequence[RankView]) -> str:
    """The live view as text, for a terminal, a log, or a notebook's plain-text fallback."""
    rows = [title]
    for view in ranks:
        memory = f"{view.device} {human_bytes(view.current)} (peak {human_bytes(view.peak)})" if view.device else "memory -"
        parts = [f"rank {view.rank}", memory, _metrics_text(view.metrics), view.last_line[:80]]
        rows.append("  " + " | ".join(part for part in parts if part))
    return "\n".join(rows)


def sparkline_svg(values: Sequence[float], width: int = 120, height: int = 24) -> str:
    """Memory over time as a self-contained inline SVG (no script, no network)."""
    if len(values) < 2:
        return f'<svg width="{width}" height="{height}"></svg>'
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 1 - (v / top) * (height - 2):.1f}" for i, v in enumerate(values))
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{points}"/></svg>'
    )


def render_html(title: str, ranks: Sequence[RankView], tail: str = "") -> str:
    """The live view as one self-contained HTML fragment: a table per rank, then the newest lines."""
    cell = 'style="padding:2px 8px;text-align:left"'
    header = "".join(f"<th {cell}>{name}</th>" for name in ("rank", "memory", "peak", "over time", "metrics", "last line"))
    rows = "".join(
        "<tr>"
        f"<td {cell}>{view.rank}</td>"
        f"<td {cell}>{html.escape(view.device)} {human_bytes(view.current)}</td>"
        f"<td {cell}>{human_bytes(view.peak)}</td>"
        f"<td {cell}>{sparkline_svg(view.history)}</td>"
        f"<td {cell}>{html.escape(_metrics_text(view.metrics))}</td>"
        f"<td {cell}><code>{html.escape(view.last_line[:120])}</code></td>"
        "</tr>"
        for view in ranks
    )
    pre = f'<pre style="margin:4px 0;max-height:24em;overflow:auto">{html.escape(tail)}</pre>' if tail else ""
    return (
        f'<div class="nbshard-job"><div><b>{html.escape(title)}</b></div>'
        f'<table style="border-collapse:collapse;font-size:90%"><tr>{header}</tr>{rows}</table>{pre}</div>'
    )


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where display updates reach a cell), not in a terminal IPython."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


class LiveDisplay:
    """One notebook output, updated in place by its display id (from any thread).

    Updates by id reach the output of the cell that created it even while
    other cells run, and a throttle keeps them far below Jupyter's rate limit.
    """

    def __init__(self, render: Callable[[], tuple[str, str]]) -> None:
        from IPython.display import display

        self._render = render
        self._last = time.monotonic()
        html_text, plain = render()
        self._display = display({"text/html": html_text, "text/plain": plain}, raw=True, display_id=True)

    def update(self, min_interval: float = 0.0) -> None:
        """Re-render, unless the last update was less than ``min_interval`` seconds ago."""
        now = time.monotonic()
        if now - self._last < min_interval:
            return
        self._last = now
        html_text, plain = self._render()
        self._display.update({"text/html": html_text, "text/plain": plain}, raw=True)
