"""Soak test: `ascq serve` on loopback under mixed load for a fixed time; reports leaks and failures.

    python benchmarks/soak.py --model zoo/tiny-llama --duration 1800 --clients 8 --out /tmp/soak.json

Load (seeded, per request): completions or chat, streamed or not, random n, stop strings, logprobs, structured
outputs (json_schema / guided_choice / guided_regex); 1 in 8 streamed requests disconnects after its first
chunk; 1 in 20 requests is hostile (bad JSON, wrong types, unknown or unsupported fields, out-of-vocab ids, a
wrong API key) and must get a 4xx. The server runs as a child process on 127.0.0.1 and is stopped (SIGTERM,
then kill) on every path; every loop is bounded by the deadline, so the script always ends by itself.

Reports: requests served, errors by kind, p99 latency per time window, server RSS at start / after warm-up /
end, KV blocks free once idle at the end. Goals (exit code 0 only when all hold): no unexpected 5xx, no other
unexpected outcome, every KV block free at the end, RSS growth after warm-up < 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from ascq.core.errors import AscqError
from ascq.runtime.server.launcher import idle_metrics, launch_server, stop_server

API_KEY = "soak-key"
PROMPTS = [
    "def parse_args(argv):\n    ",
    "import os\nimport sys\n\n",
    "class Queue:\n    def __init__(self",
    "# compute the mean\n",
    "for i in range(10):\n",
]
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
HOSTILE = [  # (path, httpx kwargs)
    ("/v1/completions", {"content": b'{"prompt": "a",'}),
    ("/v1/completions", {"json": {"prompt": "a", "max_tokens": "5"}}),
    ("/v1/completions", {"json": {"prompt": [1, 2, 10**9]}}),
    ("/v1/completions", {"json": {"prompt": "a", "suffix": "b"}}),
    ("/v1/completions", {"json": {"prompt": "a", "temprature": 1}}),
    ("/v1/completions", {"json": {"prompt": "x = 1\n" * 600, "max_tokens": 4}}),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "root", "content": "x"}]}}),
    (
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}},
    ),
    (
        "/v1/chat/completions",
        {
            "json": {"messages": [{"role": "user", "content": "x"}]},
            "headers": {"Authorization": "Bearer wrong"},
        },
    ),
    ("/v1/completions", {"json": {"prompt": "a", "guided_regex": "("}}),
]


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, VLLM_API_KEY=API_KEY, OMP_NUM_THREADS=str(args.threads))
    try:
        return launch_server(
            args.model,
            log,
            "--host",
            "127.0.0.1",
            "--kv-cache-memory",
            str(args.kv_cache_memory),
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "32",
            env=env,
        )
    except AscqError as exc:
        raise SystemExit(str(exc)) from None


def request_body(rng: random.Random, chat: bool, stream: bool) -> dict:
    body: dict = {
        "max_tokens": rng.choice([4, 8, 16, 32]),
        "stream": stream,
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randrange(1000),
    }
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if rng.random() < 0.3:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["\n", ":", "(", " ="])]
    if rng.random() < 0.3:
        if chat:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 2, 5]))
        else:
            body["logprobs"] = rng.choice([0, 2, 5])
    if rng.random() < 0.15:
        kind = rng.choice(["json", "choice", "regex"])
        body["max_tokens"] = 48
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
        elif kind == "choice":
            body["guided_choice"] = ["red", "green", "blue"]
        else:
            body["guided_regex"] = "[a-z]{2,8}-[0-9]{1,3}"
    return body


class Recorder:
    def __init__(self, start: float) -> None:
        self.start = start
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[tuple[float, float]] = []  # (seconds since start, latency) of served requests
        self.examples: dict[str, str] = {}

    def record(self, outcome: str, began: float, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome in ("ok", "ok_stream"):
            self.latencies.append((began - self.start, time.monotonic() - began))
        elif detail and outcome not in self.examples:
            self.examples[outcome] = detail[:300]


async def one_request(http: httpx.AsyncClient, rng: random.Random, rec: Recorder) -> None:
    began = time.monotonic()
    if rng.random() < 1 / 20:
        path, kwargs = rng.choice(HOSTILE)
        response = await http.post(path, **kwargs)
        if response.status_code >= 500:
            rec.record("unexpected_5xx", began, response.text)
        elif 400 <= response.status_code < 500:
            rec.record("hostile_rejected_4xx", began)
        else:
            rec.record("hostile_accepted", began, f"{path} {kwargs}")
        return
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    body = request_body(rng, chat, stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        response = await http.post(path, json=body)
        outcome = "ok" if response.status_code == 200 else classify(response.status_code)
        if outcome == "ok" and not structured_valid(body, response.json(), chat):
            outcome = "structured_invalid"
        rec.record(outcome, began, response.text)
        return
    disconnect = rng.random() < 1 / 8
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            rec.record(classify(response.status_code), began, response.text)
            return
        lines = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if disconnect:
                    break
    if disconnect:
        rec.record("disconnected_mid_stream", began)
    elif lines and lines[-1] == "data: [DONE]" and not any(in_band_error(x) for x in lines[:-1]):
        rec.record("ok_stream", began)
    else:
        rec.record("stream_incomplete", began, next((x for x in lines if in_band_error(x)), "no [DONE]"))


def in_band_error(line: str) -> bool:
    """An SSE event that is OpenAI's error JSON (a token's text may well be "error": parse, do not grep)."""
    try:
        return "error" in json.loads(line.removeprefix("data: "))
    except json.JSONDecodeError:
        return True


def classify(status: int) -> str:
    return "unexpected_5xx" if status >= 500 else f"unexpected_{status}"


def structured_valid(body: dict, data: dict, chat: bool) -> bool:
    """A structured output that finished with "stop" must satisfy its constraint."""
    import re

    for choice in data["choices"]:
        if choice["finish_reason"] != "stop" or choice.get("stop_reason") is not None:  # cut by a stop string
            continue
        text = choice["message"]["content"] if chat else choice["text"]
        if "response_format" in body:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return False
            if not (isinstance(value, dict) and set(value) == {"id", "ok"} and isinstance(value["ok"], bool)):
                return False
        elif "guided_choice" in body and text not in body["guided_choice"]:
            return False
        elif "guided_regex" in body and not re.fullmatch(body["guided_regex"], text):
            return False
    return True


async def client(http: httpx.AsyncClient, seed: int, deadline: float, rec: Recorder) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await one_request(http, rng, rec)
        except httpx.HTTPError as exc:
            rec.record(f"transport_{type(exc).__name__}", time.monotonic(), repr(exc) or type(exc).__name__)


async def sample_rss(pid: int, deadline: float, samples: list[tuple[float, int]], start: float) -> None:
    process = psutil.Process(pid)
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - start, process.memory_info().rss))
        await asyncio.sleep(5)


async def run_load(
    base_url: str, pid: int, args: argparse.Namespace
) -> tuple[Recorder, list[tuple[float, int]]]:
    start = time.monotonic()
    deadline = start + args.duration
    rec = Recorder(start)
    rss: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=4 * args.clients)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=120) as http:
        await asyncio.gather(
            sample_rss(pid, deadline, rss, start),
            *(client(http, args.seed * 1000 + c, deadline, rec) for c in range(args.clients)),
        )
    return rec, rss


def p99_windows(latencies: list[tuple[float, float]], duration: float, num_windows: int) -> list[dict]:
    width = duration / num_windows
    windows = []
    for w in range(num_windows):
        values = sorted(lat for t, lat in latencies if w * width <= t < (w + 1) * width)
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))] if values else None
        windows.append(
            {
                "start_s": round(w * width),
                "num_served": len(values),
                "p99_latency_s": None if p99 is None else round(p99, 3),
            }
        )
    return windows


def rss_at(samples: list[tuple[float, int]], t: float) -> int:
    return min(samples, key=lambda s: abs(s[0] - t))[1]


def summarize(
    rec: Recorder,
    rss: list[tuple[float, int]],
    final: dict[str, float],
    args: argparse.Namespace,
    returncode: int | None,
) -> dict:
    warmup = min(args.warmup, args.duration / 2)
    rss_start, rss_warm, rss_end = rss[0][1], rss_at(rss, warmup), rss[-1][1]
    unexpected = {
        k: v
        for k, v in rec.outcomes.items()
        if k.startswith(
            ("unexpected", "transport", "stream_incomplete", "structured_invalid", "hostile_accepted")
        )
    }
    goals = {
        "no_unexpected_5xx": rec.outcomes.get("unexpected_5xx", 0) == 0,
        "no_other_unexpected_outcome": not unexpected,
        "all_kv_blocks_free": final["ascq:num_free_blocks"] == final["ascq:num_total_blocks"],
        "rss_growth_after_warmup_below_5pct": (rss_end - rss_warm) / rss_warm < 0.05,
        "server_exit_code_0": returncode == 0,
    }
    return {
        "options": {k: v for k, v in vars(args).items() if k != "out"},
        "requests_served": rec.outcomes.get("ok", 0) + rec.outcomes.get("ok_stream", 0),
        "outcomes": dict(sorted(rec.outcomes.items())),
        "unexpected_examples": rec.examples,
        "p99_latency_windows": p99_windows(rec.latencies, args.duration, args.windows),
        "rss_mib": {
            "start": round(rss_start / 2**20, 1),
            "after_warmup": round(rss_warm / 2**20, 1),
            "end": round(rss_end / 2**20, 1),
            "growth_after_warmup_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        },
        "kv_blocks_end": {
            "free": int(final["ascq:num_free_blocks"]),
            "total": int(final["ascq:num_total_blocks"]),
        },
        "generation_tokens": int(final["vllm:generation_tokens_total"]),
        "preemptions": int(final["vllm:num_preemptions_total"]),
        "goals": goals,
        "goals_met": all(goals.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo/tiny-llama")
    parser.add_argument("--duration", type=float, default=1800, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=300, help="seconds before the RSS baseline")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--windows", type=int, default=10, help="time windows of the p99 report")
    parser.add_argument("--kv-cache-memory", type=int, default=32 << 20)
    parser.add_argument("--threads", type=int, default=1, help="server OMP threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the report as JSON here too")
    args = parser.parse_args(argv)
    log = Path(tempfile.mkstemp(prefix="ascq-soak-", suffix=".log")[1])
    process, base_url = start_server(args, log)
    try:
        rec, rss = asyncio.run(run_load(base_url, process.pid, args))
        final = idle_metrics(base_url)
    finally:
        returncode = stop_server(process)
    report = summarize(rec, rss, final, args, returncode)
    report["server_log"] = str(log)
    report["server_log_tracebacks"] = log.read_text().count("Traceback")
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if report["goals_met"] and not report["server_log_tracebacks"] else 1


if __name__ == "__main__":
    sys.exit(main())
