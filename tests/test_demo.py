"""``python -m nbshard demo``: a new user's second command runs a sharded job end to end."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.timeout(180)
def test_the_demo_trains_a_sharded_model_and_says_what_it_did(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "nbshard", "demo", "--steps", "12"], cwd=tmp_path, capture_output=True, text=True,
        timeout=150, stdin=subprocess.DEVNULL,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "[rank0]: step  0  loss" in out and "[rank0]: step 11  loss" in out  # streamed as it ran
    assert "nbshard works." in out and "this process imported no torch" in out
    total, *shards = map(lambda n: int(n.replace(",", "")), re.search(
        r"only its shard of the ([\d,]+) parameters \(rank 0 ([\d,]+), rank 1 ([\d,]+)\)", out).groups())
    assert sum(shards) == total and max(shards) < 0.6 * total  # each rank held about half
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < 0.5 * first  # it trained
    assert re.search(r"save_full wrote one plain checkpoint from rank 0 \(\d+ KiB", out)
    assert "README" in out  # and where to go next


def test_python_m_nbshard_without_a_command_says_how_to_use_it():
    done = subprocess.run([sys.executable, "-m", "nbshard"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "usage: python -m nbshard demo" in done.stderr
