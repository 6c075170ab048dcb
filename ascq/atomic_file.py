"""The one atomic file replacement of ascq: write beside the target, then rename over it, so a reader (or a
concurrent writer) sees the old file or the new one, never a half-written one."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from ascq.core.errors import AscqError


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` (unique per process and thread) to write; it replaces `path` when the
    block succeeds, else it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically; an OSError becomes a one-line AscqError."""
    try:
        with atomic_output(Path(path)) as tmp:
            tmp.write_bytes(data)
    except OSError as exc:
        raise AscqError(f"cannot write {path}: {exc.strerror or exc}") from None
