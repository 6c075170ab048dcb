"""`ascq serve` as a child process, for benchmarks and tests that drive a real server: start it on a free
loopback port and wait until /health answers, stop it with SIGTERM (the drain) and kill it if the drain does
not finish in time, so no server outlives its caller; read /metrics with prometheus_client's own parser."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ascq.core.errors import AscqError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(
    model: Path | str,
    log_path: Path,
    *extra_args: str,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 300.0,
    port: int | None = None,
) -> tuple[subprocess.Popen, str]:
    """`python -m ascq.cli serve MODEL --port PORT *extra_args`, output to log_path; returns (process, base
    URL) once /health answers 200. If the server exits or does not answer in time, it is killed and AscqError
    carries the log's tail."""
    port = port or free_port()
    command = [sys.executable, "-m", "ascq.cli", "serve", str(model), "--port", str(port), *extra_args]
    with Path(log_path).open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env if env is not None else dict(os.environ)
        )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AscqError(
                f"the server exited with code {process.returncode}:\n{Path(log_path).read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(process, timeout_s=0)
    raise AscqError(
        f"the server did not start within {startup_timeout_s} s:\n{Path(log_path).read_text()[-3000:]}"
    )


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM (the server drains), then kill when it has not exited within timeout_s; returns the exit
    code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def server_metrics(base_url: str) -> dict[str, float]:
    """Samples of /metrics by name (labels dropped, summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def idle_metrics(base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once no request runs or waits and every KV block is free (aborts reach the engine
    asynchronously), or at timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = server_metrics(base_url)
        idle = values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
        if (
            idle
            and values["ascq:num_free_blocks"] == values["ascq:num_total_blocks"]
            or time.monotonic() > deadline
        ):
            return values
        time.sleep(0.2)
