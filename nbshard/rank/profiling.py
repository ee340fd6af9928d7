"""``profile=True``: the job's call under ``torch.profiler`` in each rank, its trace and a summary.

The trace is Chrome's trace format (``profile/rank-N.pt.trace.json`` in the run directory),
which Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin open; the summary
(``profile-N.json``) holds the operators with the most self time and how the rank's time
splits between communication (collectives, sends and receives) and everything else, for the
kernel to show without loading the trace.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from nbshard.files import mkdir_private, write_json
from nbshard.run_dir import RunDir

__all__ = ["COMMUNICATION", "TOP_OPS", "profiled"]

TOP_OPS = 15
# Operators that move data between ranks: c10d's collectives and point-to-point ops, and what
# gloo and NCCL name their own kernels and work.
COMMUNICATION = re.compile(
    r"c10d|nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|all_to_all|alltoall|broadcast|barrier|"
    r"_?send|_?recv|record_param_comms",
    re.IGNORECASE,
)


def profiled(run_dir: RunDir, rank: int, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` run under the profiler; the trace and summary are written when it ends, also
    when it raised (what ran until then is what a failed step's profile shows)."""

    def run(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        profiler = profile(activities=activities)
        with _kineto_quiet():
            profiler.start()
        try:
            return call(fn, args, kwargs)
        finally:
            with _kineto_quiet():
                profiler.stop()
            try:
                _write(run_dir, rank, profiler)
            except Exception as error:  # noqa: BLE001 - a profile that cannot be written never fails the job
                print(f"nbshard: the profile of rank {rank} could not be written: {error!r}", file=sys.stderr)

    return run


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Kineto (the profiler's backend) writes a line to stderr at each start and stop, whatever
    its log level: the rank's stderr goes to /dev/null for those two calls alone."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _write(run_dir: RunDir, rank: int, profiler: Any) -> None:
    trace = run_dir.path / "profile" / f"rank-{rank}.pt.trace.json"
    mkdir_private(trace.parent, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    write_json(run_dir.profile(rank), summary(rank, profiler.key_averages(), str(trace)))


def _device_self_us(event: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):  # torch renamed it
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def summary(rank: int, averages: Any, trace: str) -> dict[str, Any]:
    """The operators with the most self time (CPU plus device), and the communication share."""
    ops = [
        {"name": event.key, "count": int(event.count), "self_us": float(event.self_cpu_time_total),
         "total_us": float(event.cpu_time_total), "device_self_us": _device_self_us(event)}
        for event in averages
    ]
    ops.sort(key=lambda op: op["self_us"] + op["device_self_us"], reverse=True)
    total = sum(op["self_us"] + op["device_self_us"] for op in ops)
    communication = sum(op["self_us"] + op["device_self_us"] for op in ops if COMMUNICATION.search(op["name"]))
    return {"rank": rank, "trace": trace, "self_us": total, "communication_us": communication, "ops": ops[:TOP_OPS]}
