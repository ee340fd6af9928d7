"""Live output from 2 ranks: lines per second into the kernel, none lost, and the delay
from a rank's print to the line being shown (median and 99th percentile).

Usage: python benchmarks/streaming.py [lines per rank]
"""

from __future__ import annotations

import statistics
import sys
import time

import nbshard


def flood(count: int) -> int:
    import os
    import sys

    rank = os.environ["RANK"]
    for index in range(count):
        sys.stdout.write(f"{rank} {index}\n")
    sys.stdout.flush()
    return count


def timestamps(count: int, pause: float) -> int:
    import time

    for _ in range(count):
        print(f"stamp {time.time():.6f}", flush=True)
        time.sleep(pause)
    return count


class Recorder:
    """A stream for handle.watch() that notes when each line reaches it."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._partial = ""

    def write(self, text: str) -> None:
        now = time.time()
        *done, self._partial = (self._partial + text).split("\n")
        self.lines.extend((now, line.rsplit("\r", 1)[-1]) for line in done)

    def flush(self) -> None:
        pass


def main(count: int = 200_000) -> None:
    recorder = Recorder()
    handle = nbshard.submit(flood, count, nproc=2)
    handle.watch(recorder)
    handle.result()
    rank_lines = [(t, line) for t, line in recorder.lines if line.startswith("[rank")]
    per_rank = {r: [line.split()[-1] for _, line in rank_lines if line.startswith(f"[rank{r}]")] for r in (0, 1)}
    complete = all(per_rank[r] == [str(i) for i in range(count)] for r in (0, 1))
    span = rank_lines[-1][0] - rank_lines[0][0]
    print(f"{2 * count} lines from 2 ranks: complete and in order per rank: {complete}")
    print(f"  {len(rank_lines) / span:,.0f} lines/s shown (first to last line, {span:.2f} s)")

    recorder = Recorder()
    handle = nbshard.submit(timestamps, 300, 0.01, nproc=2)
    handle.watch(recorder)
    handle.result()
    delays = sorted(t - float(line.split()[-1]) for t, line in recorder.lines if "stamp" in line)
    p99 = delays[min(len(delays) - 1, int(0.99 * len(delays)))]
    print(f"print-to-shown delay over {len(delays)} lines: median {statistics.median(delays) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms (watch wakes on arrival; a notebook's view sends every 100 ms)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
