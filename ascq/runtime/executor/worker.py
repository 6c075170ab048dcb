"""Entry point of ranks 1..N-1 on a node: `python -m ascq.runtime.executor.worker`, its start-up arguments
pickled on stdin by the process that starts it (rank 0 or a node's launcher). A module entry point, not
multiprocessing's spawn, so a rank never re-imports the user's `__main__`: scripts piped to `python -`,
`python -c` and notebooks start ranks like any script does."""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    from ascq.runtime.executor.executor import run_worker

    args, config, dtype, info, parent_pid = pickle.load(sys.stdin.buffer)
    run_worker(args, config, dtype, info, parent_pid)


if __name__ == "__main__":
    main()
