"""Per-call round trip of a persistent session next to its peers, and how long an interrupt takes.

On 2 CPU ranks that have imported torch and joined a gloo group, one call of each kind after
another: a trivial call, a call whose value is pulled back (a 1,000-element list), a call
with one 4-byte all_reduce and one with a 1 MiB all_reduce. The same calls on the peers, in
the same run, rounds alternated: two Ray actors (each in a gloo group with the other,
``ray.get`` of both) and two ipyparallel engines (a ``DirectView`` over both), each skipped
with a reason where it is not installed. Medians and the 99th percentile over ``calls``; "steady"
leaves out each round's first call (the first after the other peers' rounds, a wake-up from
idle), which is measured on its own: a trivial call after 0.3 s without calls, as a person's
cells come (every peer here is slower then: idle cores and processes wake). Beside them, the
machine's floor for a trivial call: a byte over plain pipes to two processes that imported
torch and one back from each ("pipes (floor)"). And what a trivial call costs the cores: the
CPU seconds each of the session's processes spends per call, next to the call's wall time.

Every launch starts the next warm process, which imports torch for a few seconds on the same
cores; the figures are taken after it settled, as a person's calls come seconds after the
session started. Then the time from ``cancel()`` (what the notebook's stop button does) to
the call's end for a call sleeping in Python (the session lives on), and for a rank stuck in
a barrier (the session is lost after ``interrupt_grace``, its ranks stopped).

Usage: python benchmarks/session_cells.py [calls per kind and peer] [alone]   (pip install ray ipyparallel)
("alone": nbshard's session only, without the peers' processes sharing the cores)
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import nbshard

SETTLE = 8.0  # seconds for the next warm process to finish importing torch


def trivial() -> int:
    return 1


def pulled() -> list[float]:
    return [float(i) for i in range(1000)]


def init(port: int | None = None, rank: int | None = None) -> None:
    import torch.distributed as dist

    if port is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def all_reduce(numel: int) -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(numel)
    dist.all_reduce(value)
    return float(value[0])


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


PAUSED = "after a 0.3 s pause"
KINDS: dict[str, tuple[Callable[..., object], tuple[object, ...]]] = {
    "trivial": (trivial, ()),
    "value pulled": (pulled, ()),
    "all_reduce 4 B": (all_reduce, (1,)),
    "all_reduce 1 MiB": (all_reduce, (1 << 18,)),
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class NbshardSession:
    name = "nbshard session"

    def __init__(self) -> None:
        self.session = nbshard.session("bench", nproc=2, interrupt_grace=5)
        self.session.run(init)
        self.warm = self.session.warm

    def call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        self.session.submit(fn, *args).result()

    def close(self) -> None:
        self.session.close()


class RayActors:
    name = "Ray actors"

    def __init__(self) -> None:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, address="local")

        @ray.remote
        class Rank:
            def run(self, fn: Callable[..., object], args: tuple[object, ...]) -> object:
                return fn(*args)

        self.ray = ray
        self.actors = [Rank.remote() for _ in range(2)]
        port = free_port()
        ray.get([actor.run.remote(init, (port, rank)) for rank, actor in enumerate(self.actors)])

    def call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        self.ray.get([actor.run.remote(fn, args) for actor in self.actors])

    def close(self) -> None:
        self.ray.shutdown()


class IpyparallelEngines:
    name = "ipyparallel engines"

    def __init__(self) -> None:
        import ipyparallel

        self.cluster = ipyparallel.Cluster(n=2, log_level=40)
        self.client = self.cluster.start_and_connect_sync()
        self.client.wait_for_engines(2, timeout=120)
        self.view = self.client[:]
        self.view.block = True
        port = free_port()
        self.view.map(init, [port, port], [0, 1])

    def call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        self.view.apply_sync(fn, *args)

    def close(self) -> None:
        self.client.close()
        self.cluster.stop_cluster_sync()


class PipesFloor:
    """The machine's floor for a trivial call: one byte over plain pipes to two child processes
    that imported torch, and one back from each; no function, no pickling, no bookkeeping."""

    name = "pipes (floor)"
    kinds = ("trivial", PAUSED)

    def __init__(self) -> None:
        # a rank's memory and libraries, as in every peer; then a byte back for each byte
        child = "import os, torch\nwhile os.read(0, 1):\n    os.write(1, b'k')"
        self.children = [subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                         for _ in range(2)]
        self.call(trivial, ())  # each has imported torch

    def call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        for child in self.children:
            os.write(child.stdin.fileno(), b"x")  # type: ignore[union-attr]
        for child in self.children:
            os.read(child.stdout.fileno(), 1)  # type: ignore[union-attr]

    def close(self) -> None:
        for child in self.children:
            child.stdin.close()  # type: ignore[union-attr]
            child.wait(10)
            child.stdout.close()  # type: ignore[union-attr]


def stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name: the state is field 0, the parent 1, user and
    system CPU ticks 11 and 12."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float:
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_call(session: nbshard.Session, calls: int = 1000) -> dict[str, float]:
    """Seconds of CPU each of a session's processes spends per trivial call (this process, which
    calls; the launcher; its ranks), with the wall time of a call: what a call costs the cores."""
    children = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent_of(int(pid)) == session.pid]
    processes = {"caller": os.getpid(), "launcher": session.pid, **{f"rank process {i}": pid for i, pid in enumerate(children)}}
    before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    started = time.perf_counter()
    for _ in range(calls):
        session.submit(trivial).result()
    spent = {name: (cpu_seconds(pid) - before[name]) / calls for name, pid in processes.items()}
    return {**spent, "wall": (time.perf_counter() - started) / calls}


def _parent_of(pid: int) -> int | None:
    try:
        return int(stat_fields(pid)[1])
    except (OSError, IndexError, ValueError):  # gone meanwhile
        return None


def start_peers(alone: bool) -> list[object]:
    peers: list[object] = [NbshardSession(), PipesFloor()]
    for peer in () if alone else (RayActors, IpyparallelEngines):
        try:
            peers.append(peer())
        except ImportError as error:
            print(f"  {peer.name}: skipped ({error}; pip install ray ipyparallel)")
    return peers


def runs(peer: object, kind: str) -> bool:
    return kind in getattr(peer, "kinds", (*KINDS, PAUSED))


def timed(peer: object, fn: Callable[..., object], args: tuple[object, ...]) -> float:
    started = time.perf_counter()
    peer.call(fn, args)  # type: ignore[attr-defined]
    return time.perf_counter() - started


def time_to_interrupt(session: nbshard.Session, fn: Callable[[], None], marker: str) -> tuple[float, str]:
    handle = session.submit(fn)
    while sum(handle.logs(rank).count(marker) for rank in range(2)) < 2:
        time.sleep(0.01)
    time.sleep(0.3)
    started = time.perf_counter()
    handle.cancel()
    return time.perf_counter() - started, type(handle.exception()).__name__


PAUSE = 0.3  # seconds without calls before each "after a pause" call
PAUSED_CALLS = 30  # per peer


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(int(q * len(values)), len(values) - 1)]


def fixed_work() -> int:
    """The same small piece of Python every time (about 40 us on a busy core here)."""
    text = json.dumps({"values": list(range(200))})
    return sum(len(str(i)) for i in range(300)) + len(text)


def cold_factor(rounds: int = 20) -> float:
    """How much slower this machine runs ``fixed_work`` right after ``PAUSE`` s of sleep than
    again at once: what every process a call passes through pays after a pause (caches, and on
    a virtual machine its idle vCPU, cold). Measured in this process, without any peer's calls."""
    after_pause, at_once = [], []
    for _ in range(rounds):
        time.sleep(PAUSE)
        for times in (after_pause, at_once):
            started = time.perf_counter()
            fixed_work()
            times.append(time.perf_counter() - started)
    return statistics.median(after_pause) / statistics.median(at_once)


