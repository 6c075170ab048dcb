"""The design card's command at real shape (issue 36): `ascq serve zoo/deepseek-moe-16b --load-format dummy
--quantization awq-int4` starts on this host, answers /v1/completions and a streamed chat request, and its
processes together stay within 12 GiB. Runs benchmarks/dummy_serve.py (which also times start-up and decode,
numbers that belong in docs/benchmarks.md, not in asserts)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_deepseek_moe_16b_dummy_awq_int4_serves_within_12_gib(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    command = [sys.executable, "benchmarks/dummy_serve.py", "--json", str(out)]  # the server's defaults
    # its own process group: a timeout or an interrupt stops the server it started too, not only the script
    process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        assert process.wait(timeout=1800) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left in the group: all ended on their own
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    result = json.loads(out.read_text())
    assert result["completion_tokens"] == 8
    assert result["chat_stream_chunks"] > 2 and result["chat_finish_reason"] == "length"
    assert result["server_exit_code"] == 0
    assert result["peak_pss_gib"] <= 12.0, result
