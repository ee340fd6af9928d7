"""Session calls from a real Jupyter kernel, as a person's cells make them, beside Ray's actors there.

One IPython kernel (jupyter_client, as a notebook's frontend starts it) defines the functions in a
cell (so they travel by value, with their cell's source, as a notebook's do), starts a session of
2 CPU ranks in a gloo group and, where Ray is installed, two Ray actors in a gloo group of their
own. Then, in rounds of 10 alternated between them, 300 trivial calls each way: ``session.run``
(what a cell gets: the call with its live view in the cell), ``session.submit(...).result()``
(no view) and ``ray.get`` of both actors; then 30 of each after 0.3 s without calls. Times are
taken inside the kernel, from the call to its value. Also counts the kernel's full garbage
collections during the timed calls (each pauses the kernel's whole heap, IPython's included).
Usage: python benchmarks/session_in_kernel.py [calls per way]
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import textwrap

from jupyter_client.manager import KernelManager

from kernel_launch import execute

SETUP = textwrap.dedent(
    """
    import gc, json, socket, statistics, time
    import nbshard

    def trivial():
        return 1

    def init(port=None, rank=None):
        import torch.distributed as dist
        if port is None:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    session = nbshard.session("bench", nproc=2)
    session.run(init)
    ways = {
        "nbshard session.run (with its view)": lambda: session.run(trivial),
        "nbshard submit().result()": lambda: session.submit(trivial).result(),
    }
    if WITH_RAY:
        import ray
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, address="local")

        @ray.remote
        class Rank:
            def run(self, fn, args):
                return fn(*args)

        actors = [Rank.remote() for _ in range(2)]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        ray.get([actor.run.remote(init, (port, rank)) for rank, actor in enumerate(actors)])
        ways["Ray actors ray.get"] = lambda: ray.get([actor.run.remote(trivial, ()) for actor in actors])
    times = {name: [] for name in ways}
    paused = {name: [] for name in ways}
    full_collections = []
    gc.callbacks.append(lambda phase, info: full_collections.append(1) if phase == "stop" and info["generation"] == 2 else None)

    def timed(call):
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    for call in ways.values():  # warm-up
        for _ in range(10):
            call()
    time.sleep(8)  # the next warm process imports torch on the same cores
    full_collections.clear()
    print("TIMED", json.dumps(list(ways)))
    """
)

ROUND = textwrap.dedent(
    """
    for name, call in ways.items():
        times[name] += [timed(call) for _ in range(10)]
    """
)

PAUSED = textwrap.dedent(
    """
    for name, call in ways.items():
        time.sleep(0.3)
        paused[name].append(timed(call))
    """
)

REPORT = textwrap.dedent(
    """
    def quantile(values, q):
        return sorted(values)[min(int(q * len(values)), len(values) - 1)]
    print("TIMED", json.dumps({
        "calls": {name: [statistics.median(v), quantile(v, 0.99)] for name, v in times.items()},
        "paused": {name: [statistics.median(v), quantile(v, 0.9)] for name, v in paused.items()},
        "full_collections": len(full_collections),
    }))
    session.close()
    if WITH_RAY:
        ray.shutdown()
    """
)


def main(calls: int) -> None:
    with_ray = importlib.util.find_spec("ray") is not None
    if not with_ray:
        print("  Ray actors: skipped (not installed; pip install -e '.[bench]')")
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=tempfile.gettempdir())
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        execute(client, SETUP.replace("WITH_RAY", str(with_ray)), timeout=600)
        for _ in range(max(1, calls // 10)):
            execute(client, ROUND)
        for _ in range(30):
            execute(client, PAUSED)
        report = execute(client, REPORT.replace("WITH_RAY", str(with_ray)))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    print(f"in a real IPython kernel; 2 CPU ranks in a gloo group; {calls} trivial calls per way in rounds of 10, "
          f"alternated; then 30 each after 0.3 s without calls. Times in ms, from the call to its value.")
    ray = report["calls"].get("Ray actors ray.get")
    for name, (median, p99) in report["calls"].items():
        ratio = f"   / Ray {median / ray[0]:4.2f}" if ray and not name.startswith("Ray") else ""
        print(f"  {name:36s} median {median * 1e3:5.2f}   p99 {p99 * 1e3:6.2f}{ratio}")
    ray = report["paused"].get("Ray actors ray.get")
    for name, (median, p90) in report["paused"].items():
        ratio = f"   / Ray {median / ray[0]:4.2f}" if ray and not name.startswith("Ray") else ""
        print(f"  after a 0.3 s pause: {name:36s} median {median * 1e3:5.2f}   p90 {p90 * 1e3:6.2f}{ratio}")
    print(f"  the kernel's full garbage collections during the timed calls: {report['full_collections']}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
