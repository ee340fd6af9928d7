"""A notebook cell as a job: which names it needs from the notebook, and how a rank runs it.

``free_names`` is pure: it reads a cell's source and returns the names the
cell reads before (or without) assigning them, the ones the kernel must ship.
``run_cell`` is what each rank calls; it imports no IPython.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import linecache
import os
import sys
from typing import Any, cast

__all__ = ["free_names", "run_cell"]


class _Reads(ast.NodeVisitor):
    """Names an expression or a nested scope loads, minus those that scope binds itself."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.names.add(node.id)

    def _scope(self, bound: set[str], *parts: ast.AST) -> None:
        inner = _Reads()
        for part in parts:
            inner.visit(part)
        self.names |= inner.names - bound

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.args)  # defaults are evaluated outside
        self._scope(_parameters(node.args), node.body)

    def _comprehension(self, node: Any, *results: ast.AST) -> None:
        first, *rest = node.generators
        self.visit(first.iter)  # the first iterable is evaluated in the enclosing scope
        bound = set().union(*(_stores(g.target) for g in node.generators))
        self._scope(bound, *(g.target for g in node.generators), *(i for g in rest for i in [g.iter]),
                    *(c for g in node.generators for c in g.ifs), *results)

    def visit_ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> None:
        self._comprehension(node, node.elt)

    visit_SetComp = visit_ListComp
    visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._comprehension(node, node.key, node.value)


def _parameters(args: ast.arguments) -> set[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return {a.arg for a in every if a is not None}


_NESTED_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _stores(node: ast.AST) -> set[str]:
    """Names a statement or target binds in its own scope (not inside nested scopes)."""
    names: set[str] = set()
    pending = [node]
    while pending:
        child = pending.pop()
        if isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
            names.add(child.id)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in child.names}
        elif isinstance(child, ast.ExceptHandler) and child.name:
            names.add(child.name)
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)  # its body is a scope of its own
        elif not isinstance(child, _NESTED_SCOPES):
            pending.extend(ast.iter_child_nodes(child))
    return names


def _reads(*nodes: ast.AST | None) -> set[str]:
    visitor = _Reads()
    for node in nodes:
        if node is not None:
            visitor.visit(node)
    return visitor.names


def _function_reads(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """What defining the function reads now, and what its body reads from globals later."""
    outside = _reads(*node.decorator_list, node.args, node.returns)
    declared_global = {n for s in ast.walk(node) if isinstance(s, ast.Global) for n in s.names}
    local = (_parameters(node.args) | set().union(*(_stores(s) for s in node.body))) - declared_global
    return outside | (_block_reads(node.body, set()) - local)


def _statement_reads(statement: ast.stmt, bound: set[str]) -> set[str]:
    """Names ``statement`` reads that were not bound before it in the cell."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
        reads = _function_reads(statement)
    elif isinstance(statement, ast.ClassDef):
        reads = _reads(*statement.decorator_list, *statement.bases, *statement.keywords)
        reads |= _block_reads(statement.body, set())  # class bodies read globals they do not bind
    elif isinstance(statement, (ast.For, ast.AsyncFor)):
        reads = _reads(statement.iter) | _reads(statement.target)  # subscripts in targets
        reads |= _block_reads(statement.body + statement.orelse, bound | _stores(statement.target))
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        reads = _reads(*(item.context_expr for item in statement.items))
        targets = set().union(*(_stores(i.optional_vars) for i in statement.items if i.optional_vars))
        reads |= _block_reads(statement.body, bound | targets)
    elif isinstance(statement, (ast.If, ast.While)):
        reads = _reads(statement.test) | _block_reads(statement.body, bound) | _block_reads(statement.orelse, bound)
    elif isinstance(statement, ast.Try) or type(statement).__name__ == "TryStar":
        statement = cast(ast.Try, statement)  # a TryStar (Python 3.11: except*) has the same fields
        reads = _block_reads(statement.body, bound)
        for handler in statement.handlers:
            reads |= _reads(handler.type)
            reads |= _block_reads(handler.body, bound | ({handler.name} if handler.name else set()))
        reads |= _block_reads(statement.orelse + statement.finalbody, bound | _stores(statement))
    elif isinstance(statement, ast.AugAssign):
        reads = _reads(statement.value, statement.target) | _stores(statement.target)
    else:
        reads = _reads(statement)
    return reads - bound


def _block_reads(statements: list[ast.stmt], bound: set[str]) -> set[str]:
    bound = set(bound)
    reads: set[str] = set()
    for statement in statements:
        reads |= _statement_reads(statement, bound)
        bound |= _stores(statement)
    return reads


def free_names(source: str) -> set[str]:
    """Names the cell reads before (or without) assigning them, builtins excluded."""
    return _block_reads(ast.parse(source).body, set()) - set(dir(builtins))


def _pickled_each(namespace: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Each pulled name pickled on its own, so one that cannot travel costs only itself:
    ``{"values": {name: bytes}, "failed": {name: why}}``."""
    from nbshard.results import dump_result

    pulled: dict[str, Any] = {"values": {}, "failed": {}}
    for name in names:
        if name not in namespace:  # the cell ran to its end: what it did is kept, only this name is missing
            pulled["failed"][name] = "the cell never assigned it in this rank (assign it in every rank, None is fine)"
            continue
        try:
            pulled["values"][name] = dump_result(namespace[name], path=f"the pulled {name!r}")
        except TypeError as error:
            pulled["failed"][name] = str(error)
    return pulled


def run_cell(
    source: str, filename: str, values: dict[str, Any], modules: dict[str, str], pull: list[str], pull_all: bool
) -> dict[str, Any] | None:
    """Run a cell's source in this rank's fresh ``__main__``; return the pulled names
    (each pickled on its own, see ``_pickled_each``).

    ``modules`` maps names to module names imported here; ``values`` are the
    notebook objects shipped by value. ``rank`` and ``world_size`` are at hand.
    """
    namespace = vars(sys.modules["__main__"])
    namespace.update({alias: importlib.import_module(module) for alias, module in modules.items()})
    namespace.update(values)
    namespace["rank"] = int(os.environ["RANK"])
    namespace["world_size"] = int(os.environ["WORLD_SIZE"])
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # pdb's `list` in a rank
    exec(compile(source, filename, "exec"), namespace)
    if namespace["rank"] == 0 or pull_all:
        return _pickled_each(namespace, pull)
    return None
