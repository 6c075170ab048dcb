"""The soak benchmark, short: benchmarks/soak.py for 90 s on tiny-llama must meet its goals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ascq.paths import PROJECT_DIR


@pytest.mark.slow
def test_short_soak_meets_goals(tiny_llama_dir, tmp_path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(PROJECT_DIR / "benchmarks" / "soak.py"),
            "--model",
            str(tiny_llama_dir),
            "--duration",
            "90",
            "--warmup",
            "30",
            "--windows",
            "3",
            "--clients",
            "6",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert done.returncode == 0, (report["goals"], report["outcomes"], report["unexpected_examples"])
    assert report["requests_served"] > 50 and report["outcomes"]["hostile_rejected_4xx"] > 0
    assert report["outcomes"]["disconnected_mid_stream"] > 0
    assert report["kv_blocks_end"]["free"] == report["kv_blocks_end"]["total"]
