"""Warm start: launchers and ranks forked from a warm process that has imported torch.

A warm rank must be indistinguishable from a cold one to user code; a launch that
cannot be warm is cold and says why; the channel to the warm process takes only
this user's requests with the token; nothing outlives the kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import textwrap
from pathlib import Path

import programs
import pytest
from conftest import processes_of, wait_until_gone

import nbshard
from nbshard.backends import warm, warm_launcher

pytestmark = pytest.mark.timeout(300)


def warm_settled(within: float = 120.0) -> dict:
    """The warm process's status once it is no longer starting."""
    deadline = time.monotonic() + within
    while (status := nbshard.warm_status())["state"] == "starting":
        assert time.monotonic() < deadline, "the warm process did not get ready (or fail) in time"
        time.sleep(0.1)
    return status


def warm_ready() -> dict:
    """Start the warm process if there is none, and wait until it takes launches."""
    if nbshard.warm_status()["state"] in ("none", "failed", "exited"):
        nbshard.restart_warm()
    status = warm_settled()
    assert status["state"] == "ready", status
    return status


@pytest.fixture
def warm_on(monkeypatch):
    monkeypatch.setattr(nbshard.settings, "warm", True)
    monkeypatch.setattr(nbshard.settings, "preload", ["torch"])
    return warm_ready()


def run_state(tmp_path: Path, *, warm_start: bool, nproc: int = 2, **options):
    # No sampler thread: the fds a rank holds are then only what it inherited, no race with it.
    handle = nbshard.submit(programs.process_state, nproc=nproc, return_all=True, cwd=str(tmp_path), sample_interval=None, **options)
    states = handle.result(timeout=120)
    assert handle.warm is warm_start, handle.launch_note
    return states


@pytest.mark.parametrize("nproc", [2, 1])  # OMP_NUM_THREADS=1 as torchrun sets it; unset
def test_a_warm_rank_is_indistinguishable_from_a_cold_one(tmp_path, monkeypatch, warm_on, nproc):
    monkeypatch.setattr(nbshard.settings, "warm", False)
    cold = run_state(tmp_path, warm_start=False, nproc=nproc) * (3 - nproc)
    monkeypatch.setattr(nbshard.settings, "warm", True)
    first = run_state(tmp_path, warm_start=True, nproc=nproc) * (3 - nproc)
    second = run_state(tmp_path, warm_start=True, nproc=nproc) * (3 - nproc)
    for rank in range(nproc):
        for key, value in cold[rank].items():
            if key not in ("seed", "random"):
                assert first[rank][key] == value, f"rank {rank}: {key} differs warm vs cold"
    assert cold[0]["ps"].endswith("-m nbshard.worker RUN_DIR")
    assert cold[0]["argv"] == [""]  # as an interactive Python's
    assert cold[0]["cwd"] == str(tmp_path) and str(tmp_path) in cold[0]["path"]
    assert cold[0]["C environ agrees"]
    for key in ("seed", "random"):  # every process seeds its own, as cold ones do
        values = [state[key] for state in {id(s): s for s in (*cold, *first, *second)}.values()]
        assert len(set(values)) == len(values), f"{key} shared between processes: {values}"


def test_thread_pool_size_follows_the_job_environment(tmp_path, warm_on):
    """OpenMP reads OMP_NUM_THREADS when it loads, in the warm process: a forked rank gets the
    job's count applied; a value that is not a plain count makes the launch cold, saying why,
    and the warm process is replaced to match it."""
    assert [s["threads"][0] for s in run_state(tmp_path, warm_start=True, env={"OMP_NUM_THREADS": "2"})] == [2, 2]
    handle = nbshard.submit(programs.rank_and_value, 1, nproc=2, env={"OMP_NUM_THREADS": "1,1"})
    assert handle.result(timeout=120) == 0
    assert not handle.warm and "OMP_NUM_THREADS" in handle.launch_note
    warm_ready()
    handle = nbshard.submit(programs.rank_and_value, 1, nproc=2, env={"OMP_NUM_THREADS": "1,1"})
    assert handle.result(timeout=120) == 0 and handle.warm


