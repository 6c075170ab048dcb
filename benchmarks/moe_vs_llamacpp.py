"""ascq vs llama.cpp on a model too large for both to stay resident together (deepseek-moe-16b's synthetic
source on a 24 GiB host): each round runs llama.cpp and ascq one after the other, each in its own process,
alternating which goes first; ratios are per round, reported min / median.

    OMP_NUM_THREADS=2 python benchmarks/moe_vs_llamacpp.py --llama-cpp PATH/llama.cpp \
        --gguf DIR/deepseek-moe-16b-synthetic-Q4_0.gguf --ascq DIR/deepseek-moe-16b-synthetic-w4a16-rtn \
        [--rounds 2] [--threads 2]

Per side and round (measurement functions of vs_llamacpp.py): llama-bench pp`--prompt-tokens` and
tg`--decode-tokens` against ascq's prefill of a new prompt of that length and its batch-1 decode;
llama-server `--parallel 16` at concurrency 16 against ascq `LLM.generate` on the same `--num-requests`
requests (token-id prompts, greedy, ignore_eos); batch-1 decode through llama-server too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_llamacpp as vs  # noqa: E402


def workload(args: argparse.Namespace, round_index: int) -> dict:
    return {
        "decode_prompt": vs.make_prompt(32, args.seed),
        "long_prompt": vs.make_prompt(args.prompt_tokens, args.seed + 1000 + round_index),
        "requests": vs.make_requests(
            args.num_requests, args.seed + round_index, args.max_prompt_tokens, args.max_new_tokens
        ),
    }


def llama_side(args: argparse.Namespace, work: dict) -> dict:
    bin_dir = args.llama_cpp / "build" / "bin"
    bench = vs.llama_bench_tps(
        str(bin_dir / "llama-bench"), str(args.gguf), args.threads, args.prompt_tokens, args.decode_tokens
    )
    slot = args.max_prompt_tokens + args.max_new_tokens
    server = vs.LlamaServer(str(bin_dir / "llama-server"), str(args.gguf), args.threads, 16, 16 * slot)
    try:
        vs.llama_decode_tps(server, work["decode_prompt"], 8)  # warm-up
        decode = vs.llama_decode_tps(server, work["decode_prompt"], args.decode_tokens)
        batched = vs.llama_batched_tps(server, [tuple(r) for r in work["requests"]], 16)
    finally:
        server.stop()
    return {"pp": bench["pp"], "tg": bench["tg"], "decode": decode, "batched": batched}


def ascq_side(args: argparse.Namespace, work: dict) -> dict:
    """In a child process (`--ascq-worker`): the model is freed before llama.cpp runs."""
    out = subprocess.run(
        [sys.executable, __file__, "--ascq-worker", json.dumps({"args": _plain(args), "work": work})],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _plain(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def ascq_worker(payload: str) -> None:
    import torch

    message = json.loads(payload)
    args, work = argparse.Namespace(**message["args"]), message["work"]
    torch.set_num_threads(args.threads)
    llm = vs.ascq_llm(args.ascq, max(64, args.num_requests), kv_cache_memory=args.kv_cache_memory)
    vs.ascq_decode_tps(llm, work["decode_prompt"], 8)  # warm-up
    result = {
        "decode": vs.ascq_decode_tps(llm, work["decode_prompt"], args.decode_tokens),
        "prefill": vs.ascq_prefill_tps(llm, work["long_prompt"]),
        "batched": vs.ascq_batched_tps(llm, [tuple(r) for r in work["requests"]]),
    }
    print(json.dumps(result), flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--ascq-worker":
        ascq_worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree with build/bin")
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--ascq", required=True, help="the ascq entry (PATH[:DTYPE])")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=int, default=3 << 29)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        work = workload(args, r)
        sides = [("llama", llama_side), ("ascq", ascq_side)]
        for side, run in sides if r % 2 == 0 else sides[::-1]:
            for key, value in run(args, work).items():
                rows.setdefault(f"{side} {key}", []).append(value)
            line = ", ".join(f"{k} {v[-1]:.2f}" for k, v in rows.items())
            print(f"round {r + 1} {side}: {line}", flush=True)
    print(
        f"\n# {args.threads} threads, {args.rounds} rounds, load avg {os.getloadavg()[0]:.1f}; tok/s min / "
        "median, ratio to llama.cpp in the same round min / median\n"
    )
    print("| ascq vs llama.cpp | ascq tok/s | ratio |\n|---|---:|---:|")
    pairs = (
        (f"batch-1 decode {args.decode_tokens} vs llama-bench tg{args.decode_tokens}", "decode", "tg"),
        (f"prefill {args.prompt_tokens} vs llama-bench pp{args.prompt_tokens}", "prefill", "pp"),
        ("batch-1 decode vs llama-server", "decode", "decode"),
        (f"{args.num_requests} requests vs llama-server --parallel 16", "batched", "batched"),
    )
    for name, ours, theirs in pairs:
        print(vs.summarize(name, rows[f"ascq {ours}"], rows[f"llama {theirs}"], digits=2))
    print("\n| llama.cpp | tok/s |\n|---|---:|")
    for key in ("tg", "pp", "decode", "batched"):
        values = rows[f"llama {key}"]
        print(f"| {key} | {min(values):.2f} / {statistics.median(values):.2f} |")


if __name__ == "__main__":
    main()
