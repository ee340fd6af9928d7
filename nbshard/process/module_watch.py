"""Whether a module the warm process imported changed on disk, told in microseconds.

The warm process must not fork a launch from code that changed on disk since it imported it
(an upgrade, an edited helper). Stat'ing every imported file at each launch cost 12 ms with
lightning imported (3,600 files), on every launch's path. Instead the folders that hold them
are watched with inotify: the kernel queues an event when a file in them is written, renamed,
created, deleted or has its attributes changed, at the moment it happens, so at a launch only
the files named in the queued events are stat'ed again. Without inotify (another OS, the
watch limit reached) or after the event queue overflowed, every file is stat'ed, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import sys

__all__ = ["FileStamp", "ModuleWatch", "module_files", "stamp"]

FileStamp = tuple[int, int, int, int, int]

_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_Q_OVERFLOW = 0x400, 0x800, 0x4000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_CHANGES = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
            | _IN_DELETE_SELF | _IN_MOVE_SELF)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows


def stamp(path: str) -> FileStamp:
    """What changes whenever a file's content can have changed. Not mtime and size alone: an
    edit may keep both (a tool that restores the mtime); the inode's change time (ctime) is
    set by the kernel on every write and every mtime change, and cannot be set back, and a
    file replaced by a rename has a new inode."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def module_files() -> list[str]:
    """Every imported module's file."""
    paths = (getattr(module, "__file__", None) for module in list(sys.modules.values()))
    return [path for path in paths if isinstance(path, str) and os.path.isabs(path)]


class ModuleWatch:
    """An inotify watch on the folders of ``paths``, then each file's stamp: a change after the
    stamp is always in the queue (``use_inotify=False``: stat every file at each check)."""

    def __init__(self, paths: list[str], use_inotify: bool = True) -> None:
        self.suspects: set[str] = set()  # files named in events since the last check
        self.everything = True  # stat every file at the next check (no watch, or events were lost)
        self.folders: dict[int, str] = {}  # watch descriptor -> folder
        self.fd: int | None = None
        if use_inotify:
            with contextlib.suppress(OSError, AttributeError):
                self._watch({os.path.dirname(path) for path in paths})
                self.everything = False
        self.files: dict[str, FileStamp] = {}
        for path in paths:
            with contextlib.suppress(OSError):
                self.files[path] = stamp(path)

    def _watch(self, folders: set[str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.fd = fd
        for folder in sorted(folders):
            wd = libc.inotify_add_watch(fd, os.fsencode(folder), _CHANGES)
            if wd < 0:  # e.g. fs.inotify.max_user_watches reached: no half-watched tree
                self.close()
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")
            self.folders[wd] = folder

    def changed(self) -> str | None:
        """A file that changed since it was imported (or went), or None."""
        self._read_events()
        if self.fd is None or self.everything:
            checked = list(self.files)
        else:
            checked = sorted(self.suspects)
        for path in checked:
            try:
                if stamp(path) != self.files[path]:
                    return path
            except OSError:
                return path
        self.suspects.clear()
        self.everything = self.fd is None
        return None

    def _read_events(self) -> None:
        while self.fd is not None:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size:at + _EVENT.size + length].rstrip(b"\0")
                at += _EVENT.size + length
                if mask & (_IN_Q_OVERFLOW | _IN_DELETE_SELF | _IN_MOVE_SELF) or wd not in self.folders:
                    self.everything = True  # events lost, or a whole folder went: check every file
                elif name and (path := os.path.join(self.folders[wd], os.fsdecode(name))) in self.files:
                    self.suspects.add(path)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
