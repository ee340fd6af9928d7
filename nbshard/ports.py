"""A free TCP port for a rendezvous (torch's TCPStore binds on every interface)."""

from __future__ import annotations

import socket

__all__ = ["pick_port"]


def pick_port(preferred: int | None = None) -> int:
    """``preferred`` when it is free, else a free port chosen by the OS."""
    for port in (preferred, 0) if preferred else (0,):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise RuntimeError("no free TCP port on this machine")
