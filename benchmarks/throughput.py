"""Offline throughput, like `vllm bench throughput`: ascq's engine vs Hugging Face transformers `generate`.

N requests with random token-id prompts and random output lengths (uniform in the given ranges, ignore_eos)
run through `ascq.LLM.generate` (continuous batching, paged KV cache) and through transformers `generate` in
static batches of the same size (left-padded, greedy, each batch decoding to its longest requested output, the
way vLLM's HF baseline does), same model, same dtype, same thread count, in the same run. Reports requests/s
and output tokens/s (requested output tokens / wall time, model loading excluded) and the ratio.

    python benchmarks/throughput.py --model zoo/tiny-llama --num-prompts 256 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(args.seed)
    requests = []
    for _ in range(args.num_prompts):
        input_len = int(torch.randint(args.min_input_len, args.max_input_len + 1, (1,), generator=g))
        output_len = int(torch.randint(args.min_output_len, args.max_output_len + 1, (1,), generator=g))
        requests.append((torch.randint(10, vocab_size, (input_len,), generator=g).tolist(), output_len))
    return requests


def run_ascq(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> float:
    from ascq import LLM, SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )
    llm.generate([requests[0][0]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in requests]
    return elapsed


def run_hf(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> float:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    start = time.perf_counter()
    for i in range(0, len(requests), args.batch_size):
        batch = requests[i : i + args.batch_size]
        width = max(len(p) for p, _ in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, (prompt, _) in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        max_new = max(n for _, n in batch)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert out.shape[1] == width + max_new
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo/tiny-llama")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=16)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="ascq max_num_seqs = HF static batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = json.loads(open(f"{args.model}/config.json").read())
    requests = make_requests(args, config["vocab_size"])
    num_output = sum(n for _, n in requests)
    num_input = sum(len(p) for p, _ in requests)
    print(
        f"{len(requests)} requests, {num_input} prompt tokens, {num_output} output tokens, "
        f"batch {args.batch_size}, {args.dtype}, {torch.get_num_threads()} threads"
    )
    results = {}
    for name, run in (("ascq", run_ascq), ("hf", run_hf)):
        if name == "hf" and args.skip_hf:
            continue
        elapsed = run(args, requests)
        results[name] = {
            "seconds": elapsed,
            "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": num_output / elapsed,
        }
        print(
            f"{name:5s} {elapsed:8.2f} s  {len(requests) / elapsed:7.2f} req/s  {num_output / elapsed:9.1f} "
            f"output tok/s"
        )
    if "hf" in results:
        ratio = results["ascq"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        results["ratio"] = ratio
        print(f"ascq / hf output tokens/s: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
