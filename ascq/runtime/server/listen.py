"""The listening socket, bound before anything heavy is imported or loaded (no torch here)."""

from __future__ import annotations

import socket

from ascq.core.errors import AscqError


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen on host:port now, before the model loads, so that a busy port fails in well under a second."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT from a previous run is fine
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise AscqError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server running?)"
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
