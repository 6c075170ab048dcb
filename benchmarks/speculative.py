"""Speculative decoding on SmolLM2-135M-Instruct at batch 1: tokens/s without speculation (the anchor) vs
n-gram (prompt lookup) vs a draft model (by default the awq-int4 copy of the target), all greedy, in one run.

Each round runs every prompt once per mode, modes alternating within the round so machine load affects all;
each mode's tokens/s per round = generated tokens / wall time over the round's prompts; the speed-up is the
per-round ratio to the anchor (min / median over rounds reported). Greedy outputs are checked token-identical
to the anchor. Acceptance rate = accepted / proposed tokens; mean acceptance length = tokens emitted per
verification step.

Prompt sets (chat template applied): `edit` — code-editing requests that restate code the answer repeats
(the n-gram proposer's home ground); `chat` — eight general chat prompts.

    OMP_NUM_THREADS=2 python benchmarks/speculative.py --model zoo/smollm2-135m-instruct \\
        --draft /path/to/smollm2-135m-instruct-awq-int4 [--rounds 3] [--max-tokens 96] [--num-prompts N] \\
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ascq import LLM, SamplingParams

CODE = [
    """def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result""",
    """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, item):
        self.counts[item] = self.counts.get(item, 0) + 1

    def most_common(self):
        return max(self.counts, key=self.counts.get)""",
    """def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        key, value = line.strip().split("=")
        config[key] = value
    return config""",
    """def fizzbuzz(n):
    for i in range(1, n + 1):
        if i % 15 == 0:
            print("FizzBuzz")
        elif i % 3 == 0:
            print("Fizz")
        elif i % 5 == 0:
            print("Buzz")
        else:
            print(i)""",
]
EDITS = [
    "Add type hints to every function in this code and return the full code.",
    "Rename the variables to longer descriptive names and return the full code.",
]
PROMPT_SETS = {
    "edit": [f"{edit}\n\n```python\n{code}\n```" for code in CODE for edit in EDITS],
    "chat": [
        "What is the capital of France?",
        "Give me three tips for staying focused while studying.",
        "Explain what a hash table is in two sentences.",
        "Write a haiku about autumn leaves.",
        "How do I boil an egg?",
        "What is the difference between a list and a tuple in Python?",
        "Suggest a name for a small coffee shop.",
        "Why is the sky blue?",
    ],
}


def chat_prompts(llm: LLM, prompts: list[str]) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for p in prompts
    ]


def run_round(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, int, list[list[int]]]:
    """(seconds, generated tokens, outputs) for the prompts one at a time (batch 1)."""
    seconds, tokens, outputs = 0.0, 0, []
    for prompt in prompts:
        start = time.perf_counter()
        [out] = llm.generate(prompt, params)
        seconds += time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
        outputs.append(out.outputs[0].token_ids)
    return seconds, tokens, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", help="draft model entry (default: no draft-model mode)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sets", nargs="+", default=["edit", "chat"], choices=sorted(PROMPT_SETS))
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts of each set")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    k = args.num_speculative_tokens
    modes = {
        "none": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    }
    if args.draft:
        modes["draft"] = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k}
    engines = {
        name: LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_memory=64 << 20,
            max_model_len=1024,
            enable_prefix_caching=False,
            speculative_config=config,
        )
        for name, config in modes.items()
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = {}
    for set_name in args.sets:
        prompts = chat_prompts(engines["none"], PROMPT_SETS[set_name][: args.num_prompts])
        for llm in engines.values():  # warm-up (kernel builds, first-call allocations)
            llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
        before = {name: dict(llm.engine.get_stats()) for name, llm in engines.items()}
        rates: dict[str, list[float]] = {name: [] for name in modes}
        reference, mismatches = None, dict.fromkeys(modes, 0)
        for _ in range(args.rounds):
            for name, llm in engines.items():
                seconds, tokens, outputs = run_round(llm, prompts, params)
                rates[name].append(tokens / seconds)
                if name == "none":
                    reference = outputs
                else:
                    mismatches[name] += sum(a != b for a, b in zip(outputs, reference, strict=True))
        row = {}
        for name, llm in engines.items():
            stats, start = llm.engine.get_stats(), before[name]
            proposed = stats["spec_decode_num_draft_tokens"] - start["spec_decode_num_draft_tokens"]
            accepted = stats["spec_decode_num_accepted_tokens"] - start["spec_decode_num_accepted_tokens"]
            drafts = stats["spec_decode_num_drafts"] - start["spec_decode_num_drafts"]
            ratios = [r / a for r, a in zip(rates[name], rates["none"], strict=True)]
            row[name] = {
                "tok_s_min": min(rates[name]),
                "tok_s_median": statistics.median(rates[name]),
                "speedup_min": min(ratios),
                "speedup_median": statistics.median(ratios),
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "outputs_differing_from_anchor": mismatches[name],
            }
        results[set_name] = row
    print(
        f"model {args.model}, draft {args.draft}, k={k}, batch 1, greedy, max_tokens {args.max_tokens}, "
        f"{args.rounds} rounds"
    )
    print(
        "| prompt set | mode | tok/s (median) | speed-up median (min) | acceptance | mean accepted length | "
        "outputs != anchor |"
    )
    print("|---|---|---|---|---|---|---|")
    for set_name, row in results.items():
        for name, r in row.items():
            acceptance = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
            length = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
            print(
                f"| {set_name} | {name} | {r['tok_s_median']:.1f} | {r['speedup_median']:.2f}x "
                f"({r['speedup_min']:.2f}x) | {acceptance} | {length} | "
                f"{r['outputs_differing_from_anchor']} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
