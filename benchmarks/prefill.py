"""Prefill: ascq's engine (chunked prefill, paged KV cache) vs transformers' forward on the same prompt,
alternating.

ascq: one request with `max_tokens=1` through `LLMEngine` (prefill chunks of `--chunk` tokens, then the LM
head of the last token); transformers: `model(input_ids)` with its KV cache (the logits of every position, as
HF computes them). Same model, dtype and thread count; prefix caching off so every round recomputes. Prints
the per-round times and the min / median ratio.

    OMP_NUM_THREADS=1 python benchmarks/prefill.py --model zoo/smollm2-135m-instruct --prompt-len 512 \\
        --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="zoo/smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=2048, help="ascq max_num_batched_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from ascq import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
        kv_cache_memory=256 << 20,
    )
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    prompt = torch.randint(100, 4000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt[:16]], params)
    times: dict[str, list[float]] = {"ascq": [], "transformers": []}
    for r in range(args.rounds):
        start = time.perf_counter()
        llm.generate([prompt], params)
        times["ascq"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.inference_mode():
            hf(torch.tensor([prompt]))
        times["transformers"].append(time.perf_counter() - start)
        print(
            f"round {r + 1}: ascq {times['ascq'][-1] * 1e3:.0f} ms, transformers "
            f"{times['transformers'][-1] * 1e3:.0f} ms",
            flush=True,
        )
    ratios = [h / a for a, h in zip(times["ascq"], times["transformers"], strict=True)]
    print(
        f"prefill {args.prompt_len} tokens, chunk {args.chunk}, {args.dtype}, {torch.get_num_threads()} "
        f"threads: "
        f"ascq speed vs transformers min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
