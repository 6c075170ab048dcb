"""SIGTERM while a request streams: the server drains and exits 0 within 10 s; the stream ends cleanly."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
from test_server import launch_server


def refuses_new_requests(base_url: str, timeout_s: float) -> bool:
    """After SIGTERM the listening socket closes (connection refused) or the engine answers 503."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            body = {"prompt": "x", "max_tokens": 1}
            if httpx.post(f"{base_url}/v1/completions", json=body, timeout=5).status_code == 503:
                return True
        except httpx.ConnectError:
            return True
        except httpx.TimeoutException:
            pass
        time.sleep(0.1)
    return False


def test_sigterm_during_stream_exits_zero_within_10s(tiny_llama_dir: Path, tmp_path: Path) -> None:
    process, base_url = launch_server(tiny_llama_dir, tmp_path / "server.log")
    lines: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:  # long enough that draining must cut it short
        body = {"prompt": "import os\n", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert first_chunk.wait(30), (tmp_path / "server.log").read_text()[-2000:]
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # a busy host answered the 503 after the 2 s client timeout once (the server logged it): slack here,
        # the exit bound below is what the test holds to
        assert refuses_new_requests(base_url, timeout_s=8)
        code = process.wait(timeout=10)
        elapsed = time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()
        reader.join(10)
    log = (tmp_path / "server.log").read_text()
    assert code == 0 and elapsed < 10, log[-2000:]
    assert lines[-1] == "data: [DONE]"  # finished, or told in-band that the server shut down
    assert "shut down" in lines[-2] or '"finish_reason":"length"' in lines[-2]
    assert "Traceback" not in log
