"""Adversarial cases, round 2: other local users, numbers that are not numbers, what dead kernels
leave behind, environments and limits that keep a launcher from starting, and a umask of 000."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import programs
import pytest
from conftest import REPO, pythonpath

import nbshard
from nbshard.leftovers import hold_alive, sweep_temp

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local user")


def sleep_then_return(seconds):
    print("started", flush=True)
    time.sleep(seconds)
    return "done"


def listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            inodes |= {fields[9] for fields in map(str.split, lines) if fields[3] == "0A"}  # 0A: LISTEN
    return inodes


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


# -- 1. another local user cannot reach the kernel's socket ----------------------


@as_root
def test_another_local_user_cannot_reach_the_kernels_socket_and_no_tcp_port_is_open():
    handle = nbshard.submit(sleep_then_return, 2, nproc=2)
    while "started" not in handle.logs(0):
        time.sleep(0.05)
    address = json.loads((handle.run_dir / "launch.json").read_text())["address"]
    where = Path(address.removeprefix("ipc://")).parent  # the run's directory, or a short one beside it
    assert where == handle.run_dir or where.name.startswith("nbshard-wire-"), address
    assert where.stat().st_uid == os.geteuid() and stat.S_IMODE(where.stat().st_mode) == 0o700
    assert not socket_inodes(os.getpid()) & listening_tcp_inodes(), "the kernel listens on a TCP port"
    # The flood of the issue (8 connections of 90 frames just under 8 MiB each) cannot even begin:
    # the socket sits in a directory only this user can enter.
    probe = (
        "import os, socket, sys\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "refused = 0\n"
        "for _ in range(8):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    try: s.connect(sys.argv[1])\n"
        "    except PermissionError: refused += 1\n"
        "print(refused)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, address.removeprefix("ipc://")], capture_output=True,
                         text=True, timeout=30)
    assert out.stdout.strip() == "8", out
    assert handle.result(timeout=60) == "done"


# -- 2. numbers that are not numbers ------------------------------------------------


@pytest.mark.parametrize("option", ["timeout", "grace", "sample_interval"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0, True, 1e300])
def test_every_seconds_option_is_a_finite_positive_number_at_submit(option, value, runs_dir):
    for start in (nbshard.submit, nbshard.run):
        with pytest.raises(ValueError, match=f"{option} must be a positive, finite number of seconds"):
            start(programs.rank_and_value, 1, nproc=1, **{option: value})
    with pytest.raises(ValueError, match=option):
        nbshard.Job(programs.rank_and_value, (1,), **{option: value})
    assert not runs_dir.exists() or not list(runs_dir.iterdir()), "nothing may start for a bad option"


def test_a_live_view_refreshed_every_nan_seconds_is_refused():
    handle = nbshard.submit(programs.rank_and_value, 1, nproc=1)
    for refresh in (float("nan"), 0, -1):  # each would spin a thread of the kernel without pause
        with pytest.raises(ValueError, match="refresh must be a positive, finite number of seconds"):
            handle.show_live(refresh=refresh)
    assert handle.result(timeout=60) == 0


def test_sessions_and_backends_refuse_nan_before_anything_starts(runs_dir):
    with pytest.raises(ValueError, match="interrupt_grace must be a positive, finite"):
        nbshard.session("nan-grace", interrupt_grace=float("nan"), nproc=1)
    with pytest.raises(ValueError, match="grace must be a positive, finite"):
        nbshard.session("nan-stop", grace=float("nan"), nproc=1)
    assert "nan-grace" not in {s.name for s in nbshard.sessions()}
    with pytest.raises(ValueError, match=r"backend_options\['heartbeat'\] must be a positive, finite"):
        nbshard.run(programs.rank_and_value, 1, nproc=1, nnodes=2, backend="ray", backend_options={"heartbeat": float("nan")})
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


# -- 4. what a dead kernel leaves ------------------------------------------------------


def return_bytes(size):
    return b"x" * size


@pytest.fixture
def dead_kernel_run(script, runs_dir):
    """The run of a kernel SIGKILLed while it loaded the result (as a large one takes a while)."""
    kernel = script(
        """
        import time, nbshard, nbshard.kernel.outcome, test_hardening_local as here
        def slow_load(*args, **kwargs):  # the kernel is killed in the middle of reading the value
            print("loading", flush=True)
            time.sleep(600)
        nbshard.kernel.outcome._load_values = slow_load
        handle = nbshard.submit(here.return_bytes, 1 << 20, nproc=1)
        print("run", handle.run_dir, flush=True)
        handle.exception()
        """
    )
    run_dir = Path(kernel.wait_for("run ").split()[1])
    kernel.wait_for("loading", timeout=120)
    kernel.process.kill()
    kernel.process.wait()
    assert (run_dir / "result-0.pkl").exists()
    return run_dir


def test_a_result_left_by_a_killed_kernel_goes_at_the_next_start(dead_kernel_run, monkeypatch):
    # A bound below the 1 MiB result but far above the logs: once the result is gone, the run fits.
    monkeypatch.setattr(nbshard.settings, "keep_runs_bytes", 512 << 10)
    assert nbshard.run(programs.rank_and_value, 1, nproc=1) == 0
    assert not (dead_kernel_run / "result-0.pkl").exists(), "nobody can load it any more"
    assert (dead_kernel_run / "rank-0.log").exists()  # its logs are kept like any run's


def test_runs_of_dead_kernels_are_pruned_before_older_runs_of_live_ones(dead_kernel_run, monkeypatch, runs_dir):
    ours = nbshard.submit(programs.rank_and_value, 1, nproc=1)
    assert ours.result(timeout=60) == 0
    os.utime(ours.run_dir, (time.time() - 3600,) * 2)  # older than the dead kernel's run
    monkeypatch.setattr(nbshard.settings, "keep_runs", 1)
    assert nbshard.run(programs.rank_and_value, 1, nproc=1) == 0
    assert not dead_kernel_run.exists() and ours.run_dir.exists()


def test_finished_runs_are_kept_within_a_size_bound(monkeypatch):
    monkeypatch.setattr(nbshard.settings, "keep_runs_bytes", 1 << 20)
    handles = []
    for _ in range(3):  # each run's log takes about 0.6 MiB
        handles.append(nbshard.submit(programs.print_lines, 12_000, 40, nproc=1))
        handles[-1].result(timeout=60)
    assert [h.run_dir.exists() for h in handles] == [False, True, True]
    assert handles[1].logs(0).count("\n") >= 12_000


def test_a_kernel_killed_just_after_starting_the_warm_process_leaves_no_directory(script):
    kernel = script(
        """
        import os, signal, time, nbshard
        nbshard.restart_warm()
        from nbshard.backends import warm
        print("WARM-DIR", warm._current.directory, flush=True)
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    directory = Path(kernel.wait_for("WARM-DIR ").split()[1])
    kernel.process.wait(30)
    deadline = time.monotonic() + 60  # the warm process starts Python, sees its kernel gone, removes it
    while directory.exists():
        assert time.monotonic() < deadline, f"{directory} outlived its kernel"
        time.sleep(0.1)


