"""Live output from 2 ranks next to its peers: lines per second shown, none lost, and the delay
from a rank's print to the line being shown (median and 99th percentile).

Three ways, rounds alternated, each rank importing torch first as every real job does:
nbshard (``handle.watch()`` in this process), plain pipes (2 processes whose stdout this
process reads with a selector: the floor any launcher builds on), and torchrun (its 2 ranks
write to torchrun's stdout, which this process reads). A flood is 100,000 lines per rank
written as fast as Python can; lines/s counts from the first line shown to the last. The
delay is over 300 timestamped lines per rank, 10 ms apart.

Usage: python benchmarks/streaming.py [lines per rank] [rounds]
"""

from __future__ import annotations

import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nbshard

RANK_CODE = """
import os, sys, time
import torch  # noqa: F401 - as every real job does
rank, kind, count = os.environ["RANK"], sys.argv[1], int(sys.argv[2])
if kind == "flood":
    for index in range(count):
        sys.stdout.write(f"{rank} {index}\\n")
    sys.stdout.flush()
else:
    for _ in range(count):
        print(f"stamp {time.time():.6f}", flush=True)
        time.sleep(0.01)
"""


def flood(count: int) -> int:
    import os
    import sys

    import torch  # noqa: F401

    rank = os.environ["RANK"]
    for index in range(count):
        sys.stdout.write(f"{rank} {index}\n")
    sys.stdout.flush()
    return count


def timestamps(count: int, pause: float) -> int:
    import time

    import torch  # noqa: F401

    for _ in range(count):
        print(f"stamp {time.time():.6f}", flush=True)
        time.sleep(pause)
    return count


class Recorder:
    """A stream for handle.watch() that notes when each line reaches it (as the pipes' reader does)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._partial = ""

    def write(self, text: str) -> None:
        now = time.time()
        *done, self._partial = (self._partial + text).split("\n")
        self.lines.extend((now, line) for line in done)

    def flush(self) -> None:
        pass


def with_nbshard(kind: str, count: int) -> list[tuple[float, str]]:
    recorder = Recorder()
    handle = nbshard.submit(flood, count, nproc=2) if kind == "flood" else nbshard.submit(timestamps, count, 0.01, nproc=2)
    handle.watch(recorder)
    handle.result()
    return [(t, line.split("]: ", 1)[1]) for t, line in recorder.lines if line.startswith("[rank")]


def read_pipes(commands: list[tuple[list[str], dict[str, str]]]) -> list[tuple[float, str]]:
    """Start each command with its stdout on a pipe; every line, when this process read it."""
    selector = selectors.DefaultSelector()
    procs, partial, lines = [], {}, []
    for argv, env in commands:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env={**os.environ, **env})
        procs.append(proc)
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ)
        partial[proc.stdout.fileno()] = b""
    open_pipes = len(procs)
    while open_pipes:
        for key, _ in selector.select():
            data = os.read(key.fd, 1 << 16)
            now = time.time()
            if not data:
                selector.unregister(key.fileobj)
                open_pipes -= 1
                continue
            *done, partial[key.fd] = (partial[key.fd] + data).split(b"\n")
            lines.extend((now, line.decode()) for line in done)
    for proc in procs:
        proc.wait()
    return lines


def with_pipes(script: Path, kind: str, count: int) -> list[tuple[float, str]]:
    return read_pipes([([sys.executable, str(script), kind, str(count)], {"RANK": str(rank)}) for rank in (0, 1)])


def with_torchrun(script: Path, kind: str, count: int) -> list[tuple[float, str]]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", "0", str(script), kind, str(count)]
    return [(t, line) for t, line in read_pipes([(argv, {"OMP_NUM_THREADS": "1"})]) if line[:1] in "01s"]


def lines_per_second(lines: list[tuple[float, str]], count: int) -> tuple[float, bool]:
    per_rank = {r: [line.split()[1] for _, line in lines if line.startswith(f"{r} ")] for r in "01"}
    complete = all(per_rank[r] == [str(i) for i in range(count)] for r in "01")
    return len(lines) / (lines[-1][0] - lines[0][0]), complete


def delays(lines: list[tuple[float, str]]) -> list[float]:
    return sorted(t - float(line.split()[-1]) for t, line in lines if line.startswith("stamp"))


def main(count: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "rank.py"
        script.write_text(RANK_CODE)
        ways: dict[str, Callable[[str, int], list[tuple[float, str]]]] = {
            "nbshard": with_nbshard,
            "plain pipes": lambda kind, n: with_pipes(script, kind, n),
            "torchrun": lambda kind, n: with_torchrun(script, kind, n),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        waits: dict[str, list[float]] = {name: [] for name in ways}
        complete = {name: True for name in ways}
        for _ in range(rounds):
            for name, way in ways.items():
                rate, whole = lines_per_second(way("flood", count), count)
                rates[name].append(rate)
                complete[name] &= whole
                waits[name] += delays(way("stamps", 300))
    print(f"{2 * count:,} lines from 2 ranks (each imports torch), {rounds} rounds alternated; medians:")
    pipes = statistics.median(rates["plain pipes"])
    for name in ways:
        rate, lag = statistics.median(rates[name]), waits[name]
        print(f"  {name:12s} {rate:>9,.0f} lines/s ({rate / pipes:.2f} of plain pipes), complete and in order: "
              f"{complete[name]}; print-to-shown delay median {statistics.median(lag) * 1e3:.2f} ms, "
              f"p99 {lag[min(len(lag) - 1, int(0.99 * len(lag)))] * 1e3:.2f} ms")
    print("  (nbshard: watch() in a terminal wakes on each arrival; a notebook's view sends every 100 ms)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
