"""The contracts between the processes are types (DESIGN.md): a changed message, outcome or
launcher verb is found by the type checker. The package passes mypy as pyproject.toml configures it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_package_passes_the_type_checker():
    pytest.importorskip("mypy", reason="mypy is a test dependency: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "no issues found" in done.stdout, done.stdout
