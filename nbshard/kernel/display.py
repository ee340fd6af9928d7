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


def _blank(text: str) -> bool:
    return not text.strip()


class LinePrinter:
    """Interleaves the ranks' lines, prefixed, as a terminal shows them.

    An *open* line (one a rank keeps rewriting with ``\\r``, a progress bar)
    lives on the bottom line and is rewritten there in place; finished lines
    of any rank or stream are written above it, and it is drawn again below
    them, so a bar on stderr and logs on stdout read as in a terminal: the
    logs, then one live bar. A cleared bar (blank) is not shown at all.
    """

    def __init__(self, show_ranks: Sequence[int] | None = None) -> None:
        self.show_ranks = None if show_ranks is None else frozenset(show_ranks)
        self._open: dict[tuple[int, str], str] = {}  # (rank, stream) -> its open line, newest last
        self._bottom: int | None = None  # width of the unfinished bottom line, when there is one

    def shows(self, rank: int) -> bool:
        return self.show_ranks is None or rank in self.show_ranks

    def _write_bottom(self, text: str) -> str:
        """Rewrite the unfinished bottom line with ``text`` (padded over a longer old one)."""
        lead = "\r" + text.ljust(self._bottom) if self._bottom is not None else text
        self._bottom = len(text)
        return lead

    def _finish(self, text: str) -> str:
        """``text`` as a finished line, then the newest open line drawn below it again."""
        out = self._write_bottom(text) + "\n"
        self._bottom = None
        if self._open:
            out += self._write_bottom(next(reversed(self._open.values())))
        return out

    def line(self, rank: int, stream: str, text: str, is_open: bool) -> str:
        if not self.shows(rank):
            return ""
        key, shown = (rank, stream), rank_prefix(rank) + text
        self._open.pop(key, None)
        if not is_open:
            return self._finish(shown)
        if _blank(text):  # the bar was cleared (tqdm does so to print above it)
            return self._write_bottom(next(reversed(self._open.values()), "")) if self._bottom is not None else ""
        self._open[key] = shown
        return self._write_bottom(shown)

    def line_run(self, rank: int, stream: str, texts: list[str], is_open: bool) -> str:
        """Several lines of one stream, as ``line`` would write them one by one."""
        if not is_open and self._bottom is None and not self._open and self.shows(rank):  # no bar to redraw
            prefix = rank_prefix(rank)
            return prefix + f"\n{prefix}".join(texts) + "\n"
        return "".join(self.line(rank, stream, text, is_open) for text in texts)

    def note(self, text: str) -> str:
        return self._finish(f"[nbshard]: {text}")

    def close(self) -> str:
        """End the open line, if one is shown."""
        self._open.clear()
        if self._bottom is None:
            return ""
        self._bottom = None
        return "\n"


class TailView:
    """The newest lines of a run, as a notebook view shows them: finished lines, then each
    rank's live progress bar as one line below them (a cleared bar is not shown)."""

    def __init__(self, show_ranks: Sequence[int] | None = None, max_lines: int = 20) -> None:
        self.show_ranks = None if show_ranks is None else frozenset(show_ranks)
        self.max_lines = max_lines
        self._finished: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._open: dict[tuple[int, str], str] = {}
        self._seen = 0  # finished lines ever added: those beyond the newest are not shown

    def line(self, rank: int, stream: str, text: str, is_open: bool) -> None:
        if self.show_ranks is not None and rank not in self.show_ranks:
            return
        key, shown = (rank, stream), rank_prefix(rank) + text
        self._open.pop(key, None)
        if not is_open:
            self._add(shown)
        elif not _blank(text):
            self._open[key] = shown

    def note(self, text: str) -> None:
        self._add(f"[nbshard]: {text}")

    def _add(self, line: str) -> None:
        self._finished.append(line)
        self._seen += 1

    def lines(self) -> list[str]:
        """The newest lines, oldest first, after a line saying how many earlier ones are not
        shown; the live bars last."""
        live = list(self._open.values())[-self.max_lines:]
        room = self.max_lines - len(live)
        finished = list(self._finished)[-room:] if room else []
        hidden = self._seen - len(finished)
        earlier = [f"[nbshard]: {hidden} earlier line{'s' * (hidden > 1)} not shown here; handle.logs(rank) has every line"] if hidden else []
        return [*earlier, *finished, *live]

    def render(self) -> str:
        return "\n".join(self.lines())


