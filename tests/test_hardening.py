"""Adversarial cases: other local users, floods, escaping processes, full disks, huge results."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import nbshard
import programs
from conftest import REPO, processes_of, wait_until_gone

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create files owned by another user")


def test_a_runs_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # like a directory another user made world-writable
    monkeypatch.setattr(nbshard.settings, "runs_dir", shared / "runs")
    with pytest.raises(PermissionError, match=r"shared is writable by other users \(mode 777\).*NBSHARD_RUNS_DIR"):
        nbshard.submit(programs.rank_and_value, 1, nproc=1)
    assert not (shared / "runs").exists() or not list((shared / "runs").iterdir())


@as_root
def test_a_runs_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    monkeypatch.setattr(nbshard.settings, "runs_dir", theirs)
    with pytest.raises(PermissionError, match=f"belongs to another user \\(uid {NOBODY}\\)"):
        nbshard.run(programs.rank_and_value, 1, nproc=1)


def sleep_then_return(seconds):
    print("started", flush=True)
    time.sleep(seconds)
    return "genuine"


def test_a_run_directory_swapped_during_the_job_is_never_loaded(tmp_path):
    handle = nbshard.submit(sleep_then_return, 3, nproc=1)
    while "started" not in handle.logs(0):  # the rank runs
        time.sleep(0.05)
    # Another program renames the run away and puts its own, with a result that runs code when loaded.
    marker = tmp_path / "attacker-code-ran"
    moved = handle.run_dir.with_name(handle.run_dir.name + "-moved")
    handle.run_dir.rename(moved)
    handle.run_dir.mkdir(mode=0o700)
    (handle.run_dir / "outcome.json").write_text('{"status": "succeeded", "ranks": [], "notes": [], "dropped_lines": {}}')
    (handle.run_dir / "result-0.pkl").write_bytes(
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    )
    with pytest.raises(nbshard.JobError, match="was replaced while the job ran"):
        handle.result(timeout=60)
    assert not marker.exists()
    shutil.rmtree(moved)


@as_root
def test_pruning_leaves_foreign_entries_alone_and_is_not_broken_by_them(runs_dir, monkeypatch):
    monkeypatch.setattr(nbshard.settings, "keep_runs", 0)
    nbshard.run(programs.rank_and_value, 1, nproc=1)  # creates the runs directory
    foreign = runs_dir / "20200101-000000-theirs-000000"
    foreign.mkdir(mode=0o700)
    (foreign / "outcome.json").write_text("{}")  # looks finished
    os.chown(foreign / "outcome.json", NOBODY, NOBODY)
    os.chown(foreign, NOBODY, NOBODY)
    (runs_dir / "stray-file").write_text("not a run")
    for _ in range(2):
        assert nbshard.run(programs.rank_and_value, 3, nproc=2, return_all=True) == [0, 3]
    assert foreign.exists() and (runs_dir / "stray-file").exists()


def test_the_logs_of_a_pruned_run_say_so(monkeypatch):
    handle = nbshard.submit(programs.rank_and_value, 1, nproc=1)
    handle.result(timeout=60)
    assert (handle.run_dir / "launcher.log").read_text() == ""  # no warning, nothing to say
    shutil.rmtree(handle.run_dir)
    with pytest.raises(FileNotFoundError, match="was pruned"):
        handle.logs(0)


def test_a_runs_directory_path_too_long_is_refused_before_anything_starts(tmp_path, monkeypatch):
    deep = tmp_path
    while len(str(deep)) < 4000:
        deep = deep / ("d" * 200)
    monkeypatch.setattr(nbshard.settings, "runs_dir", deep)
    with pytest.raises(ValueError, match="path is too long"):
        nbshard.submit(programs.rank_and_value, 1, nproc=1)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def escaped_children(pid_file: Path) -> list[int]:
    """The pids of the children the ranks started in new sessions, once all have written them."""
    deadline = time.monotonic() + 30
    while len(found := sorted(pid_file.parent.glob(pid_file.name + ".*"))) < 2:
        assert time.monotonic() < deadline, "the ranks did not start their children"
        time.sleep(0.05)
    return [int(path.read_text()) for path in found]


def gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("ending", ["return", "raise", "cancel"])
def test_a_ranks_child_in_a_new_session_is_gone_within_5_s_however_the_job_ends(tmp_path, ending):
    pid_file = tmp_path / "child"
    handle = nbshard.submit(programs.start_escaping_child, str(pid_file), "wait" if ending == "cancel" else ending, nproc=2)
    children = escaped_children(pid_file)
    if ending == "cancel":
        handle.cancel(wait=False)
    handle.exception(timeout=60)
    ended = time.monotonic()
    try:
        assert not gone_within(children, 5 - (time.monotonic() - ended))
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, 9)


def test_a_ranks_child_in_a_new_session_dies_with_a_killed_kernel(script, runs_dir, tmp_path):
    pid_file = tmp_path / "child"
    kernel = script(
        f"""
        import nbshard, programs
        handle = nbshard.submit(programs.start_escaping_child, {str(pid_file)!r}, "wait", nproc=2)
        handle.watch()
        """
    )
    children = escaped_children(pid_file)
    kernel.process.kill()
    killed = time.monotonic()
    try:
        assert not gone_within(children, 5.0)
        assert not wait_until_gone(runs_dir, within=5 - (time.monotonic() - killed))
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, 9)


def test_a_killed_kernel_with_a_forked_helper_still_takes_its_jobs_along(script, runs_dir):
    # A multiprocessing child forked by the notebook holds the kernel's end of the launcher's
    # pipe, so the pipe never closes: the launcher must watch the kernel itself.
    kernel = script(
        """
        import multiprocessing, time, nbshard, programs
        handle = nbshard.submit(programs.wait_in_collective, nproc=2)
        helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=False)
        helper.start()
        print("helper", helper.pid, flush=True)
        handle.watch()
        """
    )
    helper = int(kernel.wait_for("helper").split()[1])
    try:
        kernel.wait_for("ready")
        kernel.wait_for("ready")
        run_dir = next(runs_dir.iterdir())
        assert len(processes_of(run_dir)) == 3
        kernel.process.kill()
        assert not wait_until_gone(run_dir, within=5.0), "launcher or ranks outlived the kernel"
        assert alive(helper)  # the notebook's own helper is not nbshard's to stop
    finally:
        os.kill(helper, 9)


def peak_memory_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_flood_of_lines_keeps_the_kernel_bounded_and_says_what_it_did_not_show(kernel):
    setup = f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\nimport nbshard, programs\n"
    assert kernel.execute(setup + "nbshard.run(programs.rank_and_value, 1, nproc=2)").status == "ok"
    before = peak_memory_kib(kernel.pid)
    result = kernel.execute("handle = nbshard.submit(programs.print_lines, 400_000, 10, nproc=2)\nhandle.watch()", timeout=170)
    assert result.status == "ok", result.traceback
    grown_mib = (peak_memory_kib(kernel.pid) - before) / 1024
    shown = result.stdout.count(":xxxxxxxxxx")
    logs = kernel.execute("print(sum(handle.logs(r).count(':xxxxxxxxxx') for r in (0, 1)))")
    assert logs.stdout.strip() == "800000"  # the logs on disk are complete
    assert grown_mib < 120, f"the kernel grew by {grown_mib:.0f} MiB"
    # Past what a person can read (and Jupyter's own rate limit), lines are dropped from the cell, and it says so.
    assert shown < 800_000 and "not shown" in result.stdout, result.stdout[-2000:]


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB filesystem of the test's own (tmpfs), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir(mode=0o700)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.decode().strip()}")
    yield mount
    wait_until_gone(mount, within=5.0)
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_during_a_job_says_so_and_stops_the_ranks(small_disk, monkeypatch):
    monkeypatch.setattr(nbshard.settings, "runs_dir", small_disk / "runs")
    handle = nbshard.submit(programs.print_lines, 400_000, 10, nproc=2)  # about 8 MB of logs on a 2 MiB disk
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=120)
    message = str(caught.value)
    assert "could not be written: No space left on device" in message and "NBSHARD_RUNS_DIR" in message
    assert "crashed" not in message
    assert not wait_until_gone(small_disk, within=5.0)


def test_a_full_disk_at_submit_says_so_and_leaves_nothing_behind(small_disk, monkeypatch):
    monkeypatch.setattr(nbshard.settings, "runs_dir", small_disk / "runs")
    big = b"x" * (3 << 20)  # the job itself does not fit
    with pytest.raises(OSError, match="could not write the job into .*No space left on device"):
        nbshard.submit(len, big, nproc=1)
    assert list((small_disk / "runs").iterdir()) == []


def test_a_large_result_costs_about_its_own_size_on_each_side_and_does_not_linger(script, runs_dir):
    size_mib = 300
    kernel = script(
        f"""
        import resource, torch, nbshard, programs
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        handle = nbshard.submit(programs.big_result, {size_mib}, nproc=1, sample_interval=0.05)
        tensor, rank_resident = handle.result(timeout=120)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        rank_peak = handle.peak_memory()[0]["cpu_peak_rss"]
        print("sizes", tensor.numel() * 4 >> 20, grown >> 10, (rank_peak - rank_resident) >> 20, float(tensor.sum()), flush=True)
        print("files", sorted(p.name for p in handle.run_dir.iterdir() if p.name.startswith("result")), flush=True)
        """
    )
    result_mib, kernel_grown_mib, rank_extra_mib, total = kernel.wait_for("sizes", timeout=150).split()[1:]
    assert int(result_mib) == size_mib and float(total) == size_mib * 1024 * 1024 // 4
    assert int(kernel_grown_mib) < 1.3 * size_mib, f"the kernel grew by {kernel_grown_mib} MiB for a {size_mib} MiB result"
    assert int(rank_extra_mib) < 0.3 * size_mib, f"writing the result took {rank_extra_mib} MiB more in the rank"
    assert kernel.wait_for("files").strip() == "files []"  # loaded, then removed from the run directory
    assert kernel.finish()[0] == 0


def test_far_more_ranks_than_the_machine_has_is_a_warning_that_says_so():
    cpus = len(os.sched_getaffinity(0))
    with pytest.warns(nbshard.TooManyRanks, match=f"{cpus} CPUs available"):
        handle = nbshard.submit(programs.rank_and_value, 1, nproc=2 * cpus + 1, sample_interval=None)
    handle.cancel()
