"""The kernel side stays light, and module dependencies point one way."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import REPO

# Which nbshard modules each module may import (DESIGN.md's table).
ALLOWED = {
    "job": set(),
    "contracts": {"files"},
    "files": set(),
    "leftovers": {"procfs"},
    "procfs": set(),
    "wire": {"leftovers"},
    "errors": {"stacks"},
    "stacks": set(),
    "reaper": {"procfs"},
    "pickling": {"files"},
    "display": set(),
    "lines": set(),
    "dist": set(),
    "fsdp": {"checkpoints", "chunked", "dist", "host_memory"},
    "chunked": set(),
    "host_memory": set(),
    "checkpoints": set(),
    "gpus": set(),
    "monitor": {"files", "wire"},
    "telemetry": {"display"},
    "worker": {"contracts", "job", "files", "pickling", "wire", "monitor", "stacks", "fresh", "session_rank"},
    "session_rank": {"contracts", "files", "job", "monitor", "worker"},
    "session_launcher": {"contracts", "errors", "files", "job", "launcher", "ports", "session_rank"},
    "launcher": {"contracts", "attempts", "job", "files", "wire", "errors", "lines", "ports", "reaper", "forking", "fresh", "worker", "session_launcher"},
    "ports": set(),
    "attempts": {"contracts", "errors", "files", "job"},
    "fresh": {"procfs"},
    "forking": {"fresh"},
    "forkserver": {"files", "forking", "launcher"},
    "persistent": {"contracts", "backends", "client", "display", "errors", "files", "handle", "job", "pickling", "session_rank", "telemetry"},
    "backends": {"contracts", "attempts", "job", "backends", "errors", "files", "fresh", "leftovers", "ports", "procfs", "wire"},
    "outcome": {"contracts", "job", "files", "errors"},
    "backlog": set(),
    "handle": {"contracts", "job", "files", "wire", "errors", "backends", "backlog", "display", "outcome", "telemetry"},
    "client": {"contracts", "job", "files", "wire", "backends", "handle", "leftovers", "pickling", "gpus", "runs"},
    "runs": {"files", "job", "leftovers"},
    "testing": {"__init__"},
    "cell": {"pickling"},  # a rank pickles each pulled name on its own
    "magic": {"cell", "client", "errors", "handle", "job", "pickling", "persistent", "session_rank"},
    "__init__": {"client", "dist", "errors", "job", "magic", "gpus", "monitor", "persistent"},
}


def nbshard_imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "nbshard":
            found.update(alias.name for alias in node.names)  # from nbshard import launcher
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nbshard."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nbshard"):
                    parts = alias.name.split(".")
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def test_modules_import_only_what_the_design_allows():
    for path in sorted((REPO / "nbshard").rglob("*.py")):
        relative = path.relative_to(REPO / "nbshard")
        module = relative.parts[0] if len(relative.parts) > 1 else path.stem
        imports = nbshard_imports(path) - {module}
        assert imports <= ALLOWED[module], f"{relative} imports {imports - ALLOWED[module]}"


def test_import_nbshard_imports_no_torch():
    code = (
        "import sys, nbshard, nbshard.launcher, nbshard.worker, nbshard.magic, nbshard.telemetry, nbshard.testing; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'lightning'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


def test_the_kernel_side_never_imports_the_launcher_or_worker_modules():
    # `python -m nbshard.launcher` would otherwise run a second copy of an already imported module
    # (runpy's RuntimeWarning at the top of every launcher.log).
    code = "import sys, nbshard, nbshard.magic; print(sorted(m for m in sys.modules if m in ('nbshard.launcher', 'nbshard.worker')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
