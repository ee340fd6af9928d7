"""The kernel side stays light, and module dependencies point one way."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import REPO

# DESIGN.md's layout: the root holds the contracts every side shares and imports no side; each
# side imports the root and its own modules, and these sides besides. The kernel and the
# processes never import each other. The front doors (the package, its pytest plugin, the shims
# for `python -m nbshard.worker` and `nbshard.launcher`, the public `nbshard.fsdp`) import any side.
SIDES_ALLOWED = {
    "root": set(),
    "kernel": {"backends"},
    "backends": {"process"},  # a node's launcher comes to life as a process nbshard starts
    "process": {"rank"},  # a rank runs the in-rank library (log_metrics' sampler)
    "rank": set(),
}
FRONT_DOORS = {"nbshard", "nbshard.testing", "nbshard.worker", "nbshard.launcher", "nbshard.fsdp", "nbshard.demo", "nbshard.__main__"}


def module_name(path) -> str:
    relative = path.relative_to(REPO).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def side_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SIDES_ALLOWED else "root"


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def nbshard_imports(path) -> set[str]:
    """Every nbshard module ``path`` imports, at the top or lazily inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nbshard":
            for alias in node.names:  # from nbshard.process import launcher: a module, or a name in one
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "nbshard")
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): nbshard_imports(path) - {module_name(path)} for path in sorted((REPO / "nbshard").rglob("*.py"))}


def test_each_side_imports_only_the_root_and_the_sides_the_design_allows():
    graph = import_graph()
    assert {"nbshard.contracts", "nbshard.kernel.client", "nbshard.process.launcher", "nbshard.rank.fsdp"} <= set(graph)
    for module, imports in graph.items():
        if module in FRONT_DOORS:
            continue
        side = side_of(module)
        allowed = {"root", side, *SIDES_ALLOWED[side]}
        wrong = sorted(i for i in imports if side_of(i) not in allowed or i in FRONT_DOORS - {"nbshard"} or i == "nbshard")
        wrong = [i for i in wrong if not (i.count(".") == 1 and i.split(".")[1] in SIDES_ALLOWED)]  # a side's package itself
        assert not wrong, f"{module} (the {side} side) imports {wrong}"


def test_no_module_imports_itself_back_lazy_imports_included():
    graph = import_graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(imported):], imported]))
            if imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_import_nbshard_imports_no_torch():
    code = (
        "import sys, nbshard, nbshard.process.launcher, nbshard.process.worker, nbshard.kernel.magic, nbshard.kernel.telemetry, nbshard.testing; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'lightning'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


def test_the_kernel_side_never_imports_the_launcher_or_worker_modules():
    # `python -m nbshard.launcher` would otherwise run a second copy of an already imported module
    # (runpy's RuntimeWarning at the top of every launcher.log).
    code = (
        "import sys, nbshard, nbshard.kernel.magic; print(sorted(m for m in sys.modules if m in "
        "('nbshard.launcher', 'nbshard.worker', 'nbshard.process.entry', 'nbshard.process.launcher', 'nbshard.process.worker')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
