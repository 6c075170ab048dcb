"""`ascq bench latency|throughput` (offline, in-process, like `vllm bench latency|throughput`) and the result
files all three bench commands share: `--save-result FILE.json` and `--compare FILE.json` against a stored
baseline.

throughput: N random token-id prompts (vLLM's "random" dataset, `bench_serve.random_prompts`) all arrive at
t=0 and run through `LLMEngine.step` to completion; each request's first-token and per-token times give vLLM's
serving metrics (TTFT, TPOT, ITL, E2EL with mean/p50/p90/p99, request/output/total token throughput, goodput).
latency: one batch of `batch_size` prompts generated to completion, `num_iters` times after warm-up; reports
vLLM's avg/percentile batch latency plus the same per-request metrics of the last iteration.

Compare: each metric present in both files is printed with its ratio (new / baseline); a metric regresses when
it moves the bad way (latencies up, throughputs down) by more than `max_regression` percent.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ascq.atomic_file import atomic_write
from ascq.core.errors import AscqError
from ascq.runtime.bench.serve import RequestResult, percentile, random_prompts, summarize


@dataclass
class OfflineBenchOptions:
    model: str
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    batch_size: int = 8  # latency: prompts per batch
    num_iters: int = 3
    num_iters_warmup: int = 1
    seed: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = None
    enforce_eager: bool | None = None
    performance_mode: str | None = None
    load_format: str = "auto"
    quantization: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len", "batch_size", "num_iters"):
            if getattr(self, name) < 1:
                raise AscqError(f"--{name.replace('_', '-')} must be at least 1")
        if self.num_iters_warmup < 0:
            raise AscqError("--num-iters-warmup must be >= 0")

    def engine_kwargs(self) -> dict[str, Any]:
        names = (
            "dtype",
            "device",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_memory",
            "enforce_eager",
            "performance_mode",
            "load_format",
            "quantization",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on (stored with every result)."""
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = -1.0
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1min": round(load, 2),
    }


def _make_llm(options: OfflineBenchOptions):
    from ascq.runtime.engine.llm import LLM

    return LLM(options.model, **options.engine_kwargs())


