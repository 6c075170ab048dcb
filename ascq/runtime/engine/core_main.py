"""Entry point of the engine core process: `python -m ascq.runtime.engine.core_main`, its arguments
(engine_args, the inherited pipe's fd, the parent's pid, describe) pickled on stdin by `EngineCoreProcess`.
A module entry point, as the ranks' (executor/worker.py), so the core never re-imports the user's
`__main__`."""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection


def main() -> None:
    from ascq.runtime.engine.engine_core import run_engine_core

    engine_args, fd, parent_pid, describe = pickle.load(sys.stdin.buffer)
    run_engine_core(engine_args, Connection(fd), parent_pid, describe)


if __name__ == "__main__":
    main()
