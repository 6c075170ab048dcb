"""Decode graphs vs eager: the same checkpoint loaded twice in one process (`enforce_eager=False` / `True`),
batch-B greedy decode through the engine (`LLMEngine.step`), alternating rounds so load hits both alike. Per
round and mode: the median decode-step time (prefill steps excluded); then min / median over rounds, the
eager/graphs ratio, the graphs startup (compile) time, the load average, and whether the two modes produced
identical tokens.

    OMP_NUM_THREADS=1 python benchmarks/decode_graphs.py --model zoo/smollm2-135m-instruct --dtype bfloat16 \\
        --batch 1 8 --rounds 5 --tokens 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ascq import LLM, SamplingParams


def decode_round(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, list]:
    """(median decode-step seconds, sorted (request id, tokens)) for one batch run to completion."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    times, outputs = [], []
    while engine.scheduler.running:
        start = time.perf_counter()
        outputs += engine.step()
        times.append(time.perf_counter() - start)
    tokens = sorted(
        (o.request_id.split("-")[-1], tuple(o.outputs[0].token_ids)) for o in outputs if o.finished
    )
    return statistics.median(times), tokens


def run(model: str, dtype: str, batch: int, rounds: int, num_tokens: int, context: int) -> None:
    kwargs = dict(dtype=dtype, max_num_seqs=batch, kv_cache_memory=256 << 20)
    start = time.perf_counter()
    llms = {"graphs": LLM(model, enforce_eager=False, **kwargs)}
    startup = time.perf_counter() - start
    llms["eager"] = LLM(model, enforce_eager=True, **kwargs)
    prompts = [[100 + (7 * i + j) % 3000 for j in range(context + 3 * i)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    steps: dict[str, list[float]] = {name: [] for name in ("eager", "graphs")}
    tokens: dict[str, list] = {}
    loads = []
    for r in range(rounds):
        for name in ("eager", "graphs") if r % 2 == 0 else ("graphs", "eager"):
            seconds, tokens[name] = decode_round(llms[name], prompts, params, f"r{r}")
            steps[name].append(seconds * 1e3)
        loads.append(os.getloadavg()[0])
    print(
        f"## batch {batch}: {model} {dtype}, context ~{context}, {num_tokens} tokens, {rounds} rounds, "
        f"{torch.get_num_threads()} threads, load average {min(loads):.1f}-{max(loads):.1f}, "
        f"graphs startup {startup:.1f} s"
    )
    print()
    print("| mode | step ms min / median | tok/s (max / median) |")
    print("|---|---:|---:|")
    for name, values in steps.items():
        low, mid = min(values), statistics.median(values)
        print(f"| {name} | {low:.2f} / {mid:.2f} | {batch * 1e3 / low:.1f} / {batch * 1e3 / mid:.1f} |")
    ratio_min = min(steps["eager"]) / min(steps["graphs"])
    ratio_med = statistics.median(steps["eager"]) / statistics.median(steps["graphs"])
    print()
    print(
        f"graphs speed-up (eager step / graphs step): {ratio_min:.3f}x min, {ratio_med:.3f}x median; "
        f"identical greedy tokens: {tokens['graphs'] == tokens['eager']}"
    )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="zoo/smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    for batch in args.batch:
        run(args.model, args.dtype, batch, args.rounds, args.tokens, args.context)


if __name__ == "__main__":
    main()
