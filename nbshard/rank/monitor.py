"""Rank side telemetry: a sampler thread that sends memory, and ``log_metrics`` for user code.

Samples (``memory_sample.py``) go straight from each rank to the kernel's socket, signed like
every message; every metric is also written to the run directory.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import threading
import time
from pathlib import Path
from typing import Any

from nbshard.files import open_private, write_json
from nbshard.rank.memory_sample import sample_memory
from nbshard.wire import Sender

__all__ = ["Monitor", "log_metrics", "send_stage", "take_sample"]

LINGER_MS = 500  # a rank's exit waits at most this long for a slow kernel

_active: Monitor | None = None


class Monitor:
    """One per rank: sends a memory sample every ``interval`` seconds, and user metrics."""

    def __init__(
        self, address: str, key: bytes, rank: int, interval: float | None, metrics_path: str | None = None,
        last_sample_path: str | None = None,
    ) -> None:
        self.rank = rank
        self._last_sample_path = last_sample_path  # the last sample goes there too: the wire may drop it
        self._sender = Sender(address, key, linger_ms=LINGER_MS)
        # Every metric also goes to a file in the run directory: the wire may drop under load, the file never.
        # Line-buffered: a session's rank keeps the file open across calls, and a call's records
        # must be on disk when the call ends (the kernel reads them there; the wire may be late).
        self._metrics_file = open_private(metrics_path, "a", encoding="utf-8", buffering=1) if metrics_path else None  # noqa: SIM115
        self._lock = threading.Lock()  # the socket is shared by the sampler and user code
        self._stop = threading.Event()
        self._interval = interval
        self._thread: threading.Thread | None = None
        if interval:
            self._thread = threading.Thread(target=self._sample_until_stopped, name="nbshard-monitor", daemon=True)
            self._thread.start()

    def send(self, message: dict[str, Any], wait: float = 0.0) -> None:
        """``message`` on the wire (``wait``: seconds it may wait for room in a full queue)."""
        message.update(rank=self.rank, time=time.time())
        with self._lock:
            if self._metrics_file is not None and message["kind"] == "metrics":
                self._metrics_file.write(json.dumps(message, separators=(",", ":")) + "\n")
            self._sender.send(message, wait)

    def sample(self) -> dict[str, Any] | None:
        """A sample message, or None when sampling failed (a gap in a plot, never an error)."""
        try:
            return {"kind": "sample", **sample_memory(), "rank": self.rank, "time": time.time()}
        except Exception:  # noqa: BLE001 - telemetry must never fail the job
            return None

    def send_sample(self, wait: float = 0.0) -> dict[str, Any] | None:
        if (message := self.sample()) is not None:
            with contextlib.suppress(Exception):  # a lost sample is a gap in a plot; the thread goes on
                self.send(message, wait)
        return message

    def _sample_until_stopped(self) -> None:
        self.send_sample()
        while not self._stop.wait(self._interval):
            self.send_sample()

    def close(self) -> None:
        """Send a last sample (the peaks at the end), then flush for at most LINGER_MS. Behind a
        flood of metrics the wire may still drop it, so it is written to a file as well."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            last = self.send_sample(wait=LINGER_MS / 1000)
            if last is not None and self._last_sample_path:
                with contextlib.suppress(OSError):  # a full disk: the wire's samples are what there is
                    write_json(Path(self._last_sample_path), last)
        with self._lock:
            if self._metrics_file is not None:
                self._metrics_file.close()
            self._sender.close()


def start(
    address: str, key: bytes, rank: int, interval: float | None, metrics_path: str | None = None,
    last_sample_path: str | None = None,
) -> Monitor:
    global _active
    _active = Monitor(address, key, rank, interval, metrics_path, last_sample_path)
    return _active


def take_sample() -> dict[str, Any] | None:
    """A sample message now, between the interval's, for the caller to send (a session's rank
    hands it to its launcher with its answer, so it reaches the kernel before the call's end);
    None where memory is not sampled (``sample_interval=None``, or outside a rank)."""
    return _active.sample() if _active is not None and _active._interval else None


def send_stage(stage: str) -> None:
    """Tell the kernel what this rank is doing (``running``: the job is loaded, its imports done)."""
    if _active is not None:
        with contextlib.suppress(Exception):  # telemetry never fails a job
            _active.send({"kind": "stage", "stage": stage})


def stop() -> None:
    global _active
    if _active is not None:
        _active.close()
        _active = None


def log_metrics(step: int | None = None, **metrics: Any) -> bool:
    """Send scalar metrics (``loss=0.3, lr=1e-4``) from a rank to the notebook.

    Each value must be a number or a one-element tensor. Outside an nbshard
    rank (a script under torchrun, the kernel) it does nothing and returns
    False, so the same code runs everywhere.
    """
    values = {}
    for name, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"log_metrics({name}=...) takes numbers or one-element tensors, got {type(value).__name__}")
        values[name] = float(value)
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise TypeError(f"log_metrics(step=...) takes an integer, got {step!r}")
    if _active is None:
        return False
    _active.send({"kind": "metrics", "step": None if step is None else int(step), "values": values})
    return True
