"""What rounding activations to 8 bits costs in quality: served perplexity of 4-bit entries through the
CPU runtime (prefill products of 2+ rows, where the 8-bit activation kernel applies) with
ASCQ_W4_ACTIVATION_BITS=8 (the default) against 16, in one run, on the same windows of real text.

Eval text: `/usr/share/common-licenses/GPL-3` (as benchmarks/smollm2_quality.py), non-overlapping windows
of `--window` tokens; perplexity from the runtime's `prompt_logprobs` (vLLM's SamplingParams field), so the
numbers are those of the served kernels, not of the reference backend.

    OMP_NUM_THREADS=2 python benchmarks/activation_bits_quality.py --model zoo/smollm2-135m-instruct \
        --model ENTRY_AWQ [--window 512 --max-windows 16]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

from ascq import LLM, SamplingParams
from ascq.evaluate import eval_windows, load_eval_token_ids

EVAL_TEXT = Path("/usr/share/common-licenses/GPL-3")


def served_perplexity(model: str, window: int, max_windows: int) -> float:
    """exp(mean negative log-likelihood) of every window token after the first, as the runtime serves it."""
    ids = load_eval_token_ids(model, EVAL_TEXT)
    windows = eval_windows(ids, window)[:max_windows].tolist()
    with LLM(model, max_model_len=window + 8) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = llm.generate(windows, params)
    total_nll, num_predicted = 0.0, 0
    for tokens, output in zip(windows, outputs, strict=True):
        for token, logprobs in zip(tokens[1:], output.prompt_logprobs[1:], strict=True):
            total_nll -= logprobs[token]
            num_predicted += 1
    return math.exp(total_nll / num_predicted)


def perplexity_with_bits(model: str, bits: int, args: argparse.Namespace) -> float:
    """served_perplexity in a process of its own whose environment sets the activation bits (the cpu backend
    reads them once, at import)."""
    env = {**os.environ, "ASCQ_W4_ACTIVATION_BITS": str(bits)}
    cmd = [sys.executable, __file__, "--one", model, str(args.window), str(args.max_windows)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(served_perplexity(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="an entry (repeatable)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=16)
    args = parser.parse_args()
    print("| entry | ppl, 16-bit activations | ppl, 8-bit activations | change |\n|---|---:|---:|---:|")
    for model in args.model:
        ppl16, ppl8 = (perplexity_with_bits(model, bits, args) for bits in (16, 8))
        print(f"| {model} | {ppl16:.4f} | {ppl8:.4f} | {100 * (ppl8 / ppl16 - 1):+.3f} % |", flush=True)


if __name__ == "__main__":
    main()
