"""Atomic files: the run directory is the source of truth, so no reader ever sees half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_atomic", "write_json"]


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=1).encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
