"""``%%shard_train``: run a cell's body on N fresh ranks. ``%load_ext nbshard`` registers it.

Each cell is one job: the body runs in every rank, in a fresh namespace, as
plain Python. Names the body reads before assigning them are shipped from the
notebook (objects by value, modules as imports by name); ``--pull`` brings
names back. Works like ipyparallel's ``%%px``, on torchrun-style processes.
"""

from __future__ import annotations

import pickle
import types
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbshard.kernel import magic_input
from nbshard.kernel.cell import free_names, run_cell
from nbshard.kernel.client import submit
from nbshard.errors import short_traceback
from nbshard.kernel.handle import JobHandle
from nbshard.job import Job
from nbshard.kernel.persistent import Session, session, sessions
from nbshard.pickling import describe_unpicklable, find_unpicklable, is_notebook_code

__all__ = ["PullFailed", "ShardMagics", "load_ipython_extension"]

# Names IPython keeps in the user namespace for itself; never shipped.
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit"}


def _shown_execution_count(shell: Any) -> int:
    """The number the notebook shows for the running cell (``In [N]``).

    IPython 9 counts up before it runs a cell and IPython 8 after, so the
    shell's counter is off by one in one of them; the running cell's result
    holds the number that was shown.
    """
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(running, "execution_count", None)
    return count if isinstance(count, int) else shell.execution_count


