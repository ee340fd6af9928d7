"""Wall time of a trivial 2-rank gloo job, launched four ways, alternating in one run.

The job is what every real job starts with: ``import torch`` (and, in the second
set, ``import lightning``), ``init_process_group("gloo")``, a barrier, return.

- torchrun running it as a script;
- accelerate's ``notebook_launcher`` (fork-based) in a process that has imported
  torch (and lightning), as in a notebook;
- ``nbshard.run`` cold (fresh interpreters);
- ``nbshard.run`` warm (forked from the warm process, second and later launches).

Prints medians, ratios to torchrun, the time from the call to the job's first
line, the submit / first line / end breakdown of nbshard's launches, and the warm
process's start-up time and memory.
Usage: python benchmarks/launch_overhead.py [rounds]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbshard

JOB = textwrap.dedent(
    """
    import os, sys, time

    def job(marker_dir, with_lightning):
        import torch
        import torch.distributed as dist
        if with_lightning:
            import lightning
        if not os.path.exists(os.path.join(marker_dir, "first")):  # the job's first line, after its imports
            with open(os.path.join(marker_dir, "first"), "w") as f:
                f.write(repr(time.time()))
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
        return 0

    if __name__ == "__main__":
        job(sys.argv[1], sys.argv[2] == "1")
    """
)

# A notebook stand-in: imports what a notebook would have, then runs notebook_launcher per request.
NOTEBOOK = textwrap.dedent(
    """
    import sys, time, json
    sys.path.insert(0, sys.argv[1])
    import torch
    if sys.argv[2] == "1":
        import lightning
    from accelerate import notebook_launcher
    from bench_job import job
    print("ready", flush=True)
    for line in sys.stdin:
        marker_dir, with_lightning = json.loads(line)
        started = time.time()
        notebook_launcher(job, (marker_dir, with_lightning), num_processes=2)
        print(json.dumps([started, time.time()]), flush=True)
    """
)


def first_line_after(marker_dir: Path, started: float) -> float:
    return float((marker_dir / "first").read_text()) - started


def fresh_marker(root: Path) -> Path:
    marker = Path(tempfile.mkdtemp(dir=root))
    return marker


def time_nbshard(job, root: Path, with_lightning: bool, *, warm: bool) -> dict[str, float]:
    nbshard.settings.warm = warm
    marker = fresh_marker(root)
    started = time.time()
    handle = nbshard.submit(job, str(marker), with_lightning, nproc=2, show_ranks=[], sample_interval=None)
    submitted = time.time()
    handle.result()
    ended = time.time()
    if handle.warm is not warm:
        raise RuntimeError(f"asked for a {'warm' if warm else 'cold'} launch, got the other: {handle.launch_note}")
    return {"total": ended - started, "first line": first_line_after(marker, started), "submit": submitted - started}


def time_torchrun(script: Path, root: Path, with_lightning: bool) -> dict[str, float]:
    marker = fresh_marker(root)
    started = time.time()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(marker), "1" if with_lightning else "0"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return {"total": time.time() - started, "first line": first_line_after(marker, started)}


def time_notebook_launcher(notebook: subprocess.Popen[str], root: Path, with_lightning: bool) -> dict[str, float]:
    marker = fresh_marker(root)
    assert notebook.stdin is not None and notebook.stdout is not None
    notebook.stdin.write(json.dumps([str(marker), with_lightning]) + "\n")
    notebook.stdin.flush()
    while not (line := notebook.stdout.readline()).startswith("["):
        if not line:
            raise RuntimeError("the notebook stand-in for notebook_launcher exited")
    started, ended = json.loads(line)
    return {"total": ended - started, "first line": first_line_after(marker, started)}


def warm_process_figures() -> str:
    while nbshard.warm_status()["state"] == "starting":
        time.sleep(0.1)
    status = nbshard.warm_status()
    if status["state"] != "ready":
        return f"warm process: {status}"
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{status['pid']}/smaps_rollup").read_text().splitlines()[1:])
    rss, pss = (int(fields[k].split()[0]) / 1024 for k in ("Rss", "Pss"))
    return f"warm process: ready {status['seconds']:.2f} s after it started; RSS {rss:.0f} MiB, PSS {pss:.0f} MiB"


def report(title: str, times: dict[str, list[dict[str, float]]]) -> None:
    torchrun = statistics.median(t["total"] for t in times["torchrun"])
    print(title)
    for name, runs in times.items():
        total = [t["total"] for t in runs]
        first = statistics.median(t["first line"] for t in runs)
        median = statistics.median(total)
        extra = f", submit returns {statistics.median(t['submit'] for t in runs) * 1000:.0f} ms" if "submit" in runs[0] else ""
        print(
            f"  {name:18s} median {median:6.3f} s (min {min(total):.3f}, max {max(total):.3f})  "
            f"ratio to torchrun {median / torchrun:.3f}  first line after {first * 1000:5.0f} ms{extra}"
        )


def main(rounds: int = 7) -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        script = root / "bench_job.py"
        script.write_text(JOB)
        sys.path.insert(0, folder)
        from bench_job import job  # type: ignore[import-not-found]

        for with_lightning in (False, True):
            nbshard.settings.preload = ["torch", "lightning"] if with_lightning else ["torch"]
            nbshard.restart_warm()
            notebook = subprocess.Popen(
                [sys.executable, "-c", NOTEBOOK, folder, "1" if with_lightning else "0"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            assert notebook.stdout is not None and notebook.stdout.readline().strip() == "ready"
            print(warm_process_figures())
            time_nbshard(job, root, with_lightning, warm=False)  # warm the page cache for every side
            time_torchrun(script, root, with_lightning)
            times: dict[str, list[dict[str, float]]] = {"torchrun": [], "notebook_launcher": [], "nbshard cold": [], "nbshard warm": []}
            for _ in range(rounds):
                times["torchrun"].append(time_torchrun(script, root, with_lightning))
                times["notebook_launcher"].append(time_notebook_launcher(notebook, root, with_lightning))
                times["nbshard cold"].append(time_nbshard(job, root, with_lightning, warm=False))
                times["nbshard warm"].append(time_nbshard(job, root, with_lightning, warm=True))
            notebook.stdin.close()  # type: ignore[union-attr]
            notebook.wait(30)
            what = "import torch + import lightning" if with_lightning else "import torch"
            report(f"{rounds} rounds, alternating; 2 CPU ranks: {what}, init_process_group(gloo), barrier", times)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
