"""The benchmark scripts refer only to what nbshard has: most run where tests do not (a GPU, a
several-minute run), and a name renamed under them would fail there first."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_benchmarks_nbshard_imports_exist(script: Path) -> None:
    missing = []
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nbshard":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{node.module}.{alias.name} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nbshard":
                    importlib.import_module(alias.name)
    assert not missing, f"{script.name} imports what nbshard does not have: {missing}"


def test_the_benchmarks_are_found() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS
