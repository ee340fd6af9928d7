"""The peak anonymous memory of this process over a block of code, for the memory benchmarks.

Imported inside the ranks (the benchmarks' folder is on their import path, as on the kernel's).
"""

from __future__ import annotations

import threading
from types import TracebackType


def anonymous_bytes() -> int:
    """RssAnon: resident anonymous memory (the page cache of a memory-mapped file is not in it)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakAnonymousMemory:
    """``with PeakAnonymousMemory() as peak: ...`` then ``peak.above_baseline``: sampled every 2 ms."""

    def __init__(self) -> None:
        self.baseline = self.peak = anonymous_bytes()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, anonymous_bytes())

    def __enter__(self) -> PeakAnonymousMemory:
        self._sampler.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._sampler.join()
        self.peak = max(self.peak, anonymous_bytes())

    @property
    def above_baseline(self) -> int:
        return self.peak - self.baseline
