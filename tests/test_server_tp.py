"""The server tests of test_server.py (64 clients with disconnects, hostile requests, greedy = LLM.generate,
...) against `ascq serve --tensor-parallel-size 2` (engine core + one worker rank over gloo). Slow: a second
server."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_server import *  # noqa: F403  (the tests themselves, run again with the fixture below)
from test_server import API_KEY, launch_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("server-tp2") / "server.log"
    process, base_url = launch_server(
        tiny_llama_dir,
        log_path,
        "--served-model-name",
        "tiny-llama",
        "--tensor-parallel-size",
        "2",
        api_key=API_KEY,
        startup_timeout_s=300,
    )
    yield base_url, log_path
    stop_server(process, log_path, API_KEY)
