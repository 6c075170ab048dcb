"""The design card's command at real shape with dummy weights (issue 36): `ascq serve zoo/deepseek-moe-16b
--load-format dummy --quantization awq-int4` on this host. Measures the time from launch to a 200 on /health,
the peak memory of the server's whole process tree (server + engine core, sampled every 0.2 s from launch to
stop: PSS summed, the bound's measure; RSS summed; the engine core's RSS), then answers one /v1/completions
and one streamed chat request with the real `openai` client and times batch-1 decode (a 64-token streamed
completion, ignore_eos: tokens after the first / time after the first).

    OMP_NUM_THREADS=2 python benchmarks/dummy_serve.py [--model zoo/deepseek-moe-16b] [--recipe awq-int4] \
        [--json out.json]
    OMP_NUM_THREADS=2 python benchmarks/dummy_serve.py --model CONVERTED_ENTRY --own-weights

With no --max-model-len / --kv-cache-memory the server runs with its defaults: the card's command as typed.
tests/test_dummy_serve.py (slow) runs it and checks its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import openai
import psutil

from ascq.runtime.server.launcher import launch_server, stop_server


class PeakMemory:
    """Polls this process's children (the server and the processes it starts) until stopped. Peaks in bytes:
    `pss` the proportional set size summed over them (the memory the tree really holds: a page two processes
    share counts half in each), `rss` the resident sets summed (counts the shared torch libraries in every
    process), `largest_rss` the largest single process's RSS (the engine core's)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.peak = {"pss": 0, "rss": 0, "largest_rss": 0}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.is_set():
            pss = rss = largest = 0
            for process in psutil.Process().children(recursive=True):
                try:
                    info = process.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                pss, rss, largest = pss + info.pss, rss + info.rss, max(largest, info.rss)
            for key, value in (("pss", pss), ("rss", rss), ("largest_rss", largest)):
                self.peak[key] = max(self.peak[key], value)
            self.done.wait(self.interval_s)

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.thread.join()
        return self.peak


def decode_tokens_per_s(client: openai.OpenAI, model: str, num_tokens: int) -> float:
    stream = client.completions.create(
        model=model,
        prompt="The weather today",
        max_tokens=num_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    arrivals = [time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].text]
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def measure(
    model: str,
    recipe: str | None,
    max_model_len: int | None,
    kv_cache_memory: int | None,
    decode_tokens: int,
) -> dict:
    """`recipe` None: the folder's own weights (a converted entry), else dummy weights in that recipe's
    format."""
    log_path = Path(tempfile.mkdtemp(prefix="dummy-serve-")) / "server.log"
    extra = ["--load-format", "dummy", "--quantization", recipe] if recipe else []
    if max_model_len is not None:
        extra += ["--max-model-len", str(max_model_len)]
    if kv_cache_memory is not None:
        extra += ["--kv-cache-memory", str(kv_cache_memory)]
    memory = PeakMemory()
    started = time.monotonic()
    try:
        process, base_url = launch_server(model, log_path, *extra, startup_timeout_s=900)
    except BaseException:
        memory.stop()
        raise
    ready_s = time.monotonic() - started
    result = {"model": model, "recipe": recipe, "ready_s": round(ready_s, 1), "log": str(log_path)}
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
        completion = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
        result["completion_tokens"] = completion.usage.completion_tokens
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Say something."}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
        )
        result["chat_stream_chunks"] = len(chunks)
        result["chat_finish_reason"] = chunks[-1].choices[0].finish_reason
        result["decode_tok_s"] = round(decode_tokens_per_s(client, model, decode_tokens), 2)
    finally:
        result["server_exit_code"] = stop_server(process)
        peak = memory.stop()
        result["peak_pss_gib"] = round(peak["pss"] / 2**30, 2)
        result["peak_rss_sum_gib"] = round(peak["rss"] / 2**30, 2)
        result["peak_engine_rss_gib"] = round(peak["largest_rss"] / 2**30, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo/deepseek-moe-16b")
    parser.add_argument("--recipe", help="the dummy weights' format (default: awq-int4)")
    parser.add_argument(
        "--own-weights", action="store_true", help="serve the folder's weights (a converted entry), not dummy"
    )
    parser.add_argument("--max-model-len", type=int, help="default: the model's")
    parser.add_argument("--kv-cache-memory", type=int, help="bytes (default: the server's)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.own_weights and args.recipe:
        parser.error("--recipe names the dummy weights' format; --own-weights serves the folder's weights")
    recipe = None if args.own_weights else args.recipe or "awq-int4"
    result = measure(args.model, recipe, args.max_model_len, args.kv_cache_memory, args.decode_tokens)
    result["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
