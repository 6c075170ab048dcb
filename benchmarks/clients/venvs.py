"""One virtual environment per client, outside the repository: created once, its pinned requirements
installed from the package index, and reused while those pins stay the same."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from ascq.core.errors import AscqError

# torch first and pinned: a client that needs it then gets the local CPU build instead of CUDA wheels.
TORCH = "torch==2.13.0"
STAMP = "ascq-requirements.txt"


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def ensure_venv(venv_dir: Path, requirements: list[str], log_path: Path) -> Path:
    """The venv's python, after installing `requirements` into venv_dir unless its stamp already lists
    exactly them; pip's output goes to log_path."""
    stamp = venv_dir / STAMP
    wanted = "\n".join(requirements) + "\n"
    if stamp.is_file() and stamp.read_text() == wanted and venv_python(venv_dir).exists():
        return venv_python(venv_dir)
    print(
        f"installing {' '.join(requirements)} into {venv_dir} (log {log_path})", file=sys.stderr, flush=True
    )
    venv.EnvBuilder(with_pip=True, clear=stamp.exists()).create(venv_dir)
    with log_path.open("w") as log:
        done = subprocess.run(
            [str(venv_python(venv_dir)), "-m", "pip", "install", *requirements],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise AscqError(f"pip install into {venv_dir} failed (exit {done.returncode}); see {log_path}")
    stamp.write_text(wanted)
    return venv_python(venv_dir)
