"""The kernel's view of a profiled job (``profile=True``): each rank's summary and trace file."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

__all__ = ["ProfileReport"]


def _ms(microseconds: float) -> str:
    return f"{microseconds / 1000:.2f} ms"


class ProfileReport:
    """Per rank: the operators with the most self time and the share of communication, as a
    table in the notebook; ``traces``: each rank's trace file (open it in ui.perfetto.dev, or
    point TensorBoard's profiler plugin at its folder)."""

    def __init__(self, title: str, summaries: dict[int, dict[str, Any]], missing: list[int]) -> None:
        self.title = title
        self.summaries = summaries
        self.missing = missing  # ranks that wrote no profile (they were killed, or torch could not write it)
        self.traces = {rank: Path(summary["trace"]) for rank, summary in summaries.items()}

    def communication_share(self, rank: int) -> float:
        summary = self.summaries[rank]
        return summary["communication_us"] / summary["self_us"] if summary["self_us"] else 0.0

    def _lines(self) -> list[str]:
        lines = [f"profile of {self.title}"]
        for rank, summary in sorted(self.summaries.items()):
            lines.append(
                f"rank {rank}: {_ms(summary['self_us'])} profiled, communication {_ms(summary['communication_us'])} "
                f"({self.communication_share(rank):.0%}); trace {summary['trace']}"
            )
            lines += [f"  {_ms(op['self_us'] + op['device_self_us']):>12}  {op['count']:>6}x  {op['name']}" for op in summary["ops"][:8]]
        if self.missing:
            lines.append(f"no profile from rank{'s' * (len(self.missing) > 1)} {', '.join(map(str, self.missing))}")
        return lines

    def __repr__(self) -> str:
        return "\n".join(self._lines())

    def _repr_html_(self) -> str:
        cell = 'style="padding:1px 8px;text-align:left"'
        number = 'style="padding:1px 8px;text-align:right"'
        tables = []
        for rank, summary in sorted(self.summaries.items()):
            device = any(op["device_self_us"] for op in summary["ops"])
            head = "".join(f"<th {cell}>{name}</th>" for name in
                           ("operator", "calls", "self CPU", *(["self device"] if device else []), "total CPU"))
            rows = "".join(
                f"<tr><td {cell}><code>{html.escape(op['name'][:80])}</code></td><td {number}>{op['count']}</td>"
                f"<td {number}>{_ms(op['self_us'])}</td>"
                + (f"<td {number}>{_ms(op['device_self_us'])}</td>" if device else "")
                + f"<td {number}>{_ms(op['total_us'])}</td></tr>"
                for op in summary["ops"]
            )
            tables.append(
                f'<div style="display:inline-block;vertical-align:top;margin:4px 12px 4px 0">'
                f"<div><b>rank {rank}</b>: {_ms(summary['self_us'])} profiled; communication "
                f"{_ms(summary['communication_us'])} ({self.communication_share(rank):.0%}), "
                f"compute and the rest {_ms(summary['self_us'] - summary['communication_us'])}</div>"
                f'<table style="border-collapse:collapse;font-size:85%"><tr>{head}</tr>{rows}</table>'
                f'<div style="font-size:85%">trace: <code>{html.escape(summary["trace"])}</code></div></div>'
            )
        missing = (f"<div>no profile from rank{'s' * (len(self.missing) > 1)} {', '.join(map(str, self.missing))}</div>"
                   if self.missing else "")
        return (f'<div class="nbshard-profile"><div><b>profile of {html.escape(self.title)}</b> '
                f"(open a trace in ui.perfetto.dev or TensorBoard)</div>{''.join(tables)}{missing}</div>")
