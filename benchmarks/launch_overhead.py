"""Wall time of a trivial 2-rank job: nbshard.run against torchrun running the same function.

Alternates the two, several rounds, and prints medians and their ratio.
Usage: python benchmarks/launch_overhead.py [rounds]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import nbshard

SCRIPT = textwrap.dedent(
    """
    import os

    def trivial():
        return int(os.environ["RANK"])

    if __name__ == "__main__":
        trivial()
    """
)


def trivial() -> int:
    return int(os.environ["RANK"])


def time_nbshard() -> float:
    started = time.perf_counter()
    nbshard.run(trivial, nproc=2, show_ranks=[])
    return time.perf_counter() - started


def time_torchrun(script: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - started


def time_bare_popen() -> float:
    """Two interpreters started and awaited: the floor any launcher stands on."""
    started = time.perf_counter()
    ranks = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for rank in ranks:
        rank.wait()
    return time.perf_counter() - started


def main(rounds: int = 7) -> None:
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "trivial.py")
        with open(script, "w") as file:
            file.write(SCRIPT)
        time_nbshard()  # warm the page cache for both sides
        time_torchrun(script)
        times: dict[str, list[float]] = {"nbshard.run": [], "torchrun": [], "two bare Popen": []}
        for _ in range(rounds):
            times["nbshard.run"].append(time_nbshard())
            times["torchrun"].append(time_torchrun(script))
            times["two bare Popen"].append(time_bare_popen())
    torchrun = statistics.median(times["torchrun"])
    print(f"{rounds} rounds, alternating; trivial function on 2 CPU ranks")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:15s} median {median:6.3f} s  (min {min(values):.3f}, max {max(values):.3f})  ratio to torchrun {median / torchrun:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
