"""The kernel's record of a job's memory samples and metrics, as records, peaks and views."""

from __future__ import annotations

import collections
import json
import os
import threading
from typing import Any

from nbshard.kernel.display import RankView

__all__ = ["KEPT", "Telemetry", "metrics_record", "read_metrics_files", "shown_bytes", "shown_cpu_bytes", "to_frame"]

HISTORY = 120  # memory points per rank kept for the live plot
KEPT = 100_000  # memory and metrics records kept in the kernel while a job runs (the newest)


def _records_of_sample(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat record per device (or one without GPU fields), ready for a DataFrame."""
    cpu = {
        "rank": message["rank"], "time": message["time"], "cpu_rss": message["rss"], "cpu_peak_rss": message["peak_rss"],
        "cpu_anon": message.get("anon"), "cpu_peak_anon": message.get("peak_anon"),
        # forked (warm) ranks only: proportional shares of pages shared with the warm process
        "cpu_pss": message.get("pss"), "cpu_peak_pss": message.get("peak_pss"),
        "cpu_pss_anon": message.get("pss_anon"), "cpu_peak_pss_anon": message.get("peak_pss_anon"),
    }
    gpus = message.get("gpus") or [{}]
    return [
        {
            **cpu,
            "gpu": gpu.get("device"),
            "gpu_allocated": gpu.get("allocated"),
            "gpu_reserved": gpu.get("reserved"),
            "gpu_peak_allocated": gpu.get("peak_allocated"),
            "gpu_used": gpu.get("used"),
        }
        for gpu in gpus
    ]


def metrics_record(message: dict[str, Any]) -> dict[str, Any]:
    """One flat record of a ``metrics`` message (off the wire, or a line of a rank's metrics file)."""
    return {"rank": message["rank"], "time": message["time"], "step": message.get("step"), **message.get("values", {})}


def read_metrics_files(paths: list[Any], offsets: list[int] | None = None) -> list[dict[str, Any]]:
    """Every record of the ranks' metrics files (from ``offsets``, bytes into each), in time
    order; a torn last line is skipped."""
    records = []
    for index, path in enumerate(paths):
        start = offsets[index] if offsets else 0
        try:
            if os.stat(path).st_size <= start:
                continue  # nothing (since: a session's call that logged no metrics)
            with open(path, "rb") as file:
                file.seek(start)
                lines = file.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                records.append(metrics_record(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue
    return sorted(records, key=lambda record: record["time"])


class Telemetry:
    """Filled from the wire by the handle's thread; read by anyone (it locks)."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self._memory: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEPT)
        self._metrics: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEPT)
        self._history: dict[int, collections.deque[float]] = {r: collections.deque(maxlen=HISTORY) for r in range(nproc)}
        self._latest: dict[int, dict[str, Any]] = {}
        self._peak: dict[int, float] = {}
        self._last_metrics: dict[int, dict[str, float]] = {}
        self._last_line: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, message: dict[str, Any]) -> bool:
        """Record a ``sample`` or ``metrics`` message; False for other kinds."""
        kind, rank = message.get("kind"), message.get("rank")
        if kind not in ("sample", "metrics") or not isinstance(rank, int) or not 0 <= rank < self.nproc:
            return False
        with self._lock:
            if kind == "sample":
                records = _records_of_sample(message)
                self._memory.extend(records)
                self._latest[rank] = records[0]
                device, shown = shown_bytes(records[0])
                true_peak = records[0][_PEAK_FIELD[device]] or 0
                self._history[rank].append(shown)
                self._peak[rank] = max(self._peak.get(rank, 0.0), shown, float(true_peak))
            else:
                values = message.get("values", {})
                self._metrics.append(metrics_record(message))
                self._last_metrics.setdefault(rank, {}).update(values)
                if message.get("step") is not None:
                    self._last_metrics[rank]["step"] = message["step"]
        return True

    def last_time(self, rank: int) -> float:
        """When the newest sample of ``rank`` was taken (-inf before any)."""
        with self._lock:
            latest = self._latest.get(rank)
            return latest["time"] if latest else float("-inf")

    def last_line(self, rank: int, text: str) -> None:
        self._last_line[rank] = text

    def memory(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._memory)

    def metrics(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._metrics)

    def peaks(self) -> dict[int, dict[str, int | None]]:
        """Per rank: the highest memory seen (bytes), each kind under its own name (see _PEAKS)."""
        peaks: dict[int, dict[str, int | None]] = {}
        for record in self.memory():
            peak = peaks.setdefault(record["rank"], dict.fromkeys(_PEAKS))
            for field, source in _PEAKS.items():
                if record[source] is not None:
                    peak[field] = max(peak[field] or 0, record[source])
        return dict(sorted(peaks.items()))

    def views(self, gone: bool = False) -> list[RankView]:
        """What the live view shows for each rank (``gone``: the ranks ended, their memory freed)."""
        with self._lock:
            views = []
            for rank in range(self.nproc):
                latest = self._latest.get(rank)
                device, current = shown_bytes(latest) if latest else ("", None)
                views.append(RankView(
                    rank=rank, device=device, current=None if gone else current, peak=self._peak.get(rank), gone=gone,
                    history=list(self._history[rank]), metrics=dict(self._last_metrics.get(rank, {})),
                    last_line=self._last_line.get(rank, ""),
                ))
            return views


# peak_memory()'s fields and the record field each comes from.
_PEAKS = {
    "cpu_peak_rss": "cpu_peak_rss",  # resident, file pages included (a memory-mapped checkpoint, libraries)
    "cpu_peak_anon": "cpu_peak_anon",  # anonymous resident: what tensors and the heap hold (sampled)
    "cpu_peak_pss": "cpu_peak_pss",  # warm ranks: resident, shared pages divided among their sharers
    "cpu_peak_pss_anon": "cpu_peak_pss_anon",  # warm ranks: anonymous, shared pages divided
    "gpu_peak_allocated": "gpu_peak_allocated",  # torch's allocator
    "gpu_peak_used": "gpu_used",  # NVML: what the process holds on the device
}
_PEAK_FIELD = {
    "GPU": "gpu_peak_allocated", "CPU": "cpu_peak_rss", "CPU anon": "cpu_peak_anon", "CPU anon PSS": "cpu_peak_pss_anon",
}


def shown_bytes(record: dict[str, Any]) -> tuple[str, float]:
    """The memory that reflects a rank's footprint: its GPU's when it uses one, else its anonymous
    CPU memory (without file pages: a memory-mapped checkpoint is the page cache's, not the
    rank's), as its proportional share when it was forked from the warm process and shares pages."""
    if record.get("gpu_allocated") is not None:
        return "GPU", float(record["gpu_used"] if record.get("gpu_used") is not None else record["gpu_reserved"])
    return shown_cpu_bytes(record)


def shown_cpu_bytes(record: dict[str, Any]) -> tuple[str, float]:
    """``shown_bytes`` of the CPU alone, for a rank that uses a GPU too."""
    if record.get("cpu_pss_anon") is not None:
        return "CPU anon PSS", float(record["cpu_pss_anon"])
    if record.get("cpu_anon") is not None:
        return "CPU anon", float(record["cpu_anon"])
    return "CPU", float(record["cpu_rss"])


def to_frame(records: list[dict[str, Any]]) -> Any:
    try:
        import pandas
    except ImportError:
        raise ImportError("pandas is not installed: `pip install pandas`, or use the records themselves") from None
    return pandas.DataFrame.from_records(records)
