"""The README's user install, run as written in a fresh venv: the demo and the example notebooks work.

It downloads from PyPI and takes minutes, so it runs where ``NBSHARD_TEST_USER_INSTALL=1`` asks
for it (``.ci/run`` does). ``pip install torch`` is the one line not run as written: plain
``torch`` from PyPI is the multi-GB CUDA build; torch 2.13.0's CPU wheel stands in for it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(
    os.environ.get("NBSHARD_TEST_USER_INSTALL") != "1",
    reason="builds a fresh venv from PyPI (minutes): set NBSHARD_TEST_USER_INSTALL=1, as .ci/run does",
)
# One for each set of libraries the notebooks need (torch alone, transformers, litgpt); the main
# suite runs every notebook.
NOTEBOOKS = ["quickstart_ddp", "hf_causal_lm", "litgpt_lora"]
TORCH = "torch==2.13.0"  # the CPU wheel CI machines have, for the README's "pip install torch"


def user_install_block() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- user-install.*?-->\n```bash\n(.*?)```", readme, re.S)
    assert block, "the README's user install block (marked <!-- user-install -->) is missing"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    home = tmp_path_factory.mktemp("user")
    subprocess.run([sys.executable, "-m", "venv", str(home / "venv")], check=True, timeout=120)
    return home / "venv" / "bin"


def run(venv, command: list[str], cwd, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv.parent)}
    env.pop("PYTHONPATH", None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(1500)
def test_the_readme_user_install_runs_the_demo_and_the_notebooks(venv, tmp_path):
    lines = user_install_block()
    assert lines[0] == "pip install torch" and lines[-1] == "python -m nbshard demo", lines
    for line in lines:
        words = shlex.split(line)
        if line == "pip install torch":
            words = ["pip", "install", TORCH]
        assert words[0] in ("pip", "python"), line
        done = run(venv, [str(venv / words[0]), *words[1:]], REPO, 900)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "nbshard works." in done.stdout, done.stdout  # the demo, the block's last line
    assert "NumPy" not in done.stdout + done.stderr  # torch's "Failed to initialize NumPy" warning
    for name in NOTEBOOKS:
        shutil.copy(REPO / "notebooks" / f"{name}.ipynb", tmp_path)
        done = run(venv, [str(venv / "jupyter"), "nbconvert", "--to", "notebook", "--execute", "--inplace",
                          "--ExecutePreprocessor.timeout=300", f"{name}.ipynb"], tmp_path, 400)
        assert done.returncode == 0, f"{name}: {done.stderr[-4000:]}"
