"""What a magic's line and cell must be, checked before anything starts: its flags parsed into
values (an unknown flag answered with the one meant), and a cell body that is plain Python."""

from __future__ import annotations

import keyword
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from nbshard.kernel.option_names import meant

__all__ = ["check_plain_python", "parse_env", "parse_gpus", "parse_line", "parse_names", "parse_ranks"]


def parse_line(magic: Any, line: str) -> Any:
    """The magic's arguments; an unknown flag is answered with the one it likely means."""
    try:
        return parse_argstring(magic, line)
    except UsageError as error:
        text = str(error)
        if not text.startswith("unrecognized arguments:"):
            raise
        flags = {flag[2:].replace("-", "_"): flag for action in magic.parser._actions for flag in action.option_strings
                 if flag.startswith("--")}
        hints = [f"{token} (did you mean {flags[guess]}?)" for token in text.split(":", 1)[1].split()
                 if token.startswith("-") and (guess := meant(token, flags))]
        raise UsageError("; ".join([text, *hints]) + f". The options: %{magic.__name__}?") from None


def parse_names(values: list[str], flag: str | None = None) -> list[str]:
    """``["a,b", "c"]`` (repeated options, commas or spaces) as ``["a", "b", "c"]``; with
    ``flag``, each must be a name a cell can assign (UsageError before anything starts)."""
    names = [name for value in values for name in value.replace(",", " ").split()]
    for name in names if flag else ():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"%%shard_train {flag} {name}: not a Python name a cell can assign (quotes are kept as typed: "
                             f"write {flag} a,b)")
    return names


def parse_gpus(text: str | None) -> tuple[int | str, ...] | None:
    if text is None:
        return None
    return tuple(int(g) if g.strip().isdigit() else g.strip() for g in text.split(",") if g.strip())


def parse_ranks(text: str | None, flag: str = "--show-ranks") -> list[int] | None:
    if text is None:
        return None
    names = parse_names([text])
    if not all(name.isdigit() for name in names):
        raise UsageError(f"{flag} takes rank numbers, e.g. 0 or 0,1; got {text!r}")
    return [int(name) for name in names]


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _compiles(source: str) -> None:
    """Compile ``source`` as a module (a SyntaxError where it is not one): beyond parsing, this
    finds what only the compiler refuses (``return``, ``yield`` or ``await`` outside a function)."""
    compile(source, "<cell>", "exec", dont_inherit=True)


def check_plain_python(shell: Any, body: str) -> None:
    """The body runs as plain Python in each rank: refuse IPython syntax, and code that is no
    module, before launching."""
    try:
        _compiles(body)
        return
    except SyntaxError as error:
        problem = error
    try:
        _compiles(shell.transform_cell(body))
    except SyntaxError:
        lines = body.splitlines()
        line = lines[problem.lineno - 1] if problem.lineno and problem.lineno <= len(lines) else ""
        where = (problem.lineno or 0) + 1  # as the notebook numbers it, after the %%shard_train line
        hint = ""
        if "'await' outside" in str(problem.msg):  # a notebook cell allows top-level await (IPython's autoawait)
            hint = ". The cell runs as a plain script in each rank: put the async code in an async def and run it with asyncio.run(...)"
        elif "outside function" in str(problem.msg):
            hint = ". The cell runs as a plain script in each rank: assign the value to a name and bring it back with --pull NAME"
        raise UsageError(f"%%shard_train: syntax error in cell line {where}: {problem.msg}{hint}\n    {line.strip()}") from None
    offending = next(
        (line.strip() for line in body.splitlines() if line.strip().startswith(("!", "%"))), "(IPython syntax)"
    )
    raise UsageError(
        f"%%shard_train runs the cell as plain Python in each rank, but it uses IPython syntax: "
        f"{offending!r}. Move shell commands and magics to another cell, or use subprocess / "
        "the function they stand for."
    )
