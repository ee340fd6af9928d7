"""Atomic files and private directories: the run directory is the source of truth, so no
reader ever sees half a file, and the kernel reads only a directory it made and still holds.

Every file and directory nbshard makes has an explicit private mode (0600, 0700), whatever
the umask: a run's files stay this user's even under ``umask 000``."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "OpenedDir", "RunDirReplaced", "identity", "make_private_dirs", "mkdir_private", "open_private", "read_json",
    "write_atomic", "write_atomic_with", "write_json",
]

_OPEN_FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def open_private(path: Path | str, mode: str = "wb", **options: Any) -> Any:
    """``open(path, mode)`` for writing (``"w"``/``"a"``/``"x"``, text or binary) that creates the file
    with mode 0600, not the umask's; ``options`` go to ``open`` (``buffering``, ``encoding``)."""
    fd = os.open(path, _OPEN_FLAGS[mode[0]] | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, mode, **options)


def mkdir_private(path: Path, exist_ok: bool = False) -> None:
    """``mkdir -p`` where every directory it makes, parents included, has mode 0700."""
    missing = []
    for directory in (path, *path.parents):
        if os.path.lexists(directory):
            break
        missing.append(directory)
    if not missing and not exist_ok:
        raise FileExistsError(f"{path} exists")
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place."""
    write_atomic_with(path, lambda file: file.write(data), mode)


def write_atomic_with(path: Path, write: Callable[[Any], object], mode: int = 0o600, keep_small: int | None = None) -> bytes | None:
    """``write(file)`` into a temporary file beside ``path``, then rename it into place
    (for large data written as it is made, never held whole). With ``keep_small``: while what is
    written fits in that many bytes it is only kept in memory, and returned instead of a file
    made (None where the file was written)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    sink = _SmallOrFile(keep_small, lambda: os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb"))
    try:
        write(sink)
        small = sink.close()
    except BaseException:
        sink.close()
        temporary.unlink(missing_ok=True)
        raise
    if small is None:
        os.replace(temporary, path)
    return small


class _SmallOrFile:
    """A binary sink that holds what it is given up to ``limit`` bytes, then moves it to the
    file ``open_file()`` makes and writes there (``limit`` None: the file at once)."""

    def __init__(self, limit: int | None, open_file: Callable[[], Any]) -> None:
        self.limit, self.open_file = limit, open_file
        self.kept = bytearray()
        self.file = open_file() if limit is None else None

    def write(self, data: bytes) -> int:
        if self.file is None:
            if len(self.kept) + len(data) <= self.limit:  # type: ignore[operator]
                self.kept += data
                return len(data)
            self.file = self.open_file()
            self.file.write(self.kept)
            self.kept = bytearray()
        return self.file.write(data)

    def close(self) -> bytes | None:
        """What was kept (no file was made), or None once the file is closed."""
        if self.file is None:
            return bytes(self.kept)
        self.file.close()
        return None


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=1).encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _unsafe_because(path: Path, st: os.stat_result, last: bool) -> str | None:
    """Why another local user could replace what ``path`` holds, or None."""
    me = os.geteuid()
    if st.st_uid not in (me, 0) or (last and st.st_uid != me):
        return f"{path} belongs to another user (uid {st.st_uid})"
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and (last or not st.st_mode & stat.S_ISVTX):  # /tmp's sticky bit protects entries
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def make_private_dirs(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700, and check that no other local user
    can swap it or anything above it; ``PermissionError`` that says why and what to do."""
    path = Path(os.path.abspath(path))
    mkdir_private(path, exist_ok=True)
    real = Path(os.path.realpath(path))
    for component in (real, *real.parents):
        problem = _unsafe_because(component, os.lstat(component), last=component == real)
        if problem is not None:
            raise PermissionError(
                f"nbshard will not keep runs in {path}: {problem}. Another local user could then "
                "replace a run's files and have this kernel load them. Use a directory of your own: "
                "unset NBSHARD_RUNS_DIR (the default is ~/.cache/nbshard/runs) or point it, or "
                "nbshard.settings.runs_dir, at a directory only you can write (chmod go-w)."
            )


def identity(path: Path) -> tuple[int, int]:
    """What tells a directory from another one put at the same path later."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


class RunDirReplaced(OSError):
    """The run directory at the path is no longer the one the kernel made."""


class OpenedDir:
    """A directory opened once, checked to be the one expected, and read through its descriptor,
    so a directory renamed into its place is never read, nor a link inside it followed."""

    def __init__(self, path: Path, expected: tuple[int, int]) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            raise RunDirReplaced(f"the run directory {path} is gone or was replaced ({error.strerror})") from None
        st = os.fstat(self._fd)
        if (st.st_dev, st.st_ino) != expected or st.st_uid != os.geteuid():
            os.close(self._fd)
            raise RunDirReplaced(
                f"the run directory {path} was replaced while the job ran (renamed away and another put "
                "in its place), so nbshard loads nothing from it. Keep runs in a directory only you can write."
            )

    def __enter__(self) -> OpenedDir:
        return self

    def __exit__(self, *_: object) -> None:
        os.close(self._fd)

    def exists(self, path: Path) -> bool:
        try:
            os.stat(path.name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def open(self, path: Path) -> Any:
        """A file of this directory (by name), opened for reading without following links."""
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd)
        return os.fdopen(fd, "rb")

    def read_bytes(self, path: Path) -> bytes:
        with self.open(path) as file:
            return file.read()

    def read_json(self, path: Path) -> Any:
        return json.loads(self.read_bytes(path))

    def unlink(self, path: Path) -> None:
        os.unlink(path.name, dir_fd=self._fd)