def run_requests(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[list[RequestResult], float]:
    """All prompts arrive now; step the engine to completion, timing each request's tokens."""
    from ascq.runtime.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    results: dict[str, RequestResult] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        request_id = f"bench-{i}"
        engine.add_request(request_id, prompt, params)
        results[request_id] = RequestResult(ok=False, prompt_tokens=len(prompt))
        counts[request_id] = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            result = results.get(output.request_id)
            if result is None:
                continue
            num = len(output.outputs[0].token_ids)
            if num > counts[output.request_id]:
                if counts[output.request_id] == 0:
                    result.ttft = now - start
                else:  # tokens of one step arrive together: the gap is shared by them
                    result.itls.append(now - last[output.request_id])
                counts[output.request_id] = num
                last[output.request_id] = now
            if output.finished:
                result.latency = now - start
                result.output_tokens = num
                result.ok = num > 0
    return list(results.values()), time.perf_counter() - start


def bench_throughput(
    options: OfflineBenchOptions, goodput: dict[str, float] | None = None
) -> dict[str, float]:
    llm = _make_llm(options)
    rng = random.Random(options.seed)
    run_requests(llm.engine, random_prompts(1, options.input_len, rng), 4)  # warm-up
    results, duration = run_requests(
        llm.engine, random_prompts(options.num_prompts, options.input_len, rng), options.output_len
    )
    return summarize(results, duration, goodput)


def bench_latency(options: OfflineBenchOptions, goodput: dict[str, float] | None = None) -> dict[str, float]:
    llm = _make_llm(options)
    rng = random.Random(options.seed)
    prompts = random_prompts(options.batch_size, options.input_len, rng)
    for _ in range(options.num_iters_warmup):
        run_requests(llm.engine, prompts, options.output_len)
    latencies = []
    for _ in range(options.num_iters):
        results, duration = run_requests(llm.engine, prompts, options.output_len)
        latencies.append(duration * 1000)
    metrics = summarize(results, duration, goodput)
    ordered = sorted(latencies)
    metrics["avg_latency_ms"] = statistics.fmean(latencies)
    for q in (50, 90, 99):
        metrics[f"p{q}_latency_ms"] = percentile(ordered, q)
    return metrics


# ---- result files
# --------------------------------------------------------------------------------------------


def save_result(path: Path, kind: str, options: dict[str, Any], metrics: dict[str, float]) -> None:
    """--save-result PATH (vLLM's: the file named is replaced), written atomically: an interrupted run leaves
    the previous result whole, never half a file; an unwritable path is a one-line error."""
    payload = {"bench": kind, "machine": machine_description(), "options": options, "metrics": metrics}
    atomic_write(path, (json.dumps(payload, indent=2, default=str) + "\n").encode())


def load_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AscqError(f"cannot read baseline {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise AscqError(f"{path} is not an ascq bench result (no 'metrics' object)")
    return data


def higher_is_better(metric: str) -> bool:
    return "throughput" in metric or "goodput" in metric


def compared_metrics(metric: str) -> bool:
    """Timings and throughputs; counts (completed, failed) and the run's duration are not compared."""
    return metric.endswith("_ms") or higher_is_better(metric)


def compare(metrics: dict[str, float], baseline: dict[str, float], max_regression: float) -> tuple[str, bool]:
    """A report of every shared metric's ratio to the baseline, and whether any regressed past the
    threshold."""
    lines = [f"{'metric':<28}{'baseline':>12}{'now':>12}{'ratio':>8}  verdict"]
    regressed = False
    for name in sorted(set(metrics) & set(baseline)):
        if not compared_metrics(name):
            continue
        base, now = float(baseline[name]), float(metrics[name])
        if base <= 0 or now < 0:
            continue
        ratio = now / base
        worse = (1 / ratio if ratio > 0 else float("inf")) if higher_is_better(name) else ratio
        change = (worse - 1) * 100
        verdict = f"REGRESSION +{change:.0f}%" if change > max_regression else "ok"
        regressed |= change > max_regression
        lines.append(f"{name:<28}{base:>12.2f}{now:>12.2f}{ratio:>8.2f}  {verdict}")
    lines.append(f"max regression allowed: {max_regression:g}% -> {'FAIL' if regressed else 'PASS'}")
    return "\n".join(lines), regressed


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """vLLM's `--goodput ttft:MS tpot:MS e2el:MS` service-level objectives (one option value may hold several,
    space- or comma-separated; the option may repeat)."""
    if not items:
        return None
    slos = {}
    for item in (part for text in items for part in text.replace(",", " ").split()):
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise AscqError(f"--goodput takes KEY:MS pairs with KEY in ttft, tpot, e2el; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise AscqError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from exc
    return slos


def format_offline_report(kind: str, metrics: dict[str, float], options: OfflineBenchOptions) -> str:
    from ascq.runtime.bench.serve import format_metrics

    header = (
        f"ascq bench {kind}: {options.model}, "
        f"{options.num_prompts if kind == 'throughput' else options.batch_size}"
        f" prompts x {options.input_len} in / {options.output_len} out, {torch.get_num_threads()} threads"
    )
    lines = [header]
    if kind == "latency":
        lines += [f"{'Avg latency (ms):':<34}{metrics['avg_latency_ms']:>12.2f}"]
        lines += [f"{f'P{q} latency (ms):':<34}{metrics[f'p{q}_latency_ms']:>12.2f}" for q in (50, 90, 99)]
    return "\n".join([*lines, format_metrics(metrics)])


def options_dict(options: OfflineBenchOptions) -> dict[str, Any]:
    return asdict(options)