@dataclasses.dataclass
class RankView:
    """What the live view shows of one rank: plain data, rendered by the functions below."""

    rank: int
    device: str = ""  # "GPU", "CPU anon", "CPU anon PSS" (a warm rank's share) or "CPU": what ``current`` and ``peak`` count
    current: float | None = None  # bytes
    peak: float | None = None
    history: list[float] = dataclasses.field(default_factory=list)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    last_line: str = ""
    gone: bool = False  # the rank ended (a closed session's): it holds no memory now


def _memory_now(view: RankView) -> str:
    return "gone" if view.gone else f"{view.device} {human_bytes(view.current)}"


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
        memory = f"{_memory_now(view)} (peak {human_bytes(view.peak)})" if view.device else "memory -"
        parts = [f"rank {view.rank}", memory, _metrics_text(view.metrics), view.last_line[:80]]
        rows.append("  " + " | ".join(part for part in parts if part))
    return "\n".join(rows)


def sparkline_svg(values: Sequence[float], width: int = 120, height: int = 24) -> str:
    """Memory over time as a self-contained inline SVG (no script, no network), zero at the
    bottom and the highest value a quarter below the top, so no line runs along the cell's
    edge; a series that barely moves is drawn dashed and grey across the middle, as steady,
    not as a border."""
    if len(values) < 2:
        return f'<svg width="{width}" height="{height}"></svg>'
    top, low = max(values) or 1.0, min(values)
    steady = top - low <= 0.02 * top
    step = width / (len(values) - 1)
    span = (height - 2) * 0.75
    def y(value: float) -> float:
        return height / 2 if steady else height - 1 - (value / top) * span

    points = " ".join(f"{i * step:.1f},{y(v):.1f}" for i, v in enumerate(values))
    style = 'stroke="#999" stroke-dasharray="3 3"' if steady else 'stroke="#1f77b4"'
    title = f"steady at {human_bytes(top)}" if steady else f"{human_bytes(low)} to {human_bytes(top)}"
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" style="vertical-align:middle"><title>{title}</title>'
        f'<polyline fill="none" {style} stroke-width="1.5" points="{points}"/></svg>'
    )


def render_html(title: str, ranks: Sequence[RankView], tail: str = "", charts: str = "") -> str:
    """The live view as one self-contained HTML fragment: a table per rank, the ``charts``
    (HTML), then the newest lines."""
    cell = 'style="padding:2px 8px;text-align:left"'
    header = "".join(f"<th {cell}>{name}</th>" for name in ("rank", "memory", "peak", "over time", "metrics", "last line"))
    rows = "".join(
        "<tr>"
        f"<td {cell}>{view.rank}</td>"
        f"<td {cell}>{html.escape(_memory_now(view))}</td>"
        f"<td {cell}>{human_bytes(view.peak)}</td>"
        f"<td {cell}>{sparkline_svg(view.history)}</td>"
        f"<td {cell}>{html.escape(_metrics_text(view.metrics))}</td>"
        f"<td {cell}>{f'<code>{html.escape(view.last_line[:120])}</code>' if view.last_line else ''}</td>"
        "</tr>"
        for view in ranks
    )
    # No scroll box: a box re-rendered on each update would jump back to its top and steal the
    # reader's place. The tail holds only the newest lines, so the newest is always in view.
    pre = f'<pre style="margin:4px 0;white-space:pre-wrap;overflow-wrap:anywhere">{html.escape(tail)}</pre>' if tail else ""
    return (
        f'<div class="nbshard-job"><div><b>{html.escape(title)}</b></div>'
        f'<table style="border-collapse:collapse;font-size:90%"><tr>{header}</tr>{rows}</table>'
        f'{f"<div>{charts}</div>" if charts else ""}{pre}</div>'
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
