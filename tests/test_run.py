"""Real 2-rank jobs on the CPU with gloo through the subprocess backend."""

from __future__ import annotations

import io
import os
import sys

import pytest

import nbshard
import programs

pytestmark = pytest.mark.timeout(120)


def test_run_returns_rank_zeros_value_or_every_ranks():
    assert nbshard.run(programs.rank_and_value, 21, nproc=2) == 0
    assert nbshard.run(programs.rank_and_value, 21, nproc=2, return_all=True) == [0, 21]


def test_run_prints_each_ranks_lines_prefixed(capsys):
    assert nbshard.run(programs.print_lines, 3, 5, nproc=2) == 3
    out = capsys.readouterr().out.splitlines()
    for rank in (0, 1):
        assert [line for line in out if line.startswith(f"[rank{rank}]: ")] == [
            f"[rank{rank}]: {rank}:{index}:xxxxx" for index in range(3)
        ]


def test_something_unpicklable_fails_before_any_process_starts(runs_dir):
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"args\[0\]\['lock'\].*cannot be pickled"):
        nbshard.submit(programs.rank_and_value, {"lock": lock}, nproc=2)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_a_job_object_runs_and_can_be_reused_with_other_options():
    job = nbshard.Job(programs.rank_and_value, (5,), nproc=2, return_all=True)
    assert nbshard.run(job) == [0, 5]
    assert nbshard.run(job, nproc=3) == [0, 5, 10]


def test_keyword_arguments_go_through_kwargs_and_unknown_options_are_refused():
    assert nbshard.run(programs.rank_and_value, nproc=1, kwargs={"value": 3}) == 0
    with pytest.raises(TypeError, match="unknown option.*value.*kwargs="):
        nbshard.run(programs.rank_and_value, nproc=1, value=3)


@pytest.mark.parametrize(("option", "meant"), [("nprocs", "nproc"), ("num_processes", "nproc"), ("nproc_per_node", "nproc"),
                                               ("devices", "nproc"), ("num_nodes", "nnodes"), ("timout", "timeout")])
def test_a_peers_name_or_a_typo_for_an_option_says_which_one_is_meant(runs_dir, option, meant):
    with pytest.raises(TypeError, match=rf"unknown option\(s\) {option} \(did you mean {meant}\?\)"):
        nbshard.submit(programs.rank_and_value, **{option: 2})
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_args_as_the_peers_take_them_says_where_positional_arguments_go(runs_dir):
    with pytest.raises(TypeError, match=r"args \(the function's positional arguments go after it, as run\(fn, \*args\) takes them\)"):
        nbshard.submit(programs.rank_and_value, args=(3,), nproc=1)  # torch.multiprocessing.spawn's spelling
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_a_peers_name_for_a_session_option_says_which_one_is_meant(runs_dir):
    with pytest.raises(TypeError, match=r"unknown session option\(s\) nprocs \(did you mean nproc\?\)"):
        nbshard.session("s", nprocs=2)
    assert nbshard.sessions() == []