def hold_until_killed(directory):
    """A process that owns ``directory`` (as a warm process or a node's actor does), for a test."""
    return subprocess.Popen(
        [sys.executable, "-c", f"from pathlib import Path; from nbshard.leftovers import hold_alive; import time; "
                               f"hold_alive(Path({str(directory)!r})); print('held', flush=True); time.sleep(600)"],
        env={**os.environ, "PYTHONPATH": pythonpath(REPO)}, stdout=subprocess.PIPE, text=True,
    )


def test_the_temp_directories_of_owners_that_died_are_swept_and_no_others(tmp_path):
    made = {name: Path(tempfile.mkdtemp(prefix=name, dir=tmp_path)) for name in
            ("nbshard-node-alive-", "nbshard-node-dead-", "nbshard-warm-unlocked-", "unrelated-")}
    owners = {name: hold_until_killed(made[name]) for name in ("nbshard-node-alive-", "nbshard-node-dead-")}
    try:
        for owner in owners.values():
            assert owner.stdout.readline().strip() == "held"
        owners["nbshard-node-dead-"].kill()  # as a node's actor killed with SIGKILL
        owners["nbshard-node-dead-"].wait()
        os.utime(made["nbshard-warm-unlocked-"], (time.time() - 3600,) * 2)  # an older nbshard's, without the lock
        assert sweep_temp(tmp_path) == [made["nbshard-node-dead-"]]
        assert all(made[name].exists() for name in ("nbshard-node-alive-", "nbshard-warm-unlocked-", "unrelated-"))
    finally:
        for owner in owners.values():
            owner.kill()
            owner.wait()


@as_root
def test_the_sweep_leaves_another_users_directories_alone(tmp_path):
    theirs = tmp_path / "nbshard-node-theirs"
    theirs.mkdir()
    os.close(hold_alive(theirs))  # its owner is gone
    os.chown(theirs, NOBODY, NOBODY)
    assert sweep_temp(tmp_path) == [] and theirs.exists()


