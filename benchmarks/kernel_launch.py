"""A warm launch from a real Jupyter kernel, beside accelerate's ``notebook_launcher`` there.

One IPython kernel per set (started with jupyter_client, as a notebook's frontend starts
it) imports torch (and lightning), accelerate and nbshard, and defines the job in a cell:
``init_process_group("gloo")``, a barrier, return. Then, rounds alternated, a cell times
``nbshard.run(job, nproc=2)`` (warm: the launcher and ranks forked from the warm process,
with the cell's live view, as a person runs it) and a cell times
``notebook_launcher(job, num_processes=2)`` (forked from the kernel itself), each from the
call to its return, inside the kernel. Prints medians and the ratio.
Usage: python benchmarks/kernel_launch.py [rounds]
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
import textwrap
import time

from jupyter_client.manager import KernelManager

SETUP = textwrap.dedent(
    """
    import json, time
    import torch
    {import_lightning}
    from accelerate import notebook_launcher
    import nbshard
    nbshard.settings.preload = {preload!r}

    def job():
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    """
)

CELLS = {
    "nbshard.run warm": textwrap.dedent(
        """
        started = time.perf_counter()
        handle = nbshard.submit(job, nproc=2)
        handle.watch()
        handle.result()
        print("TIMED", json.dumps([time.perf_counter() - started, handle.warm]))
        """
    ),
    "notebook_launcher": textwrap.dedent(
        """
        started = time.perf_counter()
        notebook_launcher(job, num_processes=2)
        print("TIMED", json.dumps([time.perf_counter() - started, True]))
        """
    ),
}

WAIT_FOR_WARM = textwrap.dedent(
    """
    nbshard.run(job, nproc=2)  # the first launch is cold and starts the warm process
    while nbshard.warm_status()["state"] == "starting":
        time.sleep(0.1)
    print("TIMED", json.dumps([nbshard.warm_status()["state"] == "ready", True]))
    """
)


# Between timed cells, as between a person's cells: what either launcher does after a launch
# (nbshard forks its next spare launcher) settles instead of landing in the other's time.
PAUSE = 0.3


def execute(client, code: str, timeout: float = 300) -> list:
    """Run one cell; the values it printed after ``TIMED``. Raises on the cell's error."""
    printed: list[str] = []

    def hook(message: dict) -> None:
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            raise RuntimeError("a cell failed:\n" + "\n".join(message["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"a cell ended with {reply['content']['status']}: {''.join(printed)}")
    timed = [line for line in "".join(printed).splitlines() if line.startswith("TIMED ")]
    return json.loads(timed[-1].removeprefix("TIMED ")) if timed else []


def measure(with_lightning: bool, rounds: int) -> dict[str, list[float]]:
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=tempfile.gettempdir())
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        preload = ["torch", "lightning"] if with_lightning else ["torch"]
        execute(client, SETUP.format(import_lightning="import lightning" if with_lightning else "", preload=preload))
        if not execute(client, WAIT_FOR_WARM)[0]:
            raise RuntimeError("the warm process did not start: nbshard.warm_status() says why")
        for code in CELLS.values():  # once each before timing: the page cache, accelerate's first fork
            execute(client, code)
        times: dict[str, list[float]] = {name: [] for name in CELLS}
        for _ in range(rounds):
            for name, code in CELLS.items():
                time.sleep(PAUSE)
                seconds, warm = execute(client, code)
                if not warm:
                    raise RuntimeError("nbshard's launch was cold: the warm process was not ready")
                times[name].append(seconds)
        return times
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


def main(rounds: int = 5) -> None:
    if importlib.util.find_spec("accelerate") is None:
        print("skipped: the peer, accelerate's notebook_launcher, is not installed (pip install -e '.[bench]')")
        return
    for with_lightning in (False, True):
        times = measure(with_lightning, rounds)
        medians = {name: statistics.median(values) for name, values in times.items()}
        what = "import torch + import lightning (preload both)" if with_lightning else "import torch"
        print(f"{rounds} rounds, alternating, in a real IPython kernel; 2 CPU ranks; the kernel did {what}")
        for name, values in times.items():
            print(f"  {name:18s} median {medians[name]:.3f} s (min {min(values):.3f}, max {max(values):.3f}; "
                  f"rounds {', '.join(f'{value:.3f}' for value in values)})")
        print(f"  nbshard / notebook_launcher: {medians['nbshard.run warm'] / medians['notebook_launcher']:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
