"""A process's fields from ``/proc/PID/stat``, read in one place (see proc(5))."""

from __future__ import annotations

__all__ = ["stat_fields"]


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields after the command name (which may hold spaces and parentheses): state first,
    then the parent's pid, the process group, ... (field 3 of proc(5) is index 0 here). None
    when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
