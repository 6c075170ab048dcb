"""What every client runner shares: its result line, the environment that keeps it off the Hugging Face hub,
and running a command with its output in a log and its whole process group killed on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass
class ClientResult:
    name: str
    ok: bool
    detail: str
    extra_lines: tuple[str, ...] = ()

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def offline_env() -> dict[str, str]:
    """The caller's environment without PYTHONPATH (a client venv sees only its own packages), the hub and
    datasets offline, so a client that tries to download fails at once instead of hanging."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    return env


def run_logged(command: list[str], log_path: Path, timeout_s: float, cwd: Path | None = None) -> int:
    """Runs command with stdout and stderr into log_path; returns its exit code, or 124 after killing its
    whole process group when it outlives timeout_s."""
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=offline_env(), start_new_session=True
        )
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return 124
        finally:
            if process.poll() is None:  # interrupted while waiting
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def log_tail(log_path: Path, lines: int = 3) -> str:
    tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    return " | ".join(line.strip()[:200] for line in tail)
