"""The opt-in pytest plugin, used the way a user would: in a separate pytest run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, pythonpath

pytestmark = pytest.mark.timeout(180)


def run_pytest(tmp_path, test_source, *args):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(test_source))
    env = dict(os.environ, PYTHONPATH=pythonpath(REPO))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170,
    )


USER_TESTS = """
    import os

    def allreduce_rank_sum():
        import torch, torch.distributed as dist, nbshard
        assert nbshard.init_process_group() == "gloo"
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value)
        return value.item(), os.environ["CUDA_VISIBLE_DEVICES"]

    def test_sum(run_on_ranks):
        assert run_on_ranks(allreduce_rank_sum, nproc=2) == [(1.0, ""), (1.0, "")]

    def fails_on_rank_1():
        if os.environ["RANK"] == "1":
            raise RuntimeError("diverged")

    def test_failure_is_reported(run_on_ranks):
        import nbshard, pytest
        with pytest.raises(nbshard.JobFailed, match="rank 1 raised RuntimeError: diverged"):
            run_on_ranks(fails_on_rank_1, nproc=2)
"""


def test_the_plugin_runs_user_functions_on_cpu_ranks(tmp_path):
    result = run_pytest(tmp_path, USER_TESTS, "-p", "nbshard.testing")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_the_plugin_is_not_loaded_unless_asked(tmp_path):
    result = run_pytest(tmp_path, USER_TESTS)
    assert "fixture 'run_on_ranks' not found" in result.stdout


def test_loading_the_plugin_imports_no_torch(tmp_path):
    source = """
        import sys

        def test_no_torch():
            assert "torch" not in sys.modules
    """
    result = run_pytest(tmp_path, source, "-p", "nbshard.testing")
    assert result.returncode == 0, result.stdout + result.stderr