def test_a_new_kernel_sweeps_what_a_dead_one_left_in_the_temp_directory(script):
    left = Path(tempfile.mkdtemp(prefix="nbshard-node-left-by-a-test-"))
    os.close(hold_alive(left))  # its owner came and went
    kernel = script(
        """
        import nbshard, programs
        print("value", nbshard.run(programs.rank_and_value, 1, nproc=1), flush=True)
        """
    )
    assert kernel.wait_for("value ", timeout=120).split()[1] == "0"
    assert not left.exists()


# -- 5. an environment or a limit that keeps the launcher from starting ----------------------


@pytest.mark.parametrize(("env", "says"), [
    ({"": "x"}, "holds the variable name ''"),
    ({"A=B": "x"}, "holds the variable name 'A=B'"),
    ({"A\0B": "x"}, "holds the variable name"),
    ({"GOOD": "a\0b"}, "holds a NUL character"),
    ({"BIG": "y" * (128 << 10)}, "takes 128 KiB, and Linux starts no process with a variable of 128 KiB or more"),
])
def test_an_environment_no_process_can_have_is_refused_at_submit(env, says, runs_dir):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        nbshard.submit(programs.rank_and_value, 1, nproc=1, env=env)
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


@pytest.mark.parametrize("env", ["A=1", ["A=1"], None])
def test_an_environment_that_is_not_a_dict_says_what_it_should_be(env, runs_dir):
    with pytest.raises(TypeError, match=r"env must be a dict of environment variables, e.g. \{'KEY': 'value'\}; got"):
        nbshard.submit(programs.rank_and_value, 1, nproc=1, env=env)
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


def test_ranks_to_show_or_debug_that_the_default_nproc_lacks_are_refused_before_anything_starts(runs_dir):
    with pytest.raises(ValueError, match="show_ranks names rank 64, but the job has \\d+ ranks? \\(0 to"):
        nbshard.submit(programs.rank_and_value, 1, show_ranks=[64])  # nproc defaults to the GPUs, or 1
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


def test_an_environment_too_large_in_all_says_so_and_leaves_no_run(runs_dir):
    env = {f"PART{i}": "z" * (120 << 10) for i in range(40)}  # each allowed, 4.7 MiB together
    with pytest.raises(OSError, match="could not start the launcher: Argument list too long. The environment"):
        nbshard.submit(programs.rank_and_value, 1, nproc=1, env=env)
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


def test_a_pythonhome_that_does_not_exist_is_refused_at_submit():
    with pytest.raises(ValueError, match="PYTHONHOME to '/nonexistent', which is not a directory"):
        nbshard.submit(programs.rank_and_value, 1, nproc=1, env={"PYTHONHOME": "/nonexistent"})


def test_a_launcher_that_fails_by_itself_shows_its_own_last_lines(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "zmq.py").write_text("raise ImportError('this zmq is a broken copy on PYTHONPATH')\n")
    path = os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(programs.rank_and_value, 1, nproc=1, env={"PYTHONPATH": path})
    message = str(caught.value)
    assert message.splitlines()[0] == (  # what the cell's heading shows: the launcher's own last words
        "The nbshard launcher failed by itself (exited with code 1) before the job ended: "
        "ImportError: this zmq is a broken copy on PYTHONPATH"
    )
    assert "The last lines of its log" in message and "raise ImportError(" in message
    assert "killed from outside" not in message


@pytest.fixture
def process_limit():
    """A cgroup that allows 24 processes (threads included), as a container's pids.max does."""
    group = Path("/sys/fs/cgroup/pids") / f"nbshard-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "pids.max").write_text("24")
    except OSError as error:
        pytest.skip(f"needs a writable pids cgroup (v1) to limit processes: {error}")
    yield group
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            group.rmdir()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    sweep_temp()  # as the next nbshard start does: the warm process killed above left its directory


def test_more_ranks_than_the_process_limit_allows_says_so(script, process_limit):
    kernel = script(
        f"""
        import nbshard, programs
        open({str(process_limit / "cgroup.procs")!r}, "w").write("0")  # this kernel, and all it starts
        try:
            nbshard.run(programs.rank_and_value, 1, nproc=40)
        except nbshard.JobFailed as error:
            print("FAILED", str(error).splitlines()[0], flush=True)
        """
    )
    line = kernel.wait_for("FAILED", timeout=150)
    assert "nbshard could not start rank " in line, line
    assert "(EAGAIN). Likely cause: a limit on processes was reached" in line
    assert "this container's (cgroup pids.max: 24)" in line
    assert "killed from outside" not in line


