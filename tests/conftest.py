from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import nbshard

REPO = Path(__file__).resolve().parents[1]


def pythonpath(*first: Path) -> str:
    """PYTHONPATH for a process a test starts: ``first`` ahead of the inherited one, which may
    hold this environment's own packages (e.g. wheels unpacked with ``pip --target``)."""
    return os.pathsep.join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])])


def gpu_count() -> int:
    """GPUs visible here, counted as nbshard counts them: without a CUDA context."""
    from nbshard.kernel.gpus import visible_gpu_count

    return visible_gpu_count(os.environ)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (no /proc/driver/nvidia/gpus)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests kill kernels and nodes on purpose; what those leave in the temp directory (a socket's
    or a warm process's directory) goes as the next nbshard start would take it."""
    from nbshard.leftovers import sweep_temp

    sweep_temp()


def nbshard_processes() -> dict[int, str]:
    """Every live launcher and rank process on this machine, by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and ("nbshard.worker" in cmdline or "nbshard.launcher" in cmdline):
            found[int(entry.name)] = cmdline
    return found


def processes_of(run_dir: Path | str) -> dict[int, str]:
    return {pid: cmd for pid, cmd in nbshard_processes().items() if str(run_dir) in cmd}


def processes_of_run(run_id: str) -> dict[int, str]:
    """The launchers and ranks of a run on every node (each node's directory is named after the run)."""
    return {pid: cmd for pid, cmd in nbshard_processes().items() if run_id in cmd}


def left_after(seconds: float, find: Callable[[], Any]) -> Any:
    """What ``find()`` still finds (processes left) after ``seconds``; empty as soon as it finds nothing."""
    deadline = time.monotonic() + seconds
    while True:
        left = find()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def run_gone_within(run_id: str, seconds: float) -> bool:
    """True once no launcher or rank of the run is left on any node, within ``seconds``."""
    return not left_after(seconds, lambda: processes_of_run(run_id))


def parent_of(pid: int) -> int:
    from nbshard.procfs import stat_fields

    fields = stat_fields(pid)
    assert fields is not None, f"process {pid} is gone"
    return int(fields[1])


def node_launcher(run_id: str, node: int, within: float = 60) -> int:
    """The pid of a node's launcher: the parent of that node's rank, once the rank runs. (A process
    the launcher forks shows the launcher's command line until it execs, so on a busy machine a
    command line alone may name two launchers.)"""
    deadline = time.monotonic() + within
    while True:
        ranks = [pid for pid, cmd in processes_of_run(run_id).items() if "nbshard.worker" in cmd and f"node-{node} " in cmd]
        if len(ranks) == 1:
            return parent_of(ranks[0])
        assert time.monotonic() < deadline, f"node {node}'s rank never ran: {processes_of_run(run_id)}"
        time.sleep(0.05)


def wait_for_ranks(handle: nbshard.JobHandle, count: int, within: float = 60) -> None:
    """Wait until ``count`` rank processes of the job run (on whichever nodes)."""
    deadline = time.monotonic() + within
    while sum("nbshard.worker" in cmd for cmd in processes_of_run(handle.run_dir.name).values()) < count:
        assert time.monotonic() < deadline and not handle.done(), f"the ranks never all started: {handle.exception(0) if handle.done() else ''}"
        time.sleep(0.05)


def wait_until_gone(run_dir: Path | str, within: float) -> dict[int, str]:
    """The processes of ``run_dir`` still alive after ``within`` seconds (empty when all went)."""
    return left_after(within, lambda: processes_of(run_dir))


@pytest.fixture(autouse=True)
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own run directories, and must leave no process behind."""
    path = tmp_path / "runs"
    monkeypatch.setattr(nbshard.settings, "runs_dir", path)
    monkeypatch.setenv("NBSHARD_RUNS_DIR", str(path))  # for kernels and scripts the test starts
    yield path
    left = wait_until_gone(path, within=5.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind by this test: {left}"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Script:
    """A Python program playing the kernel: it imports nbshard and runs jobs.

    A thread reads its output into a queue, so nothing read ahead is ever lost
    between waiting for a line and waiting for the end.
    """

    def __init__(self, tmp_path: Path, source: str) -> None:
        path = tmp_path / "kernel_script.py"
        path.write_text(textwrap.dedent(source))
        env = dict(os.environ, PYTHONPATH=pythonpath(REPO, REPO / "tests"))
        self.process = subprocess.Popen(
            [sys.executable, str(path)], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # A shell runs background jobs with SIGINT ignored, and Python then installs no
            # KeyboardInterrupt handler: give the script the interrupt a terminal would.
            preexec_fn=_default_sigint,
        )
        self.output: list[str] = []  # every line read so far
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next_line(self, deadline: float) -> str | None:
        """The next line, or None at the end of output; AssertionError past ``deadline``."""
        try:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise AssertionError(f"no more output within the time allowed; so far:\n{''.join(self.output)}") from None
        if line is not None:
            self.output.append(line)
        return line

    def wait_for(self, marker: str, timeout: float = 60) -> str:
        """Read output until a line contains ``marker``; returns that line."""
        deadline = time.monotonic() + timeout
        while (line := self._next_line(deadline)) is not None:
            if marker in line:
                return line
        raise AssertionError(f"{marker!r} was never printed; output:\n{''.join(self.output)}")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        """Wait for the exit; returns the exit code and the whole output."""
        deadline = time.monotonic() + timeout
        while self._next_line(deadline) is not None:
            pass
        return self.process.wait(max(deadline - time.monotonic(), 1.0)), "".join(self.output)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=5)


@pytest.fixture
def script(tmp_path: Path):
    started: list[Script] = []

    def start(source: str) -> Script:
        started.append(Script(tmp_path, source))
        return started[-1]

    yield start
    for each in started:
        each.kill()


@pytest.fixture
def kernel(tmp_path: Path, runs_dir: Path):
    """A real IPython kernel (jupyter_client), shut down after the test."""
    from kernel import Kernel

    started = Kernel(tmp_path, {"NBSHARD_RUNS_DIR": str(runs_dir), "PYTHONPATH": pythonpath(REPO)})
    yield started
    started.shutdown()