def preload_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    """A module ``name`` (``VALUE = 'old'``) in ``tmp_path`` that the warm process preloads, ready."""
    module = tmp_path / f"{name}.py"
    module.write_text("VALUE = 'old'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(nbshard.settings, "preload", ["torch", name])
    nbshard.run(programs.rank_and_value, 1, nproc=1)  # starts a warm process with the new preload
    warm_ready()
    return module


@pytest.mark.parametrize("keeps_size_and_mtime", [False, True])
def test_a_changed_preloaded_module_is_never_used_stale(tmp_path, monkeypatch, warm_on, keeps_size_and_mtime):
    module = preload_module(tmp_path, monkeypatch, "preloaded_helper")

    def value():
        import preloaded_helper

        return preloaded_helper.VALUE

    handle = nbshard.submit(value, nproc=1)
    assert handle.result(timeout=60) == "old" and handle.warm
    before = os.stat(module)
    if keeps_size_and_mtime:  # as long as before, with the mtime put back, as some tools do
        module.write_text("VALUE = 'NEW'\n")
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert (os.stat(module).st_size, os.stat(module).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    else:
        module.write_text("VALUE = 'new, and longer'\n")
    new = module.read_text().split("'")[1]
    handle = nbshard.submit(value, nproc=1)
    assert handle.result(timeout=60) == new
    assert not handle.warm and "preloaded_helper.py changed on disk" in handle.launch_note
    warm_ready()
    handle = nbshard.submit(value, nproc=1)
    assert handle.result(timeout=60) == new and handle.warm


@pytest.mark.parametrize(("how", "says"), [
    (signal.SIGSTOP, "was stopped (SIGSTOP, or a debugger holds it) and cannot answer"),
    (signal.SIGKILL, "was killed by SIGKILL"),
])
def test_a_warm_process_that_cannot_answer_is_replaced_and_said_once(how, says, warm_on):
    nbshard.run(programs.rank_and_value, 1, nproc=1)  # a warm process that matches this environment
    lost = warm_ready()["pid"]
    os.kill(lost, how)
    try:
        started = time.monotonic()
        handle = nbshard.submit(programs.rank_and_value, 1, nproc=1)
        took = time.monotonic() - started
        assert handle.result(timeout=60) == 0
        # Found at once (it was a 10 s wait for an answer before), the launch cold meanwhile.
        assert took < 3.0, f"the launch waited {took:.1f} s on a warm process that could not answer"
        assert not handle.warm
        assert handle.launch_note == (
            f"cold start: the warm process (pid {lost}) {says}; a new warm process is starting in the "
            "background for the next launches"
        )
        status = warm_settled()
        assert status["state"] == "ready" and status["pid"] != lost
        again = nbshard.submit(programs.rank_and_value, 1, nproc=1)
        assert again.result(timeout=60) == 0 and again.warm and again.launch_note is None
        gone_by = time.monotonic() + 5
        while warm_launcher.process_state(lost) not in (None, "Z"):  # the stopped one was not left stopped forever
            assert time.monotonic() < gone_by, f"the lost warm process {lost} is still there"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(lost, signal.SIGKILL)


def test_a_preload_that_starts_a_thread_turns_warm_start_off_with_one_note(tmp_path, monkeypatch, warm_on):
    (tmp_path / "starts_a_thread.py").write_text(textwrap.dedent("""
        import ctypes, threading, time
        def named(name):  # as a native library names its threads (prctl PR_SET_NAME)
            ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)
            time.sleep(600)
        for name in ("sleepy_pool", "jemalloc_bg_thd"):  # jemalloc's own thread is fork-safe
            threading.Thread(target=named, args=(name,), daemon=True).start()
        time.sleep(0.2)
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(nbshard.settings, "preload", ["torch", "starts_a_thread"])
    nbshard.run(programs.rank_and_value, 1, nproc=1)
    status = warm_settled()
    assert status["state"] == "failed" and "runs 2 threads (besides the main one: sleepy_pool;" in status["reason"], status
    handles = [nbshard.submit(programs.rank_and_value, 3, nproc=1) for _ in range(2)]
    assert [h.result(timeout=60) for h in handles] == [0, 0]
    assert not any(h.warm for h in handles)
    assert "warm start is off" in handles[0].launch_note and "threads" in handles[0].launch_note
    assert handles[1].launch_note is None  # said once


def test_the_channel_takes_only_this_users_requests_with_the_token(tmp_path, warm_on):
    directory = warm._current.directory
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.stat(directory / "socket").st_mode & 0o777 == 0o600
    # The right user without the token: refused, and the warm process serves on.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
        client.connect(str(directory / "socket"))
        read, write = os.pipe()
        socket.send_fds(client, [json.dumps({"token": "0" * 64, "run_dir": str(tmp_path), "env": {}, "cwd": "/"}).encode()], [read, write, write])
        os.close(read), os.close(write)
        assert "token" in json.loads(client.recv(4096))["refused"]
    # Another user cannot reach the socket at all.
    if os.geteuid() == 0:
        probe = (
            "import os, socket; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            f"try: s.connect({str(directory / 'socket')!r}); print('connected')\nexcept PermissionError: print('refused')"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "refused", out
    assert run_state(tmp_path, warm_start=True)[1]["environ"]["RANK"] == "1"


def test_a_killed_kernel_takes_the_warm_process_and_its_jobs_along_within_5_seconds(script, runs_dir):
    kernel = script(
        """
        import time, nbshard, programs
        nbshard.run(programs.rank_and_value, 1, nproc=2)
        while nbshard.warm_status()["state"] == "starting":
            time.sleep(0.1)
        handle = nbshard.submit(programs.wait_in_collective, nproc=2)
        print("launched", handle.warm, nbshard.warm_status()["pid"], flush=True)
        handle.watch()
        """
    )
    line = kernel.wait_for("launched ", timeout=120)
    _, was_warm, warm_pid = line.split()
    assert was_warm == "True"
    kernel.wait_for("ready")
    kernel.wait_for("ready")
    run_dir = max(runs_dir.iterdir())
    assert len(processes_of(run_dir)) == 3
    spare = waiting_spare(int(warm_pid))  # forked while the job runs, for the next one
    kernel.process.kill()
    killed_at = time.monotonic()
    assert not wait_until_gone(run_dir, within=5.0)
    for pid, what in ((int(warm_pid), "the warm process"), (spare, "its spare launcher")):
        while warm_launcher.process_state(pid) not in (None, "Z"):
            assert time.monotonic() - killed_at < 5.0, f"{what} outlived its kernel"
            time.sleep(0.05)


def test_a_warm_ranks_memory_is_its_proportional_share_and_says_so(tmp_path, monkeypatch, warm_on, capsys):
    """A forked rank shares torch's pages with the warm process: its resident size counts them
    all, its proportional share (PSS) divides them; that is shown, and named."""

    def hold(megabytes):
        import time

        block = bytearray(megabytes << 20)  # private to this rank
        time.sleep(1.5)
        return len(block)

    handle = nbshard.submit(hold, 64, nproc=2, sample_interval=0.2)
    assert handle.result(timeout=60) == 64 << 20 and handle.warm
    handle.watch()
    for rank, peak in handle.peak_memory().items():
        assert 64 << 20 < peak["cpu_peak_pss"] < peak["cpu_peak_rss"] - (50 << 20), (rank, peak)
        assert 64 << 20 < peak["cpu_peak_pss_anon"] < peak["cpu_peak_pss"], (rank, peak)
    assert "rank 0 CPU anon PSS" in capsys.readouterr().out
    monkeypatch.setattr(nbshard.settings, "warm", False)
    cold = nbshard.submit(hold, 1, nproc=1, sample_interval=0.2)
    cold.watch()
    assert cold.result(timeout=60) == 1 << 20 and not cold.warm
    assert cold.peak_memory()[0]["cpu_peak_pss"] is None  # a cold rank shares nothing: resident is its own
    assert "rank 0 CPU " in capsys.readouterr().out


def waiting_spare(warm_pid: int, within: float = 30.0) -> int:
    """The pid of the launcher the warm process keeps forked ahead (its child that still shows
    the warm process's own command line), once there is one."""
    deadline = time.monotonic() + within
    own = Path(f"/proc/{warm_pid}/cmdline").read_bytes()
    while True:
        for child in Path(f"/proc/{warm_pid}/task/{warm_pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/cmdline").read_bytes() == own:
                    return int(child)
        assert time.monotonic() < deadline, "the warm process keeps no spare launcher"
        time.sleep(0.05)


def test_a_spare_launcher_is_what_a_launcher_forked_at_the_request_is_and_outlives_the_warm_process(tmp_path, warm_on):
    """The warm process keeps a launcher forked ahead, which takes the next job. Once it has a
    job it runs on when the warm process is killed, as any launcher does; it holds what a
    launcher forked when the job arrives holds. A spare killed while it waits ends spares in
    that warm process: launches fork as they come."""
    spare = waiting_spare(warm_on["pid"])
    handle = nbshard.submit(programs.launcher_state, 3.0, nproc=2, cwd=str(tmp_path))
    deadline = time.monotonic() + 60
    while handle.stage != "running":
        assert time.monotonic() < deadline, f"the job did not start: {handle.stage}"
        time.sleep(0.05)
    next_spare = waiting_spare(warm_on["pid"])  # forked a second after the launch, while the job runs
    os.kill(warm_on["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    while warm_launcher.process_state(next_spare) not in (None, "Z"):  # a waiting spare ends with the warm process
        assert time.monotonic() - killed_at < 5.0, "a waiting spare outlived the warm process"
        time.sleep(0.05)
    from_spare = handle.result(timeout=60)
    assert handle.warm and handle._launcher.pid == spare  # the spare took the job, and outlived the warm process
    assert from_spare["cmdline"].endswith("-m nbshard.launcher RUN_DIR") and from_spare["session leader"]

    nbshard.run(programs.rank_and_value, 1, nproc=1)  # cold: the warm process is found lost, and replaced
    warm_pid = warm_ready()["pid"]
    spare = waiting_spare(warm_pid)
    os.kill(spare, signal.SIGKILL)
    handle = nbshard.submit(programs.launcher_state, nproc=2, cwd=str(tmp_path))
    forked_at_request = handle.result(timeout=120)
    assert handle.warm and handle._launcher.pid != spare
    for key, value in from_spare.items():
        assert forked_at_request[key] == value, f"{key} differs: spare {value} vs forked at the request {forked_at_request[key]}"
    time.sleep(1.5)  # past the time after which a warm process with spares forks the next one
    children = Path(f"/proc/{warm_pid}/task/{warm_pid}/children").read_text().split()
    assert children == [], f"the warm process forked spares again after one died: {children}"
