"""A child process started from a module entry point (`python -m MODULE`), its start-up arguments pickled on
stdin. Not multiprocessing's spawn, so the child never re-imports the user's `__main__`: scripts piped to
`python -`, `python -c` and notebooks start ranks and the engine core like any script does."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path


class ModuleProcess:
    def __init__(self, name: str, module: str, start_args: tuple, pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        package_root = str(Path(__file__).resolve().parents[3])  # where the ascq this process runs lives
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        )
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module], stdin=subprocess.PIPE, env=env, pass_fds=pass_fds
        )
        try:
            self.popen.stdin.write(pickle.dumps(start_args))
            self.popen.stdin.close()
        except BrokenPipeError:  # it died at once; is_alive() says so
            pass

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout_s: float | None) -> None:
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
