"""Per-call round trip of a persistent session, and how long an interrupt takes to end a call.

On 2 CPU ranks (gloo), in one session, alternating: a trivial call, a call whose value is
pulled back (a 1,000-element list), and a call with one all_reduce; medians and p90 over
``calls`` of each. Then the time from ``cancel()`` (what the notebook's stop button does) to
the call's end for a call sleeping in Python (the session lives on), and for a rank stuck in
a barrier (the session is lost after ``interrupt_grace``, its ranks stopped).
Usage: python benchmarks/session_cells.py [calls]
"""

from __future__ import annotations

import statistics
import sys
import time

import nbshard


def trivial() -> int:
    return 1


def pulled() -> list[float]:
    return [float(i) for i in range(1000)]


def init() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")


def one_all_reduce() -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value)


def sleep_in_python() -> None:
    print("sleeping", flush=True)
    time.sleep(60)


def stuck_on_rank_0() -> None:
    import os

    import torch.distributed as dist

    print("waiting", flush=True)
    if os.environ["RANK"] == "0":
        dist.barrier()
    time.sleep(60)


def timed_call(session: nbshard.Session, fn) -> float:
    started = time.perf_counter()
    handle = session.submit(fn)
    handle.result()
    return time.perf_counter() - started


def time_to_interrupt(session: nbshard.Session, fn, marker: str) -> tuple[float, str]:
    handle = session.submit(fn)
    while sum(handle.logs(rank).count(marker) for rank in range(2)) < 2:
        time.sleep(0.01)
    time.sleep(0.3)
    started = time.perf_counter()
    handle.cancel()
    return time.perf_counter() - started, type(handle.exception()).__name__


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(int(q * len(values)), len(values) - 1)]


def main(calls: int) -> None:
    session = nbshard.session("bench", nproc=2, interrupt_grace=5)
    session.run(init)
    kinds = {"trivial": trivial, "value pulled": pulled, "one all_reduce": one_all_reduce}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(5):  # warm-up
        for fn in kinds.values():
            timed_call(session, fn)
    for _ in range(calls):
        for name, fn in kinds.items():
            times[name].append(timed_call(session, fn))
    print(f"{calls} calls of each, alternating; 2 CPU ranks; warm start: {session.warm}")
    for name, values in times.items():
        print(f"  {name:16s} median {statistics.median(values) * 1000:6.2f} ms   p90 {quantile(values, 0.9) * 1000:6.2f} ms")
    seconds, raised = time_to_interrupt(session, sleep_in_python, "sleeping")
    print(f"  interrupt, a call sleeping in Python: ended after {seconds:.3f} s ({raised}; session {session.state})")
    seconds, raised = time_to_interrupt(session, stuck_on_rank_0, "waiting")
    print(f"  interrupt, rank 0 stuck in a barrier (interrupt_grace 5 s): ended after {seconds:.3f} s ({raised}; session {session.state})")
    session.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
