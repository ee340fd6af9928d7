"""What ``profile=True`` costs a training step: the same 2-rank DDP job with and without it.

Each job trains a small MLP (4 x ``Linear(512, 512)``, batch 64, DDP over gloo) for ``steps``
steps and returns rank 0's step times; the first 5 are warm-up and not counted. Jobs with and
without profiling alternate, ``rounds`` of each; the median step of each job, then the median
over rounds and their ratio. Also the size of the traces a profiled job leaves.

Usage: python benchmarks/profile_overhead.py [rounds] [steps]
"""

from __future__ import annotations

import statistics
import sys

import nbshard


def train(steps: int) -> list[float]:
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(64, 512)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return times[5:]


def main(rounds: int, steps: int) -> None:
    step_medians: dict[bool, list[float]] = {False: [], True: []}
    trace_bytes = []
    for _ in range(rounds):
        for profile in (False, True):
            handle = nbshard.submit(train, steps, nproc=2, profile=profile)
            step_medians[profile].append(statistics.median(handle.result()))
            if profile:
                trace_bytes.append(sum(path.stat().st_size for path in handle.profile().traces.values()))
    off, on = statistics.median(step_medians[False]), statistics.median(step_medians[True])
    print(f"2 CPU ranks, DDP over gloo, {steps} steps a job ({steps - 5} timed), {rounds} rounds alternated:")
    print(f"  without profile: median step {off * 1e3:.2f} ms (rounds {', '.join(f'{t * 1e3:.2f}' for t in step_medians[False])})")
    print(f"  profile=True:    median step {on * 1e3:.2f} ms (rounds {', '.join(f'{t * 1e3:.2f}' for t in step_medians[True])})")
    print(f"  ratio {on / off:.3f}; traces of both ranks {statistics.median(trace_bytes) / 2**20:.1f} MiB a job")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, int(sys.argv[2]) if len(sys.argv) > 2 else 105)
