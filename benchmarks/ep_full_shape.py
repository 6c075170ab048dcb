"""Expert parallel at real shape (issue 36, item 6): DeepSeek-MoE-16B, dummy awq-int4 weights (fixed seed),
greedy tokens of one process against `--tensor-parallel-size 2 --enable-expert-parallel` on this host, and
each rank's RSS once loaded.

    OMP_NUM_THREADS=2 python benchmarks/ep_full_shape.py [--model zoo/deepseek-moe-16b] [--json out.json]

The two engines run one after the other (both at once would not fit 24 GiB). The prompts are token ids
(dummy weights: the text would be noise anyway).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import psutil

from ascq import LLM, SamplingParams

PROMPTS = [[100 + 37 * i + 11 * j for j in range(5 + 3 * i)] for i in range(4)]


def run(model: str, recipe: str, num_tokens: int, **parallel) -> dict:
    started = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    kwargs = {"load_format": "dummy", "quantization": recipe, "seed": 0, "max_model_len": 512}
    with LLM(model, kv_cache_memory=256 << 20, **kwargs, **parallel) as llm:
        load_s = time.monotonic() - started
        ranks = [psutil.Process(), *psutil.Process().children(recursive=True)]
        rss = {p.pid: p.memory_info().rss for p in ranks if "resource_tracker" not in " ".join(p.cmdline())}
        started = time.monotonic()
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        generate_s = time.monotonic() - started
    return {
        "parallel": parallel,
        "load_s": round(load_s, 1),
        "generate_s": round(generate_s, 1),
        "rss_gib_per_process": [round(v / 2**30, 2) for v in rss.values()],
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo/deepseek-moe-16b")
    parser.add_argument("--recipe", default="awq-int4")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    single = run(args.model, args.recipe, args.tokens)
    expert_parallel = run(
        args.model, args.recipe, args.tokens, tensor_parallel_size=2, enable_expert_parallel=True
    )
    result = {
        "single": single,
        "tp2_ep": expert_parallel,
        "identical_tokens": single["tokens"] == expert_parallel["tokens"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
