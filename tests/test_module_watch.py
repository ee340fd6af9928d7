"""The warm process's check that no imported module changed on disk: inotify, and the stat
fallback, catch the same edits (tests/test_warm.py checks it through real launches)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nbshard.process.module_watch import ModuleWatch


def _modules(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "pkg").mkdir()
    first, second = tmp_path / "one.py", tmp_path / "pkg" / "two.py"
    first.write_text("VALUE = 'old'\n")
    second.write_text("OTHER = 1\n")
    return first, second


def _edit_keeping_size_and_mtime(path: Path) -> None:
    before = os.stat(path)
    path.write_text(path.read_text().replace("old", "NEW"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("use_inotify", [True, False])
def test_every_kind_of_change_is_seen(tmp_path: Path, use_inotify: bool) -> None:
    first, second = _modules(tmp_path)
    watches: list[ModuleWatch] = []

    def watching() -> ModuleWatch:
        watches.append(ModuleWatch([str(first), str(second)], use_inotify=use_inotify))
        return watches[-1]

    watch = watching()
    try:
        assert (watch.fd is not None) == use_inotify  # this machine has inotify: the fast path is what runs
        assert watch.changed() is None
        (tmp_path / "notes.txt").write_text("not a module")  # a file beside the modules is no change
        assert watch.changed() is None
        _edit_keeping_size_and_mtime(first)
        assert watch.changed() == str(first)

        watch = watching()
        replacement = tmp_path / "pkg" / "two.py.new"
        replacement.write_text("OTHER = 2\n")
        os.replace(replacement, second)  # an upgrade renames new files into place
        assert watch.changed() == str(second)

        watch = watching()
        second.unlink()
        assert watch.changed() == str(second)
    finally:
        for each in watches:
            each.close()


def test_a_folder_moved_away_is_a_change(tmp_path: Path) -> None:
    first, second = _modules(tmp_path)
    watch = ModuleWatch([str(first), str(second)])
    try:
        assert watch.changed() is None
        os.rename(tmp_path / "pkg", tmp_path / "pkg-old")
        assert watch.changed() == str(second)
    finally:
        watch.close()