@magics_class
class ShardMagics(Magics):
    @property
    def _shell(self) -> InteractiveShell:
        """The IPython shell that registered these magics (``Magics.shell`` is None only before)."""
        if self.shell is None:
            raise UsageError("nbshard's magics run in an IPython shell: %load_ext nbshard")
        return self.shell

    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=None, help="number of ranks per node (default: one per visible GPU, or 1)")
    @argument("--nnodes", type=int, default=1, help="number of nodes, each running --nproc ranks (default 1)")
    @argument("--gpus", default=None, help="comma-separated GPU indices or UUIDs the ranks see; '' hides every GPU")
    @argument("--backend", default="subprocess",
              help="how nodes start: subprocess (on this machine, the default) or ray (one Ray actor per node)")
    @argument("--timeout", type=float, default=None, help="seconds before the job is stopped")
    @argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL when stopping")
    @argument("--max-restarts", type=int, default=0, metavar="N",
              help="start every rank again after a failure, up to N times (TORCHELASTIC_RESTART_COUNT counts them)")
    @argument("--env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable for the ranks; repeatable")
    @argument("--push", action="append", default=[], metavar="NAMES", help="names to ship besides those detected (comma-separated)")
    @argument("--pull", action="append", default=[], metavar="NAMES", help="names to bring back into the notebook (comma-separated)")
    @argument("--pull-all", action="store_true", help="pull each name from every rank, as a list indexed by rank (default: rank 0)")
    @argument("--show-ranks", default=None, metavar="RANKS", help="comma-separated ranks whose output is shown live")
    @argument("--noblock", nargs="?", const="job", default=None, metavar="NAME",
              help="return at once; bind the job handle to NAME (default: job); pulled names are bound when it ends")
    @argument("--debug-ranks", default=None, metavar="RANKS",
              help="comma-separated ranks where breakpoint() stops and asks in the cell (default: every rank)")
    @argument("--profile", action="store_true",
              help="run under torch.profiler in every rank: each rank's top operators and trace file are shown at the end")
    @argument("--session", default=None, metavar="NAME",
              help="run in the persistent session NAME (started on first use): its ranks and their names stay between cells")
    @cell_magic
    def shard_train(self, line: str, cell: str) -> None:
        """Run this cell on N fresh torchrun-style ranks (FSDP, DDP), outside the kernel.

        The cell is plain Python run in every rank, in a fresh namespace where
        ``rank`` and ``world_size`` are set. Names it reads before assigning
        them are shipped from the notebook; ``--pull`` brings names back.

            %%shard_train --nproc 2 --pull losses
            model = MyModel(cfg)
            losses = train_loop(model, data)
        """
        args = magic_input.parse_line(self.shard_train, line)
        shell = self._shell
        magic_input.check_plain_python(shell, cell)
        pull = magic_input.parse_names(args.pull, "--pull")
        if args.session and args.nnodes != 1:
            raise UsageError("%%shard_train: a session runs on one node; drop --nnodes or --session")
        if args.session and args.profile:
            raise UsageError("%%shard_train: --profile profiles a job's ranks from start to end; a session's cells are "
                             "not profiled (drop --session, or use torch.profiler in the cell)")
        if args.session and args.debug_ranks:
            raise UsageError("%%shard_train: --debug-ranks is a session's setting (nbshard.session(NAME, debug_ranks=[1])); "
                             "in a session's cell, choose with `if rank == 1: breakpoint()`")
        if args.session and args.max_restarts:
            raise UsageError("%%shard_train: --max-restarts starts a failed job's ranks again; a session keeps its "
                             "ranks between cells (after a failure, %shard_session NAME --restart)")
        running = _session_of(args) if args.session else None
        job = self._job(args, line, cell, pull, running.names if running is not None else set())
        try:
            handle = running.submit(job) if running is not None else submit(job)
        except TypeError as error:
            unshippable = self._unshippable(job)
            if unshippable is None:
                raise
            raise unshippable from error
        if args.noblock:
            shell.user_ns[args.noblock] = handle
            handle.add_done_callback(lambda done: done.notes.extend(
                f"could not pull {reason}" for reason in self._bind_pulled(done, pull, args.pull_all)[1]
            ))
            handle.show_live()
            return
        handle.watch()
        exception = handle.exception()
        if exception is not None:
            raise exception.with_traceback(None)  # the cause holds the rank's traceback
        bound, reasons = self._bind_pulled(handle, pull, args.pull_all)
        if reasons:
            raise _pull_failed(reasons, bound)
        if bound:
            print(f"[nbshard]: {_pulled_note(bound, args.pull_all)}")

    def _job(self, args: Any, line: str, cell: str, pull: list[str], held: set[str]) -> Job:
        """The cell as a job; ``held``: names a session's ranks hold, which win over the
        notebook's (its functions, classes and modules, and ``--push`` names, are shipped)."""
        user_ns = self._shell.user_ns
        pushed = magic_input.parse_names(args.push, "--push")
        missing = [name for name in pushed if name not in user_ns]
        if missing:
            raise UsageError(f"--push {', '.join(missing)}: no such name in the notebook")
        wanted = sorted((free_names(cell) | set(pushed)) - _IPYTHON_NAMES)
        present = [
            n for n in wanted if n in user_ns and not n.startswith("_")
            and (n not in held or n in pushed or _is_code(user_ns[n]))
        ]
        modules = {n: user_ns[n].__name__ for n in present if isinstance(user_ns[n], types.ModuleType)}
        values = {n: user_ns[n] for n in present if n not in modules}
        # Registered in the kernel's linecache, so a rank's traceback shows the cell's lines,
        # the %%shard_train line first; the ranks run a blank line in its place.
        filename = self._shell.compile.cache(f"%%shard_train {line}".rstrip() + "\n" + cell, _shown_execution_count(self._shell))
        try:
            return Job(
                run_cell,
                kwargs={"source": "\n" + cell, "filename": filename, "values": values, "modules": modules,
                        "pull": pull, "pull_all": args.pull_all},
                nproc=args.nproc, gpus=magic_input.parse_gpus(args.gpus), env=magic_input.parse_env(args.env), backend=args.backend,
                timeout=args.timeout, return_all=args.pull_all, name="shard_train",
                show_ranks=magic_input.parse_ranks(args.show_ranks), debug_ranks=magic_input.parse_ranks(args.debug_ranks, "--debug-ranks"), max_restarts=args.max_restarts, nnodes=args.nnodes, profile=args.profile,
                **({"grace": args.grace} if args.grace is not None else {}),
            )
        except (ValueError, TypeError) as error:
            raise UsageError(f"%%shard_train: {error}") from None

    @staticmethod
    def _unshippable(job: Job) -> UsageError | None:
        """Which notebook variable could not be pickled, named as the notebook knows it."""
        for name, value in job.kwargs["values"].items():
            found = find_unpicklable(value, name)
            if found is not None:
                return UsageError(describe_unpicklable(found, f"Cannot ship the notebook's {name!r} to the ranks"))
        return None

    def _bind_pulled(self, handle: JobHandle, pull: list[str], pull_all: bool) -> tuple[list[str], list[str]]:
        """Assign every pulled name that arrived whole in the notebook (if the job succeeded);
        returns the names bound, and why each of the others could not be pulled."""
        if handle.exception() is not None or not pull:
            return [], []
        ranks = handle.result() if pull_all else [handle.result()]
        loaded: dict[str, list[Any]] = {name: [] for name in pull}
        failed: dict[str, str] = {}
        for rank, pulled in enumerate(ranks):
            for name, why in pulled["failed"].items():
                failed.setdefault(name, f"{why} (rank {rank})" if pull_all else why)
            for name, data in pulled["values"].items():
                try:
                    loaded[name].append(pickle.loads(data))
                except Exception as error:  # noqa: BLE001 - reported with the others
                    failed.setdefault(name, (
                        f"the pulled {name!r} arrived but cannot be loaded in the notebook: {error!r}. "
                        "Likely cause: it refers to a module or class the kernel cannot import. "
                        "Pull plain data (state_dict(), tensors, numbers) or import that module here."
                    ))
        bound = [name for name in pull if name not in failed]
        for name in bound:
            self._shell.user_ns[name] = loaded[name] if pull_all else loaded[name][0]
        if bound:
            handle.notes.append(_pulled_note(bound, pull_all))
        return bound, [f"{name}: {failed[name]}" for name in pull if name in failed]


    @magic_arguments()
    @argument("name", nargs="?", default="default", help="the session's name (default: default)")
    @argument("-n", "--nproc", type=int, default=None, help="number of ranks (default: one per visible GPU, or 1)")
    @argument("--gpus", default=None, help="comma-separated GPU indices or UUIDs the ranks see")
    @argument("--env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable for the ranks")
    @argument("--restart", action="store_true", help="stop the ranks and start new ones")
    @argument("--close", action="store_true", help="stop the ranks and free what they hold")
    @line_magic
    def shard_session(self, line: str) -> Any:
        """Start (or show) a persistent session that ``%%shard_train --session NAME`` cells run in.

            %shard_session llm --nproc 2
        """
        args = magic_input.parse_line(self.shard_session, line)
        if args.close and args.restart:
            raise UsageError("%shard_session: --restart and --close contradict each other; give one (--restart starts new ranks)")
        if args.close or args.restart:
            existing = next((s for s in sessions() if s.name == args.name), None)  # lost ones too
            if existing is None and args.close:
                raise UsageError(f"%shard_session: no running session named {args.name!r}")
            if existing is not None:
                existing.restart() if args.restart else existing.close()
                return existing
        args.session, args.backend, args.grace = args.name, "subprocess", None
        return _session_of(args)


    @magic_arguments()
    @argument("rank", nargs="?", type=int, default=None, help="the rank to debug (default: the first that raised)")
    @argument("--session", default=None, metavar="NAME", help="the session whose last call failed (default: the only one)")
    @line_magic
    def shard_debug(self, line: str) -> None:
        """pdb at the error of a session's last failed call, in one rank, answered in this cell.

            %shard_debug          # the first rank that raised
            %shard_debug 1 --session llm
        """
        args = magic_input.parse_line(self.shard_debug, line)
        running = sessions()
        if args.session is not None:
            running = [s for s in running if s.name == args.session]
        if len(running) != 1:
            names = ", ".join(repr(s.name) for s in sessions()) or "none"
            raise UsageError(
                f"%shard_debug debugs a session's last failed call: name the session with --session NAME "
                f"(this kernel's sessions: {names}). A job's ranks are gone once it failed: put breakpoint() "
                "in its code, or run it in a session."
            )
        try:
            running[0].debug(args.rank)
        except (ValueError, RuntimeError) as error:
            raise UsageError(f"%shard_debug: {error}") from None


