"""`ascq serve MODEL` for the clients: started on loopback, and on every way out stopped together with every
process it started (the engine core and its workers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from ascq.runtime.server.launcher import launch_server, stop_server


@contextmanager
def serving(model: str, port: int | None, log_path: Path) -> Iterator[str]:
    """Yields the server's base URL (`http://127.0.0.1:PORT`) once /health answers."""
    process, base_url = launch_server(model, log_path, port=port)
    children = psutil.Process(process.pid).children(recursive=True)
    try:
        yield base_url
    finally:
        children += [c for c in _children(process.pid) if c not in children]
        stop_server(process)
        for child in children:
            if child.is_running():
                child.kill()
        psutil.wait_procs(children, timeout=10)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
