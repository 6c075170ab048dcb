"""Serving benchmark: `ascq bench serve` against `ascq serve MODEL`, and the offline engine (`LLM.generate`)
on the same requests in the same run (alternating rounds), so the ratio is what serving (the engine-core
process, its pipe, SSE, JSON) costs.

    python benchmarks/serve.py --model zoo/tiny-llama --num-prompts 128 --input-len 128 --output-len 64 \\
        --max-concurrency 32
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from ascq.core.errors import AscqError
from ascq.runtime.bench.serve import BenchServeOptions, format_report, random_prompts, run_bench_serve
from ascq.runtime.server.launcher import launch_server, stop_server


def offline_output_throughput(llm, options: BenchServeOptions) -> float:
    from ascq import SamplingParams

    prompts = random_prompts(options.num_prompts, options.input_len, random.Random(options.seed))
    params = SamplingParams(temperature=0.0, max_tokens=options.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up, like the server's first requests
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user + system CPU seconds so far of each named process."""
    import psutil

    times = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        times[name] = t.user + t.system
    return times


def server_pids(server) -> dict[str, int]:
    """The benchmark client (this process), the HTTP server and its engine-core child(ren)."""
    import psutil

    pids = {"client": os.getpid(), "http": server.pid}
    for i, child in enumerate(
        c
        for c in psutil.Process(server.pid).children(recursive=True)
        if "resource_tracker" not in " ".join(c.cmdline())
    ):
        pids[f"core{i}" if i else "core"] = child.pid
    return pids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo/tiny-llama")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--rounds", type=int, default=3, help="served / offline pairs, alternating")
    parser.add_argument(
        "--kv-cache-memory", type=int, default=256 << 20, help="bytes, server and offline engine"
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's --stream-interval (vLLM's): an SSE chunk per N tokens",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the server only (e.g. OMP_NUM_THREADS=1); repeatable",
    )
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp()) / "server.log"
    try:
        env = dict(os.environ)
        for item in args.server_env:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"--server-env takes KEY=VALUE, got {item!r}")
            env[key] = value
        server, base_url = launch_server(
            args.model,
            log,
            "--max-num-seqs",
            str(args.max_concurrency),
            "--kv-cache-memory",
            str(args.kv_cache_memory),
            "--stream-interval",
            str(args.stream_interval),
            env=env,
        )
    except AscqError as exc:
        raise SystemExit(str(exc)) from None
    options = BenchServeOptions(
        base_url=base_url,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
    )
    ratios, offline_runs = [], []
    try:
        from ascq import LLM

        llm = LLM(args.model, max_num_seqs=args.max_concurrency, kv_cache_memory=args.kv_cache_memory)
        run_bench_serve(BenchServeOptions(**{**vars(options), "num_prompts": 2}))  # warm-up
        pids = server_pids(server)
        for _ in range(args.rounds):  # alternating, so machine load affects both sides alike
            before, start = cpu_seconds(pids), time.perf_counter()
            metrics = run_bench_serve(options)
            wall, after = time.perf_counter() - start, cpu_seconds(pids)
            print(
                "served round CPU use (cores busy): "
                + ", ".join(f"{name} {(after[name] - before[name]) / wall:.2f}" for name in pids),
                flush=True,
            )
            offline = offline_output_throughput(llm, options)
            offline_runs.append(offline)
            ratios.append(metrics["output_throughput"] / offline)
            print(
                f"round {len(ratios)}: served {metrics['output_throughput']:.1f} tok/s, offline "
                f"{offline:.1f} tok/s, "
                f"ratio {ratios[-1]:.2f}",
                flush=True,
            )
    finally:
        stop_server(server)
    print(format_report(metrics, options))
    print(f"{'Offline LLM.generate (tok/s):':<34}{offline:>12.2f}")
    print(f"{'Served / offline output tok/s:':<34}{metrics['output_throughput'] / offline:>12.2f}")
    if args.rounds > 1:
        print(
            f"rounds: {args.rounds}; served/offline min {min(ratios):.2f}, median "
            f"{statistics.median(ratios):.2f}; "
            f"offline tok/s median {statistics.median(offline_runs):.1f}"
        )
    print(
        f"(cpu threads: {os.environ.get('OMP_NUM_THREADS', 'default')}; stream interval "
        f"{args.stream_interval}; "
        f"server env {args.server_env}; "
        f"server log: {log})"
    )


if __name__ == "__main__":
    main()
