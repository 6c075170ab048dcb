"""Ranks that die: at start-up or mid-generate, rank 0 raises a one-line error within seconds and leaves no
process behind; and ranks start from a module entry point, so a script piped to `python -` runs
tensor-parallel. Real processes and gloo groups on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
KV_MEMORY = 8 << 20
ERROR_WITHIN_S = 10


def script_env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def workers_of(process: subprocess.Popen) -> list[psutil.Process]:
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "ascq.runtime.executor.worker" in " ".join(_cmdline(c))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cleanup(rank0: subprocess.Popen, workers: list[psutil.Process]) -> None:
    for process in workers:
        if alive(process):
            process.kill()
    if rank0.poll() is None:
        rank0.kill()
        rank0.wait(10)


def test_tensor_parallel_from_a_script_on_stdin(tiny_llama_dir):
    script = textwrap.dedent(f"""
        from ascq import LLM, SamplingParams
        llm = LLM({str(tiny_llama_dir)!r}, kv_cache_memory={KV_MEMORY}, tensor_parallel_size=2)
        out = llm.generate(["import os"], SamplingParams(temperature=0, max_tokens=4))
        print("TOKENS", out[0].outputs[0].token_ids, flush=True)
        llm.shutdown()
    """)
    result = subprocess.run(
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=300,
        env=script_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert tokens and len(eval(tokens[0].removeprefix("TOKENS "))) == 4


@pytest.mark.parametrize("when", ["start-up", "mid-generate"])
def test_a_worker_that_dies_is_an_error_within_seconds_and_leaves_no_process(tiny_llama_dir, when):
    script = textwrap.dedent(f"""
        import sys
        from ascq import LLM, SamplingParams
        from ascq.core.errors import AscqError
        try:
            llm = LLM({str(tiny_llama_dir)!r}, kv_cache_memory={KV_MEMORY}, tensor_parallel_size=2)
            print("ready", flush=True)
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            while True:
                llm.generate(["import os"] * 4, params)
        except (AscqError, RuntimeError) as exc:
            print("ERROR", str(exc).splitlines()[0], flush=True)
            sys.exit(3)
    """)
    rank0 = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=script_env(),
        cwd=ROOT,
    )
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not workers and time.monotonic() < deadline:
            workers = workers_of(rank0)
            time.sleep(0.05)
        assert workers, "no worker started"
        if when == "mid-generate":
            assert rank0.stdout.readline().strip() == "ready"
            time.sleep(1.0)  # inside a generate
        workers[0].kill()
        killed_at = time.monotonic()
        rank0.wait(60)
        elapsed = time.monotonic() - killed_at
        output = rank0.stdout.read()
        assert rank0.returncode == 3 and "ERROR" in output, output
        assert elapsed <= ERROR_WITHIN_S, f"{elapsed:.1f} s to notice the dead worker"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(w) for w in workers):
            time.sleep(0.2)
        assert not [w.pid for w in workers if alive(w)]
    finally:
        cleanup(rank0, workers)
