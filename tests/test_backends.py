"""A backend is one function and one registry line (backends/base.py says what it must do)."""

from __future__ import annotations

import pytest

import nbshard
import programs
from nbshard.backends import BACKENDS, NodeLauncher, get_backend, register_backend
from nbshard.backends.local import start_cold
from nbshard.backends.relay import importable_env
from nbshard.contracts import LaunchSpec

pytestmark = pytest.mark.timeout(120)


def test_a_registered_backend_runs_jobs_through_the_one_launcher():
    seen: list[tuple[int, bool]] = []

    def start_recorded(run_dir, env, cwd, *, preload=None):
        """A minimal backend: read the launch spec, start nbshard's launcher cold, return it."""
        spec = LaunchSpec.read(run_dir.launch)
        launcher = start_cold(run_dir, importable_env(env), cwd)
        seen.append((spec.world_size, isinstance(launcher, NodeLauncher)))
        return launcher

    register_backend("recorded", start_recorded)
    try:
        assert nbshard.run(programs.rank_and_value, 3, nproc=2, backend="recorded", return_all=True) == [0, 3]
    finally:
        del BACKENDS["recorded"]
    assert seen == [(2, True)]
    with pytest.raises(ValueError, match="unknown backend 'recorded'; available: ray, slurm, subprocess"):
        get_backend("recorded")


class NodeWithABug:
    """A third-party backend's node that ended, but whose outcome() raises."""

    def poll(self):
        return 0

    def lost(self):
        return None

    def outcome(self):
        raise RuntimeError("the backend's own bug")

    def request(self, command):
        pass

    def kill(self):
        pass

    def close(self):
        pass

    def bring_home(self, run_dir):
        pass

    def live_log(self, rank):
        return b""


def test_a_backend_whose_node_raises_fails_the_job_with_that_error():
    from nbshard.backends.nodes import NodeGroup

    def start_buggy(run_dir, env, cwd, *, preload=None):
        spec = LaunchSpec.read(run_dir.launch)
        return NodeGroup(run_dir, [NodeWithABug() for _ in range(spec.nnodes)], spec.nproc_per_node, spec.address)

    register_backend("buggy", start_buggy)
    try:
        with pytest.raises(nbshard.JobFailed, match=r"(?s)supervising the nodes failed: RuntimeError: the backend's own bug.*"
                                                     r"Likely cause: a bug in the backend that started the nodes"):
            nbshard.run(programs.rank_and_value, 3, nproc=1, nnodes=2, backend="buggy", timeout=30)
    finally:
        del BACKENDS["buggy"]


def test_a_backend_needs_a_name_and_a_function():
    with pytest.raises(ValueError, match="non-empty string"):
        register_backend("", print)
    with pytest.raises(TypeError, match="must be callable"):
        register_backend("x", "not a function")
