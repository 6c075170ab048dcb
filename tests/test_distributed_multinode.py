"""Two "nodes" on 127.0.0.1 (TP=1 x PP=2 across them): node 1 runs rank 1 only, node 0 serves; the completion
is the single-process engine's. Both node processes are killed on every path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from test_server import free_port, launch_server

from ascq import LLM, SamplingParams


def test_two_nodes_pp2_serve_same_completion(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompt = [100, 200, 300, 400, 500]
    with LLM(str(tiny_llama_dir), kv_cache_memory=32 << 20) as llm:
        expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    master_port = str(free_port())
    flags = [
        "--pipeline-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        master_port,
    ]
    node1_log = tmp_path / "node1.log"
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ascq.cli",
            "serve",
            str(tiny_llama_dir),
            *flags,
            "--node-rank",
            "1",
            "--kv-cache-memory",
            str(64 << 20),
        ],
        stdout=node1_log.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    node0 = None
    try:
        node0, base_url = launch_server(
            tiny_llama_dir, tmp_path / "node0.log", *flags, "--node-rank", "0", startup_timeout_s=300
        )
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text
        node0.terminate()
        assert node0.wait(30) == 0
        assert node1.wait(30) == 0, node1_log.read_text()[-2000:]
    finally:
        for process in (node0, node1):
            if process is not None and process.poll() is None:
                process.kill()
