"""`ascq bench serve`: drive a running OpenAI-compatible server like `vllm bench serve` and report latencies.

Prompts are vLLM's "random" dataset: token-id prompts of a fixed length (ids drawn from [100, 4000), which
avoids the special tokens at the ends of common vocabularies), and every request asks for exactly `output_len`
tokens (`ignore_eos`). Requests stream with `include_usage`, so output tokens are the server's own count.
Arrivals are Poisson at `request_rate` (inf = all at once), optionally capped at `max_concurrency` requests in
flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from ascq.core.errors import AscqError

TOKEN_ID_RANGE = (100, 4000)


@dataclass
class BenchServeOptions:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        checks = [
            (self.num_prompts >= 1, "--num-prompts must be at least 1"),
            (self.request_rate > 0, "--request-rate must be positive (inf = all at once)"),
            (self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be >= 1"),
            (self.input_len >= 1 and self.output_len >= 1, "--input-len and --output-len must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise AscqError(message)


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def run_bench_serve(options: BenchServeOptions, goodput: dict[str, float] | None = None) -> dict[str, float]:
    """Run the benchmark; returns the metrics (durations in ms, throughputs per second)."""
    return asyncio.run(_bench(options, goodput))


async def _bench(options: BenchServeOptions, goodput: dict[str, float] | None = None) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    connector = aiohttp.TCPConnector(limit=options.max_concurrency or options.num_prompts)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    async with aiohttp.ClientSession(
        options.base_url, headers=headers, connector=connector, timeout=timeout
    ) as session:
        model = options.model or await _served_model(session, options.base_url)
        rng = random.Random(options.seed)
        prompts = random_prompts(options.num_prompts, options.input_len, rng)
        gate = asyncio.Semaphore(options.max_concurrency or options.num_prompts)

        async def one(prompt: list[int]) -> RequestResult:
            async with gate:
                return await _stream_request(session, model, prompt, options.output_len)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if options.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(options.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, goodput)


def random_prompts(num_prompts: int, input_len: int, rng: random.Random) -> list[list[int]]:
    """vLLM's "random" dataset: token-id prompts of exactly input_len tokens."""
    return [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(input_len)] for _ in range(num_prompts)]


async def _served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get("/v1/models") as response:
            if response.status != 200:
                raise AscqError(f"GET /v1/models answered {response.status}: {(await response.text())[:200]}")
            return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, OSError) as exc:
        raise AscqError(f"cannot reach the server at {base_url}: {exc}") from exc


async def _stream_request(
    session: aiohttp.ClientSession, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    """One streamed completion (aiohttp, as vLLM's benchmark client: httpx's per-event cost took a sizeable
    share of a core on the machine the server shares)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    return result


def summarize(
    results: list[RequestResult], duration: float, goodput: dict[str, float] | None = None
) -> dict[str, float]:
    """vLLM's serving metrics (durations in ms): TTFT, TPOT, ITL, E2EL mean/p50/p90/p99, throughputs, and with
    `goodput` SLOs ({"ttft"|"tpot"|"e2el": ms}) the rate of requests meeting all of them."""
    done = [r for r in results if r.ok]
    if not done:
        errors = sorted({r.error for r in results})[:3]
        raise AscqError(f"all {len(results)} requests failed, e.g.: {'; '.join(errors)}")
    output_tokens = sum(r.output_tokens for r in done)
    metrics = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / duration,
    }
    per_request = {
        "ttft": [r.ttft for r in done],
        "tpot": [_tpot(r) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.latency for r in done],
    }
    for name, values in per_request.items():
        values_ms = sorted(v * 1000 for v in values) or [0.0]
        metrics[f"mean_{name}_ms"] = statistics.fmean(values_ms)
        for q in PERCENTILES:
            metrics[f"p{q}_{name}_ms"] = percentile(values_ms, q)
    if goodput:
        good = [r for r in done if all(_slo_value(r, key) * 1000 <= limit for key, limit in goodput.items())]
        metrics["request_goodput"] = len(good) / duration
    return metrics


PERCENTILES = (50, 90, 99)


def _tpot(r: RequestResult) -> float:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def _slo_value(r: RequestResult, key: str) -> float:
    return {"ttft": r.ttft, "tpot": _tpot(r), "e2el": r.latency}[key]


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def format_metrics(metrics: dict[str, float]) -> str:
    lines = [
        f"{'Successful requests:':<34}{metrics['completed']:>12.0f}",
        f"{'Failed requests:':<34}{metrics['failed']:>12.0f}",
        f"{'Benchmark duration (s):':<34}{metrics['duration_s']:>12.2f}",
        f"{'Request throughput (req/s):':<34}{metrics['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<34}{metrics['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<34}{metrics['total_token_throughput']:>12.2f}",
    ]
    if "request_goodput" in metrics:
        lines.append(f"{'Request goodput (req/s):':<34}{metrics['request_goodput']:>12.2f}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f"---{title}".ljust(46, "-"))
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            lines.append(
                f"{f'{stat.capitalize()} {name.upper()} (ms):':<34}{metrics[f'{stat}_{name}_ms']:>12.2f}"
            )
    return "\n".join(lines)


def format_report(metrics: dict[str, float], options: BenchServeOptions) -> str:
    header = (
        f"ascq bench serve: {options.num_prompts} prompts x {options.input_len} in / {options.output_len} "
        f"out, "
        f"request rate {options.request_rate}, max concurrency {options.max_concurrency or 'none'}"
    )
    return "\n".join([header, format_metrics(metrics)])


def options_dict(options: BenchServeOptions) -> dict[str, object]:
    data = asdict(options)
    data.pop("api_key")  # never written to results
    return data
