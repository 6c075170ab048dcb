"""Child processes end when their parent does: no orphaned engine cores or workers on any exit path.

A daemon thread polls the parent pid (re-parenting changes `os.getppid()`, even after a kill -9 of the parent)
and hard-exits the child. Polling rather than PR_SET_PDEATHSIG: that signal fires when the parent *thread*
that started the child exits, which would kill workers of an `LLM` built in a short-lived thread.
"""

from __future__ import annotations

import os
import threading
import time

POLL_S = 0.2


def exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="ascq-parent-watch", daemon=True).start()