def _is_code(value: Any) -> bool:
    """Functions, classes and modules of the notebook: shipped to a session every time (code one edits)."""
    return isinstance(value, types.ModuleType) or is_notebook_code(value)


def _session_of(args: Any) -> Session:
    """The session a cell names, started with the cell's options on first use."""
    options: dict[str, Any] = {"nproc": args.nproc, "gpus": magic_input.parse_gpus(args.gpus), "grace": args.grace}
    if args.env:
        options["env"] = magic_input.parse_env(args.env)
    if args.backend != "subprocess":
        options["backend"] = args.backend
    try:
        return session(args.session, **{k: v for k, v in options.items() if v is not None})
    except (ValueError, TypeError) as error:
        raise UsageError(f"--session {args.session}: {error}") from None


class PullFailed(Exception):
    """Some ``--pull`` names could not be brought back; the others were bound."""

    def _render_traceback_(self) -> list[str]:
        return short_traceback(self)


def _pulled_note(bound: list[str], pull_all: bool) -> str:
    return f"pulled {', '.join(bound)} into the notebook" + (" (each a list indexed by rank)" if pull_all else " (rank 0's)")


def _pull_failed(reasons: list[str], bound: list[str]) -> PullFailed:
    others = f"Pulled {', '.join(bound)} into the notebook. " if bound else ""
    return PullFailed(
        f"The job succeeded, but {len(reasons)} pulled name{'s' * (len(reasons) > 1)} could not be "
        f"brought back to the notebook. {others}\n" + "\n".join(f"  {reason}" for reason in reasons)
    )


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(ShardMagics)
