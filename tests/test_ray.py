"""backend="ray": one Ray actor per node starts nbshard's launcher there. A real local Ray
cluster of two nodes (two raylets on this machine), on loopback only."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import signal
import time

import pytest

# Before Ray is imported: Ray then gives its nodes the loopback address (not this machine's
# network address), so the tests' traffic, the ranks' rendezvous included, stays on 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# How long Ray's client server keeps a vanished Ray Client driver's actors (30 s by default).
os.environ["RAY_CLIENT_RECONNECT_GRACE_PERIOD"] = "3"
# Ray's client proxy forks each client's server with gRPC's fork handlers on, and that server
# intermittently aborts in them (ray-project/ray#63202): a lost 30 s and a reconnect in the Ray
# Client test, most runs here. Its server is exec'd at once and needs no fork handlers.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
ray = pytest.importorskip("ray", reason="backend='ray' is optional: pip install 'nbshard[ray]'")

import nbshard  # noqa: E402
import node_checks  # noqa: E402
import programs  # noqa: E402
from conftest import left_after, node_launcher, parent_of, processes_of_run, run_gone_within, wait_for_ranks  # noqa: E402
from nbshard.backends.relay import node_environment  # noqa: E402
from test_nodes import node_environment as environment_of_a_rank  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from nbshard.ports import pick_port

    head = {"num_cpus": 1, "include_dashboard": False}
    if importlib.util.find_spec("grpc") is not None:  # ray[client]: a client server for the Ray Client test
        head["ray_client_server_port"] = pick_port()
    started = Cluster(initialize_head=True, head_node_args=head)
    started.client_port = head.get("ray_client_server_port")
    started.add_node(num_cpus=1)
    ray.init(address=started.address, log_to_driver=False)
    yield started
    nbshard.cancel_all()  # a job a failed test left running must not hold the cluster
    ray.shutdown()
    started.shutdown()


def test_each_node_runs_its_ranks_with_the_multi_node_environment(cluster, capsys):
    handle = nbshard.submit(environment_of_a_rank, nproc=1, nnodes=2, backend="ray", return_all=True)
    handle.watch()
    envs = handle.result()
    assert [(e["RANK"], e["GROUP_RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0", "0"), ("1", "1", "0")]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and all(e["sum"] == 1.0 for e in envs)
    shown = capsys.readouterr().out
    assert "[rank1]: rank 1 of 2 on node 1" in shown  # streamed live through the node's actor
    assert "rank 1 of 2 on node 1" in handle.logs(1)  # and the log came home
    assert sorted(handle.peak_memory()) == [0, 1]  # samples relayed from both nodes
    assert handle.run_dir.name not in " ".join(glob.glob("/tmp/nbshard-node-*/*"))  # node directories removed


def test_a_failure_on_one_node_stops_the_other_and_leads_the_error(cluster):
    node_checks.a_failure_on_node_1_stops_node_0_and_leads_the_error("ray")


def test_cancel_stops_every_node_within_5_seconds(cluster):
    node_checks.cancel_stops_every_node_within_5_seconds("ray")


def test_a_node_whose_actor_dies_is_lost_and_named_first(cluster):
    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend="ray")
    wait_for_ranks(handle, 2)
    ray.kill(handle._launcher.nodes[1].actor)
    with pytest.raises(nbshard.JobFailed) as caught:
        handle.result(timeout=60)
    assert str(caught.value).startswith("The job failed because node 1 was lost: its Ray actor died")
    assert caught.value.failures[0].rank == 1
    assert run_gone_within(handle.run_dir.name, 5)


def test_a_killed_kernel_takes_every_actor_launcher_and_rank_along(cluster, script):
    kernel = script(
        f"""
        import os
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray, nbshard, programs
        ray.init(address={cluster.address!r}, log_to_driver=False)
        handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend="ray")
        print("run", handle.run_dir.name, flush=True)
        handle.watch()
        """
    )
    run_id = kernel.wait_for("run ").split()[1]
    kernel.wait_for("ready")
    kernel.wait_for("ready")
    assert len(processes_of_run(run_id)) == 4
    kernel.process.send_signal(signal.SIGKILL)
    assert run_gone_within(run_id, 5), "a launcher or rank outlived the kernel"  # Ray kills the driver's actors


def processes_marked(mark: str) -> list[int]:
    """Processes whose environment holds ``NBSHARD_TEST_MARK=mark`` (what a script started, and
    what that started: Ray's own processes included)."""
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and f"NBSHARD_TEST_MARK={mark}".encode() in open(f"/proc/{entry}/environ", "rb").read().split(b"\0"):
                found.append(int(entry))
    return found


def test_a_kernel_that_exits_during_a_job_on_the_ray_nbshard_started_leaves_nothing_behind(script):
    # nbshard imports Ray and starts a local one (RAY_ADDRESS=local: not the tests' cluster); Ray's
    # exit handler then comes after nbshard's, and must not shut Ray down before the job is stopped.
    mark = f"ray-exit-{os.getpid()}-{time.monotonic_ns()}"
    kernel = script(
        f"""
        import os
        os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_ADDRESS="local", NBSHARD_TEST_MARK={mark!r})
        import nbshard, programs
        import time
        handle = nbshard.submit(programs.sleep_forever, "ready", nproc=1, nnodes=1, backend="ray")
        while "ready" not in handle.logs(0):
            time.sleep(0.1)
        print("exiting", handle.status, flush=True)  # the kernel exits while the job runs
        """
    )
    assert kernel.wait_for("exiting", timeout=150).split()[1] == "running"
    code, output = kernel.finish(timeout=60)
    assert code == 0 and "Traceback" not in output, output  # was: a new local Ray, a traceback, a segfault
    left = left_after(15, lambda: processes_marked(mark))
    assert not left, f"left running: {left}"


def test_ray_shut_down_under_a_running_job_fails_it_at_once_and_starts_no_other_ray(cluster, script):
    kernel = script(
        f"""
        import os, time
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray, nbshard, programs
        ray.init(address={cluster.address!r}, log_to_driver=False)
        handle = nbshard.submit(programs.sleep_forever, "ready", nproc=1, nnodes=1, backend="ray")
        while "ready" not in handle.logs(0):
            time.sleep(0.1)
        print("run", handle.run_dir.name, flush=True)
        ray.shutdown()
        started = time.monotonic()
        error = handle.exception(timeout=30)
        print("ended", round(time.monotonic() - started, 1), "ray", ray.is_initialized(), flush=True)
        print(str(error).splitlines()[0], flush=True)
        """
    )
    run_id = kernel.wait_for("run ", timeout=120).split()[1]
    _, seconds, _, initialized = kernel.wait_for("ended ", timeout=60).split()
    assert float(seconds) < 5 and initialized == "False"  # was: never ended, and a new local Ray started
    code, output = kernel.finish(timeout=30)
    assert code == 0 and "connection to the Ray its actor runs in ended (ray.shutdown()" in output, output
    assert "other nodes" not in output  # the job's one node was the lost one
    assert run_gone_within(run_id, 10), "the job's launcher or rank outlived the driver that owned its actor"


def test_nodes_that_cannot_be_placed_are_a_clear_error(cluster):
    with pytest.raises(RuntimeError, match="Ray could not place 3 node"):
        nbshard.submit(print, nproc=1, nnodes=3, backend="ray", backend_options={"place_timeout": 2})
    with pytest.raises(ValueError, match="unknown num_gpu; known"):
        nbshard.submit(print, nproc=1, backend="ray", backend_options={"num_gpu": 1})


def test_breakpoint_in_a_local_rank_is_nbshards_after_ray_init_in_the_kernel(cluster):
    # ray.init() points the kernel's breakpoint() at Ray's driver debugger; a local rank
    # inherited it, and its breakpoint() raised AttributeError inside Ray.
    if not os.environ.get("PYTHONBREAKPOINT", "").startswith("ray.util.rpdb."):
        pytest.skip("this Ray does not set the kernel's PYTHONBREAKPOINT")
    assert nbshard.run(programs.pass_a_breakpoint, nproc=1, timeout=60) == "went on"


def test_breakpoint_in_a_rank_on_a_ray_node_is_nbshards(cluster):
    # Ray points every actor's breakpoint() at its own debugger; a rank its node launcher
    # starts is no Ray worker, and takes nbshard's (the kernel's prompt, or, with nobody to answer, it goes on).
    assert nbshard.run(programs.pass_a_breakpoint, nproc=1, nnodes=2, backend="ray", timeout=60, return_all=True) == ["went on"] * 2


def test_only_the_allow_listed_part_of_the_kernels_environment_travels():
    kernel = {"HOME": "/home/me", "PATH": "/bin", "NCCL_DEBUG": "INFO", "HF_HOME": "/data/hf", "SECRET": "x", "MY_FLAG": "1"}
    assert node_environment(kernel, {"EXTRA": "2"}, ("MY_",)) == {
        "NCCL_DEBUG": "INFO", "HF_HOME": "/data/hf", "MY_FLAG": "1", "EXTRA": "2",
    }


def test_kept_actors_serve_the_next_job_and_are_freed_on_request(cluster):
    from nbshard.backends.ray import release_kept

    options = {"keep": True}
    first = nbshard.submit(programs.rank_and_value, 3, nproc=1, nnodes=2, backend="ray", backend_options=options, return_all=True)
    assert first.result(timeout=120) == [0, 3]
    second = nbshard.submit(programs.rank_and_value, 5, nproc=1, nnodes=2, backend="ray", backend_options=options, return_all=True)
    assert second.result(timeout=120) == [0, 5]
    actors = [node.actor for node in second._launcher.nodes]
    assert [a._actor_id for a in actors] == [node.actor._actor_id for node in first._launcher.nodes]
    release_kept()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].where.remote(), timeout=30)


