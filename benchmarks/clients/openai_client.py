"""The `openai` SDK against the server: openai_checks.py runs in the SDK's own venv and prints one JSON line
per check, each becoming one result line here."""

from __future__ import annotations

import json
from pathlib import Path

from common import ClientResult, log_tail, run_logged

REQUIREMENTS = ["openai==3.60.0"]
CHECKS = Path(__file__).parent / "openai_checks.py"


def run_openai(python: Path, base_url: str, model: str, work_dir: Path) -> list[ClientResult]:
    log = work_dir / "openai.log"
    code = run_logged([str(python), str(CHECKS), "--base-url", f"{base_url}/v1", "--model", model], log, 900)
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    if code != 0 or not lines:
        return [ClientResult("openai", False, f"exit {code}; {log_tail(log)}")]
    results = [json.loads(line) for line in lines]
    return [ClientResult(f"openai {r['name']}", r["ok"], r["detail"]) for r in results]
