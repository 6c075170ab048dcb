"""kill -9 of the engine process mid-stream: open streams end with an error event, every route answers 503,
the server exits non-zero within 5 s and leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
from test_server import launch_server


def test_engine_killed_mid_stream(tiny_llama_dir: Path, tmp_path: Path) -> None:
    process, base_url = launch_server(tiny_llama_dir, tmp_path / "server.log")
    children = psutil.Process(process.pid).children(recursive=True)
    streams: list[list[str]] = [[] for _ in range(3)]
    started = threading.Barrier(len(streams) + 1, timeout=60)

    def stream(lines: list[str]) -> None:
        body = {"prompt": "import os\n", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
            first = True
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if first:
                        first = False
                        started.wait()

    readers = [threading.Thread(target=stream, args=(lines,)) for lines in streams]
    for reader in readers:
        reader.start()
    try:
        started.wait()
        # not the resource tracker
        engine = next(c for c in children if "ascq.runtime.engine.core_main" in " ".join(c.cmdline()))
        start = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        answers = []
        while process.poll() is None and time.monotonic() - start < 3:
            try:
                answers.append(httpx.get(f"{base_url}/v1/models", timeout=1))
                answers.append(httpx.post(f"{base_url}/v1/completions", json={"prompt": "x"}, timeout=1))
                answers.append(httpx.get(f"{base_url}/health", timeout=1))
            except httpx.HTTPError:
                break
            if len(answers) >= 3 and all(a.status_code == 503 for a in answers[-3:]):
                break
            time.sleep(0.05)
        code = process.wait(timeout=10)
        elapsed = time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()
        for reader in readers:
            reader.join(10)
    log = (tmp_path / "server.log").read_text()
    assert code != 0 and elapsed < 5, (code, elapsed, log[-2000:])
    recent = answers[-3:]
    assert [a.status_code for a in recent] == [503, 503, 503], [(a.status_code, a.text) for a in answers]
    assert (
        recent[0].json()["error"]["code"] == "engine_dead"
        and recent[1].json()["error"]["code"] == "engine_dead"
    )
    for lines in streams:
        assert lines[-1] == "data: [DONE]" and "engine process died" in lines[-2], lines[-3:]
    time.sleep(1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