def test_a_frozen_node_is_lost_after_its_heartbeat(cluster):
    handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend="ray", backend_options={"heartbeat": 3})
    try:
        actor_pid = parent_of(node_launcher(handle.run_dir.name, 1))
        os.kill(actor_pid, signal.SIGSTOP)  # the node's actor stops answering; its launcher and rank run on
        try:
            with pytest.raises(nbshard.JobFailed) as caught:
                handle.result(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(actor_pid, signal.SIGCONT)
    finally:
        if not handle.done():  # a failure here must not keep the cluster's CPUs from the next tests
            handle.kill()
            handle.exception(timeout=30)
    assert "node 1 was lost: its Ray actor did not answer for 3 s" in str(caught.value)
    assert run_gone_within(handle.run_dir.name, 5)


def test_a_failure_restarts_every_node_on_the_same_actors(cluster, tmp_path):
    import restart_jobs

    handle = nbshard.submit(restart_jobs.train_with_checkpoints, str(tmp_path), 6, 3, 1, 1,
                            nproc=1, nnodes=2, backend="ray", max_restarts=1)
    assert handle.result(timeout=120) == {"step": 6, "total": 42.0, "resumed_from": 3, "restart_count": 1, "max_restarts": 1}
    assert handle.attempts[0].cause == "on rank 1: RuntimeError: boom at step 3 in attempt 0"
    log = handle.logs(1)  # both attempts' lines came home from the node
    assert log.index("attempt 0 starts at step 0") < log.index("[nbshard] attempt 1 failed") < log.index("attempt 1 starts at step 3")
    assert run_gone_within(handle.run_dir.name, 5)


def test_a_kernel_on_ray_client_runs_jobs_and_its_death_takes_the_nodes_along(cluster, script):
    if cluster.client_port is None:
        pytest.skip("Ray Client needs ray[client] (grpcio)")
    kernel = script(
        f"""
        import os, time
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray, nbshard, programs
        for attempt in range(3):
            try:
                ray.init("ray://127.0.0.1:{cluster.client_port}")
                break
            except ConnectionAbortedError:  # on a loaded machine Ray's proxy may fail to start the client's
                if attempt == 2:            # own server ("Starting Ray client server failed"): connect again
                    raise
                time.sleep(1)
        print("values", nbshard.run(programs.rank_and_value, 7, nproc=1, nnodes=2, backend="ray", return_all=True), flush=True)
        handle = nbshard.submit(programs.wait_in_collective, nproc=1, nnodes=2, backend="ray")
        print("run", handle.run_dir.name, flush=True)
        handle.watch()
        """
    )
    assert kernel.wait_for("values ", timeout=120).strip().endswith("[0, 7]")
    run_id = kernel.wait_for("run ").split()[1]
    kernel.wait_for("ready")
    kernel.wait_for("ready")
    kernel.process.kill()
    # Ray's client server keeps a lost client's actors for its reconnect grace period (3 s here),
    # then Ray kills them; on a busy 2-core machine that takes a few seconds more.
    assert run_gone_within(run_id, 3 + 12), f"outlived the kernel and the grace period: {processes_of_run(run_id)}"