def test_more_ranks_than_one_launcher_could_hold_open_are_refused_before_anything_starts(script, runs_dir):
    # The launcher holds pipes for each rank: past the hard open-files limit ZeroMQ aborted it
    # (SIGABRT) after forking thousands of ranks (nproc=10**6 reached about 4,000 here).
    kernel = script(
        """
        import resource, nbshard, programs
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        try:
            nbshard.run(programs.rank_and_value, 1, nproc=64)
        except ValueError as error:
            print("REFUSED", error, flush=True)
        """
    )
    line = kernel.wait_for("REFUSED", timeout=60)
    assert "nproc=64 is more ranks than one launcher can hold here: it needs about 448 open files" in line, line
    assert "may open at most 256 (ulimit -Hn)" in line
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_a_launcher_raises_its_own_open_files_limit_as_far_as_its_ranks_need(script, runs_dir):
    # A soft limit of 40 (below the usual 1024, as 1024 is below what 200 ranks need): without
    # the raise the launcher failed with "Too many open files".
    kernel = script(
        """
        import resource, nbshard, programs
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        print("VALUES", nbshard.run(programs.rank_and_value, 1, nproc=8, return_all=True), flush=True)
        """
    )
    assert kernel.wait_for("VALUES", timeout=120).split(" ", 1)[1].strip() == str(list(range(8)))


# -- 7. a umask of 000 ----------------------------------------------------------------------


def test_every_file_and_directory_of_a_run_is_private_under_umask_000(script, runs_dir):
    kernel = script(
        """
        import os, time, nbshard, programs
        os.umask(0)
        nbshard.run(programs.rank_and_value, 1, nproc=2)
        try:
            nbshard.run(programs.raise_on_rank, 1, "boom", nproc=2)
        except nbshard.JobFailed:
            pass
        session = nbshard.session("umask", nproc=2)
        session.run(programs.rank_and_value, 2)
        session.close()
        while nbshard.warm_status()["state"] == "starting":
            time.sleep(0.1)
        from nbshard.backends import warm
        print("WARM-DIR", warm._current.directory, flush=True)
        time.sleep(600)  # until the test has looked
        """
    )
    warm_dir = Path(kernel.wait_for("WARM-DIR ", timeout=170).split()[1])
    loose = []
    for root in (runs_dir, warm_dir):
        for path in [root, *root.rglob("*")]:
            with_mode = os.lstat(path)
            if stat.S_IMODE(with_mode.st_mode) & 0o077 and not stat.S_ISLNK(with_mode.st_mode):
                loose.append(f"{path} {stat.S_IMODE(with_mode.st_mode):o}")
    assert any(runs_dir.rglob("calls")), "the session's calls directory was checked"
    assert any(runs_dir.rglob("error-1.json")) and (warm_dir / "status.json").exists(), "a failure and the warm process were checked"
    assert not loose, loose


def test_a_launcher_of_another_nbshard_says_so_and_what_to_do(tmp_path):
    """As after ``pip install -U nbshard`` in a running kernel: the launcher imports the nbshard
    on disk, which reads another version of the kernel's launch.json (and speaks another wire)."""
    other = tmp_path / "other"
    shutil.copytree(Path(nbshard.__file__).parent, other / "nbshard", ignore=shutil.ignore_patterns("__pycache__"))
    contracts = other / "nbshard" / "contracts.py"
    source = contracts.read_text()
    assert "\nLAUNCH_SPEC_VERSION = " in source
    contracts.write_text(source.replace("\nLAUNCH_SPEC_VERSION = ", "\nLAUNCH_SPEC_VERSION = 100 + ", 1))
    path = os.pathsep.join([str(other), os.environ.get("PYTHONPATH", "")])
    with pytest.raises(nbshard.JobFailed) as caught:  # in tmp_path, so that `python -m` puts no other nbshard first
        nbshard.run(programs.rank_and_value, 1, nproc=1, env={"PYTHONPATH": path}, cwd=str(tmp_path))
    message = str(caught.value)
    first = message.splitlines()[0]
    assert first.startswith("The nbshard launcher failed by itself (exited with code 1) before the job ended: "), message
    assert "this nbshard reads version 10" in first and "runs another version of nbshard than the kernel" in first, message
    assert "Likely cause: nbshard was upgraded or reinstalled after this kernel imported it (restart the kernel)" in message
