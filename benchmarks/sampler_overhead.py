"""Cost of the per-rank memory sampler, against a training step.

Runs the same 2-rank CPU training loop with sampling every second (the
default), every 0.1 s, and off, alternating, several rounds; prints the
median step time of each and the ratios. Also times one sample in-process.
Usage: python benchmarks/sampler_overhead.py [rounds]
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

import nbshard
from nbshard.rank.memory_sample import sample_memory


def step_times(steps: int, width: int) -> float:
    """Median seconds per training step in this rank."""
    import statistics
    import time

    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(rounds: int = 5) -> None:
    settings = {"every 1 s": 1.0, "every 0.1 s": 0.1, "off": None}
    medians: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, interval in settings.items():  # alternating, so drift hits each setting alike
            per_rank = nbshard.run(step_times, 300, 512, nproc=2, return_all=True, sample_interval=interval)
            medians[name].append(statistics.median(per_rank))
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}")
    print(f"{rounds} rounds of 2 ranks x 300 steps (4 x Linear(512, 512), batch 64, CPU)")
    off = statistics.median(medians["off"])
    for name, values in medians.items():
        median = statistics.median(values)
        print(
            f"  sampling {name:12s} median step {median * 1e3:7.3f} ms   ratio to off {median / off:.4f}"
            f"   (rounds {min(values) * 1e3:.3f} to {max(values) * 1e3:.3f} ms)"
        )
    calls = 2000
    started = time.perf_counter()
    for _ in range(calls):
        sample_memory()
    cost = (time.perf_counter() - started) / calls
    print(f"one sample (CPU process): {cost * 1e6:.1f} us = {cost / 1.0:.2e} of each second at the default interval")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
