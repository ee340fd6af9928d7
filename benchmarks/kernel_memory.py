"""What a job costs the notebook kernel's memory: a flood of output lines, and a large result.

Each case runs in a fresh real Jupyter kernel (jupyter_client), so its peak resident memory
(VmHWM) is its own; the figure is the peak's growth over the kernel's baseline after
`import torch, nbshard` and one warm-up job. Also each rank's extra peak while writing a
large result. Rounds alternate the sizes; medians are quoted.

Usage: python benchmarks/kernel_memory.py [rounds]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from kernel import Kernel  # noqa: E402  (the tests' jupyter_client driver)

SETUP = f"import sys\nsys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\nimport torch, nbshard, programs\n"
PEAK = "print(int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]))"


def in_fresh_kernel(code: str) -> tuple[float, str]:
    """(the kernel's peak growth in MiB while ``code`` ran, what ``code`` printed)."""
    with tempfile.TemporaryDirectory() as home:
        kernel = Kernel(Path(home), {"NBSHARD_RUNS_DIR": os.path.join(home, "runs"), "PYTHONPATH": str(REPO)})
        try:
            kernel.execute(SETUP + "nbshard.run(programs.rank_and_value, 1, nproc=2)")
            before = int(kernel.execute(PEAK).stdout)
            said = kernel.execute(code, timeout=600)
            assert said.status == "ok", said.traceback
            after = int(kernel.execute(PEAK).stdout)
            return (after - before) / 1024, said.stdout
        finally:
            kernel.shutdown()


def flood(lines_per_rank: int) -> tuple[float, int]:
    grown, out = in_fresh_kernel(
        f"handle = nbshard.submit(programs.print_lines, {lines_per_rank}, 10, nproc=2)\nhandle.watch()"
    )
    return grown, out.count(":xxxxxxxxxx")


def result(megabytes: int) -> tuple[float, float]:
    grown, out = in_fresh_kernel(
        f"handle = nbshard.submit(programs.big_result, {megabytes}, nproc=1, sample_interval=0.05)\n"
        "tensor, resident = handle.result()\n"
        "print('rank extra', (handle.peak_memory()[0]['cpu_peak_rss'] - resident) / 2**20)"
    )
    return grown, float(out.split("rank extra")[-1])


def main(rounds: int) -> None:
    floods: dict[int, list[tuple[float, int]]] = {200_000: [], 1_000_000: []}
    results: dict[int, list[tuple[float, float]]] = {100: [], 500: [], 1000: []}
    for _ in range(rounds):
        for lines in floods:
            floods[lines].append(flood(lines))
        for megabytes in results:
            results[megabytes].append(result(megabytes))
    print("| lines from 2 ranks | kernel peak growth (median) | lines shown in the cell (median) |\n|---|---|---|")
    for lines, runs in floods.items():
        print(f"| {2 * lines:,} | {statistics.median(g for g, _ in runs):.0f} MiB | {statistics.median(s for _, s in runs):,.0f} |")
    print("\n| result (one tensor) | kernel peak growth / size | rank's extra peak / size |\n|---|---|---|")
    for megabytes, runs in results.items():
        kernel_ratio = statistics.median(g for g, _ in runs) / megabytes
        rank_ratio = statistics.median(r for _, r in runs) / megabytes
        print(f"| {megabytes} MiB | {kernel_ratio:.2f} | {rank_ratio:.2f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
