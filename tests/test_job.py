"""The job spec and the environment of each rank: pure functions, compared directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbshard.environment import TORCHRUN_VARIABLES, import_time_environment, launch_environment, rank_environment
from nbshard.job import Job
from nbshard.run_dir import RunDir


def train(x):
    return x


def test_job_keeps_its_options():
    job = Job(train, (1,), {"y": 2}, nproc=2, gpus=[0, 1], env={"A": "b"}, timeout=5, return_all=True)
    assert (job.nproc, list(job.gpus), job.timeout, job.return_all, job.backend) == (2, [0, 1], 5, True, "subprocess")
    assert job.label == "train"


def steps():
    yield 1


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"nproc": 0}, ValueError, "nproc must be a positive integer"),
        ({"nproc": 1.5}, ValueError, "nproc"),
        ({"nproc": True}, ValueError, "nproc"),
        ({"gpus": "0,1"}, TypeError, "list of GPU indices"),
        ({"gpus": [0, 0]}, ValueError, "twice"),
        ({"gpus": [-1]}, ValueError, "non-negative"),
        ({"env": {"A": 1}}, TypeError, "str to str"),
        ({"env": {"RANK": "3"}}, ValueError, "sets RANK"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, ValueError, "gpus="),
        ({"timeout": 0}, ValueError, "timeout must be a positive"),
        ({"timeout": "10"}, ValueError, "timeout"),
        ({"grace": -1}, ValueError, "grace"),
        ({"show_ranks": ["0"]}, ValueError, "show_ranks"),
        ({"show_ranks": [2], "nproc": 2}, ValueError, "show_ranks names rank 2, but the job has 2 ranks"),
        ({"debug_ranks": [3, 4, 5], "nproc": 2, "nnodes": 2}, ValueError, "debug_ranks names ranks 4, 5, but the job has 4 ranks"),
        ({"kwargs": {1: 2}}, TypeError, "argument names \\(str\\) to values, got the key 1"),
        ({"master_port": 70000}, ValueError, "master_port"),
        ({"pickle_by_value": ["os"]}, TypeError, "modules"),
        ({"cwd": 3}, TypeError, "cwd"),
        ({"name": 5}, TypeError, "name must be a non-empty string"),
        ({"fn": steps}, TypeError, "'steps' is a generator function: calling it only makes a generator"),
        ({"name": " "}, TypeError, "name must be a non-empty string"),
        ({"return_all": "yes"}, TypeError, "return_all must be True or False, got 'yes'"),
        ({"return_all": 0}, TypeError, "return_all must be True or False"),
    ],
)
def test_bad_options_raise_clear_errors(options, error, words):
    with pytest.raises(error, match=words):
        Job(options.pop("fn", train), **options)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        Job("train")  # type: ignore[arg-type]


def test_launch_environment_strips_jupyter_and_sets_gpus():
    kernel = {
        "PATH": "/bin", "JPY_PARENT_PID": "1", "JPY_SESSION_NAME": "x.ipynb", "RANK": "7",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline", "CUDA_VISIBLE_DEVICES": "0,1,2",
    }
    env = launch_environment(kernel, gpus=[2, "GPU-abc"], extra={"MY_FLAG": "1"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,GPU-abc", "PYTHONUNBUFFERED": "1", "MY_FLAG": "1"}
    assert kernel["RANK"] == "7"  # the kernel's mapping is not changed


def test_launch_environment_leaves_rays_driver_debugger_to_the_kernel():
    # ray.init() sets it in the kernel; in a rank, breakpoint() then raised inside Ray.
    assert "PYTHONBREAKPOINT" not in launch_environment({"PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"}, gpus=None, extra={})
    assert launch_environment({"PYTHONBREAKPOINT": "0"}, gpus=None, extra={})["PYTHONBREAKPOINT"] == "0"  # a person's own choice
    chosen = {"PYTHONBREAKPOINT": "ray.util.rpdb.set_trace"}  # asked for in env=: kept
    assert launch_environment({}, gpus=None, extra=chosen)["PYTHONBREAKPOINT"] == "ray.util.rpdb.set_trace"
    # Read at each breakpoint(), not at start-up: a warm process started before it changed still serves.
    assert import_time_environment({"PYTHONBREAKPOINT": "0", "PYTHONHASHSEED": "1"}) == {"PYTHONHASHSEED": "1"}


def test_launch_environment_keeps_the_kernels_gpus_unless_told():
    assert launch_environment({"CUDA_VISIBLE_DEVICES": "3"}, gpus=None, extra={})["CUDA_VISIBLE_DEVICES"] == "3"
    assert launch_environment({"CUDA_VISIBLE_DEVICES": "3"}, gpus=(), extra={})["CUDA_VISIBLE_DEVICES"] == ""


def test_rank_environment_is_what_torchrun_sets(tmp_path: Path):
    env = rank_environment(
        {"PATH": "/bin"}, rank=1, nproc=2, master_port=29511, run_id="run-1", run_dir=RunDir(tmp_path)
    )
    assert set(TORCHRUN_VARIABLES) <= set(env)
    assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == "1"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29511")
    assert env["TORCHELASTIC_RUN_ID"] == "run-1"
    assert env["OMP_NUM_THREADS"] == "1"  # as torchrun does for nproc > 1
    assert env["PATH"] == "/bin"


def test_rank_environment_keeps_a_chosen_thread_count(tmp_path: Path):
    env = rank_environment({"OMP_NUM_THREADS": "4"}, rank=0, nproc=2, master_port=1, run_id="r", run_dir=RunDir(tmp_path))
    assert env["OMP_NUM_THREADS"] == "4"
    single = rank_environment({}, rank=0, nproc=1, master_port=1, run_id="r", run_dir=RunDir(tmp_path))
    assert "OMP_NUM_THREADS" not in single
