"""guidellm against the server: synthetic prompts tokenized with the model's own tokenizer, a few requests at
each concurrency (1 is guidellm's synchronous traffic), streamed chat completions. Passes when no request
errored and every rate completed some; the JSON report goes to results/guidellm.json."""

from __future__ import annotations

import json
from pathlib import Path

from common import RESULTS_DIR, ClientResult, log_tail, run_logged

REQUIREMENTS = ["torch==2.13.0", "guidellm==0.8.1"]
REPORT = RESULTS_DIR / "guidellm.json"
MAX_REPORT_BYTES = 512 * 1024  # larger reports lose their per-request records


def run_guidellm(
    python: Path,
    base_url: str,
    model: str,
    tokenizer_dir: Path,
    work_dir: Path,
    streams: list[int],
    requests_per_rate: int,
    max_seconds_per_rate: int,
    data: str,
) -> ClientResult:
    raw_report = work_dir / "guidellm.json"
    command = [
        str(python.parent / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={base_url},model={model}",
        "--profile", "kind=concurrent",
        "--override", "profile.streams", ",".join(map(str, streams)),
        "--constraint", f"kind=max_requests,count={requests_per_rate}",
        "--constraint", f"kind=max_duration,seconds={max_seconds_per_rate}",
        "--data", f"kind=synthetic_text,{data}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={raw_report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    log = work_dir / "guidellm.log"
    timeout_s = len(streams) * (max_seconds_per_rate + 120) + 120
    code = run_logged(command, log, timeout_s)
    if code != 0 or not raw_report.is_file():
        return ClientResult("guidellm", False, f"exit {code}, no report; {log_tail(log)}")
    report = json.loads(raw_report.read_text())
    save_report(report, REPORT)
    rows = [rate_summary(b) for b in report["benchmarks"]]
    errored = sum(r["errored"] for r in rows)
    empty = [r["streams"] for r in rows if r["successful"] == 0]
    ok = errored == 0 and not empty and len(rows) == len(streams)
    detail = (
        f"{len(rows)} rates, {sum(r['successful'] for r in rows)} requests completed, {errored} errored, "
        f"{sum(r['incomplete'] for r in rows)} cut off by the time limit"
        + (f"; no request done at {empty}" * bool(empty))
    )
    return ClientResult("guidellm", ok, detail, tuple(format_rate(r) for r in rows))


def rate_summary(benchmark: dict) -> dict:
    """Per-benchmark numbers as guidellm's console table reports them (means over successful requests)."""
    metrics = benchmark["metrics"]

    def successful(name: str, stat: str = "mean") -> float:
        values = metrics[name]["successful"]
        return values["percentiles"]["p95"] if stat == "p95" else values[stat]

    totals = metrics["request_totals"]
    strategy = benchmark["config"]["strategy"]
    return {
        "streams": strategy.get("streams", strategy.get("max_concurrency")),
        "successful": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "duration_s": benchmark["duration"],
        "ttft_ms_median": successful("time_to_first_token_ms", "median"),
        "ttft_ms_p95": successful("time_to_first_token_ms", "p95"),
        "itl_ms_median": successful("inter_token_latency_ms", "median"),
        "itl_ms_p95": successful("inter_token_latency_ms", "p95"),
        "output_tok_s": successful("output_tokens_per_second"),
        "total_tok_s": successful("tokens_per_second"),
        "req_s": successful("requests_per_second"),
    }


def format_rate(row: dict) -> str:
    return (
        f"concurrency {row['streams']}: {row['successful']} done / {row['errored']} errored / "
        f"{row['incomplete']} cut off in {row['duration_s']:.0f} s; "
        f"TTFT median {row['ttft_ms_median']:.0f} ms (p95 {row['ttft_ms_p95']:.0f}), "
        f"ITL median {row['itl_ms_median']:.1f} ms (p95 {row['itl_ms_p95']:.1f}), "
        f"{row['output_tok_s']:.1f} output tok/s, {row['total_tok_s']:.1f} total tok/s, "
        f"{row['req_s']:.3f} req/s"
    )


def save_report(report: dict, path: Path) -> None:
    """The report as guidellm wrote it, less the per-request records when it would pass MAX_REPORT_BYTES."""
    text = json.dumps(report, indent=1)
    if len(text) > MAX_REPORT_BYTES:
        for benchmark in report["benchmarks"]:
            benchmark["requests"] = {"trimmed": "per-request records dropped to keep the report small"}
        text = json.dumps(report, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