def test_ranks_see_torchruns_environment_and_not_jupyters(monkeypatch, tmp_path):
    monkeypatch.setenv("JPY_PARENT_PID", "12345")
    monkeypatch.setenv("MASTER_PORT", "1")  # a stale torchrun variable in the kernel
    kernel_env = dict(os.environ)
    envs = nbshard.run(
        programs.environment, nproc=2, return_all=True, env={"MY_SETTING": "on"}, gpus=[], cwd=str(tmp_path)
    )
    assert dict(os.environ) == kernel_env  # a launch never changes the kernel's environment
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["ROLE_RANK"] == str(rank)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] != "1"
        assert env["TORCHELASTIC_RUN_ID"] and env["PYTHONUNBUFFERED"] == "1"
        assert env["MY_SETTING"] == "on" and env["CUDA_VISIBLE_DEVICES"] == ""
        assert "JPY_PARENT_PID" not in env
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_ranks_run_in_the_jobs_cwd_with_the_kernels_import_path(tmp_path):
    (tmp_path / "helper_next_to_notebook.py").write_text("def answer():\n    return 42\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import helper_next_to_notebook

        assert nbshard.run(helper_next_to_notebook.answer, nproc=1, cwd=str(tmp_path)) == 42
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper_next_to_notebook", None)


def test_a_local_module_can_travel_by_value(tmp_path):
    module_dir = tmp_path / "only_in_the_kernel"
    module_dir.mkdir()
    (module_dir / "kernel_only_helper.py").write_text("def answer():\n    return 'by value'\n")
    sys.path.insert(0, str(module_dir))
    try:
        import kernel_only_helper
    finally:
        sys.path.remove(str(module_dir))  # the ranks cannot import it by name
    try:
        with pytest.raises(nbshard.JobFailed) as caught:
            nbshard.run(kernel_only_helper.answer, nproc=1)
        assert "ModuleNotFoundError: No module named 'kernel_only_helper'" in str(caught.value)
        assert "pass pickle_by_value=[module]" in str(caught.value)
        assert nbshard.run(kernel_only_helper.answer, nproc=1, pickle_by_value=[kernel_only_helper]) == "by value"
    finally:
        sys.modules.pop("kernel_only_helper", None)


async def gathered_in_each_rank(value):
    import asyncio
    import os

    first, second = await asyncio.gather(asyncio.sleep(0, value), asyncio.sleep(0, int(os.environ["RANK"])))
    return first + second


def test_an_async_function_runs_to_its_end_in_each_rank():
    # It used to return an unawaited coroutine, which failed as a value that cannot be pickled.
    assert nbshard.run(gathered_in_each_rank, 10, nproc=2, return_all=True) == [10, 11]


def test_stdin_is_dev_null_so_input_fails_instead_of_hanging():
    assert nbshard.run(programs.read_stdin, nproc=1) == "EOFError: EOF when reading a line"


def test_output_written_to_file_descriptors_is_captured(capsys):
    handle = nbshard.submit(programs.stdout_and_stderr_fd, nproc=1)
    shown = io.StringIO()
    handle.watch(shown)
    handle.result()
    assert "[rank0]: from fd 1" in shown.getvalue() and "[rank0]: from fd 2" in shown.getvalue()
    assert "from fd 1" in handle.logs(0) and "from fd 2" in handle.logs(0)


def test_ddp_training_loss_goes_down():
    result = nbshard.run(programs.ddp_losses, 30, nproc=2)
    losses = result["losses"]
    assert losses[-1] < 0.1 * losses[0]
    assert result["replicas_equal"]


def test_fsdp2_training_step_and_gathered_weights_come_back_on_the_cpu():
    result = nbshard.run(programs.fsdp2_step, nproc=2)
    assert result["local_shape"] == (16, 16) and result["full_shape"] == (32, 16)
    assert result["losses"][-1] < result["losses"][0]
    weight = result["full_weight"]
    assert weight.device.type == "cpu" and tuple(weight.shape) == (32, 16)


def test_a_dtensor_result_says_to_gather_it():
    with pytest.raises(nbshard.JobFailed, match=r"full_tensor\(\)"):
        nbshard.run(programs.return_dtensor, nproc=2)


def test_tensor_results_arrive_from_every_rank():
    tensors = nbshard.run(programs.allreduce_sum, nproc=2, return_all=True)
    assert [t.tolist() for t in tensors] == [[3.0], [3.0]]


def test_default_nproc_is_one_without_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    handle = nbshard.submit(programs.rank_and_value, 1)
    assert handle.world_size == 1 and handle.result(timeout=60) == 0


def test_atexit_handlers_of_the_user_run_in_the_ranks(tmp_path):
    marker = tmp_path / "atexit-ran"
    assert nbshard.run(programs.install_atexit_marker, str(marker), nproc=1) == "ok"
    assert marker.read_text() == "atexit ran"


def test_gloo_ranks_exit_cleanly_every_time():
    # gloo ranks used to abort at interpreter exit about 1 run in 5-10; none may fail.
    for _ in range(5):
        assert [t.item() for t in nbshard.run(programs.allreduce_sum, nproc=2, return_all=True)] == [3.0, 3.0]


def test_nbshard_refuses_other_platforms(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(RuntimeError, match="Linux only"):
        nbshard.submit(programs.rank_and_value, 1, nproc=1)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend 'kubernetes'; available: ray, slurm, subprocess"):
        nbshard.submit(programs.rank_and_value, 1, nproc=1, backend="kubernetes")