def main(calls: int, alone: bool) -> None:
    print(f"{os.cpu_count()} CPUs; {calls} calls of each kind per peer, in rounds of 10, peers alternated; "
          f"then {PAUSED_CALLS} trivial calls per peer, each after {PAUSE:g} s without calls")
    print(f"this machine runs a fixed piece of Python {cold_factor():.1f}x slower {PAUSE:g} s after sleeping than right after it ran")
    peers = start_peers(alone)
    kinds = [*KINDS, PAUSED]
    times = {(peer.name, kind): [] for peer in peers for kind in kinds}  # type: ignore[attr-defined]
    steady = {(peer.name, kind): [] for peer in peers for kind in KINDS}  # type: ignore[attr-defined]
    for peer in peers:  # warm-up
        for kind, (fn, args) in KINDS.items():
            for _ in range(5 if runs(peer, kind) else 0):
                timed(peer, fn, args)
    time.sleep(SETTLE)
    for _ in range(max(1, calls // 10)):
        for peer in peers:
            for kind, (fn, args) in KINDS.items():
                if not runs(peer, kind):
                    continue
                round_times = [timed(peer, fn, args) for _ in range(10)]
                times[peer.name, kind] += round_times  # type: ignore[attr-defined]
                steady[peer.name, kind] += round_times[1:]  # type: ignore[attr-defined]
    for _ in range(PAUSED_CALLS):
        for peer in peers:
            time.sleep(PAUSE)
            times[peer.name, PAUSED].append(timed(peer, trivial, ()))  # type: ignore[attr-defined]
    ours = peers[0]
    print(f"2 CPU ranks, each in a gloo group; nbshard warm start: {ours.warm}")  # type: ignore[attr-defined]
    for kind in kinds:
        base = statistics.median(times[ours.name, kind])  # type: ignore[attr-defined]
        for peer in (peer for peer in peers if runs(peer, kind)):
            values = times[peer.name, kind]  # type: ignore[attr-defined]
            median = statistics.median(values)
            ratio = "" if peer is ours else f"   nbshard/peer {base / median:4.2f}"
            still = steady.get((peer.name, kind))  # type: ignore[attr-defined]
            steady_p99 = f" (steady {quantile(still, 0.99) * 1e3:5.2f})" if still else " " * 16
            print(f"  {kind:17s} {peer.name:20s} median {median * 1e3:6.2f} ms   "  # type: ignore[attr-defined]
                  f"p99 {quantile(values, 0.99) * 1e3:6.2f} ms{steady_p99}{ratio}")
    session = ours.session  # type: ignore[attr-defined]
    spent = cpu_per_call(session)
    wall = spent.pop("wall")
    by_process = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in spent.items())
    print(f"  CPU per trivial call, by process (the other peers idle): {by_process}; "
          f"{sum(spent.values()) * 1e3:.2f} ms in all, in {wall * 1e3:.2f} ms of wall time on {os.cpu_count()} CPUs")
    for peer in peers[1:]:
        peer.close()  # type: ignore[attr-defined]
    seconds, raised = time_to_interrupt(session, sleep_in_python, "sleeping")
    print(f"  interrupt, a call sleeping in Python: ended after {seconds:.3f} s ({raised}; session {session.state})")
    seconds, raised = time_to_interrupt(session, stuck_on_rank_0, "waiting")
    print(f"  interrupt, rank 0 stuck in a barrier (interrupt_grace 5 s): ended after {seconds:.3f} s ({raised}; session {session.state})")
    session.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300, "alone" in sys.argv[2:])
