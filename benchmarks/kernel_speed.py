"""Quantized linear micro-benchmark: one out x in layer (default 4096 x 4096), per scheme x M, in one run: the
`cpu` backend (and each of its kernel paths, to justify the per-M thresholds in ascq/kernels/cpu.py), the
`reference` backend, and dense bf16 / fp32 F.linear as baselines. Prints a markdown table (ms, best of
interleaved rounds) and the speedup of the cpu backend over dense bf16 F.linear. "16-bit activations": w4a16
on the native kernel with ASCQ_W4_ACTIVATION_BITS=16 (the cpu backend's default rounds them to 8 bits from 2
rows).

    OMP_NUM_THREADS=2 python benchmarks/kernel_speed.py [--size 4096] [--rows 1 8 32 128 512] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from ascq.kernels import WEIGHT_BITS, QuantLinearWeights, cpu, reference

SCHEMES = ("w4a16", "w8a16", "w8a8_dynamic", "w8a8_static", "w4a8_dynamic")
GROUP_SIZE = {"w4a16": 128}
# thresholds forced off to time a kernel path at every M
FORCE_FAST = {
    "DENSE_BF16_MAX_M": 10**9,
    "INT4PACK_MAX_M": 10**9,
    "NATIVE_MAX_M": 10**9,
    "INT8PACK_MAX_M": 10**9,
    "FBGEMM_SPLIT_MAX_M": 10**9,
}


def interleaved_best_ms(candidates: dict[str, tuple], rounds: int, min_run_time: float) -> dict[str, float]:
    """Fastest per-call time (ms) of each candidate (fn, *args), timed round-robin: on a shared machine, load
    bursts then hit every candidate alike and the minimum over rounds filters them out."""
    timers, numbers = {}, {}
    for name, (fn, *args) in candidates.items():
        fn(*args)  # warm up
        start = time.perf_counter()
        fn(*args)
        numbers[name] = max(1, int(min_run_time / max(time.perf_counter() - start, 1e-6)))
        timers[name] = benchmark.Timer(stmt="fn(*args)", globals={"fn": fn, "args": args})
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = min(best[name], timer.timeit(numbers[name]).mean * 1e3)
    return best


def make_weights(scheme: str, size: int) -> QuantLinearWeights:
    half = 2 ** (WEIGHT_BITS[scheme] - 1)
    group_size = GROUP_SIZE.get(scheme)
    num_groups = 1 if group_size is None else size // group_size
    return QuantLinearWeights(
        scheme,
        torch.randint(-half, half, (size, size), dtype=torch.int8),
        weight_scale=torch.rand(size, num_groups) * 0.01,
        group_size=group_size,
        input_scale=torch.tensor([0.05]) if scheme == "w8a8_static" else None,
    )


def forced_fast_linear(x: torch.Tensor, prepared: cpu.CpuLinear) -> torch.Tensor:
    """cpu.linear with the per-M thresholds switched off: the fast kernel at every M."""
    saved = {name: getattr(cpu, name) for name in FORCE_FAST}
    for name, value in FORCE_FAST.items():
        setattr(cpu, name, value)
    try:
        return cpu.linear(x, prepared)
    finally:
        for name, value in saved.items():
            setattr(cpu, name, value)


def activations_16_bit_linear(x: torch.Tensor, prepared: cpu.CpuLinear) -> torch.Tensor:
    """forced_fast_linear with 4-bit weight-only products on the 16-bit activation kernel at every M."""
    saved = cpu.W4_ACTIVATION_BITS
    cpu.W4_ACTIVATION_BITS = 16
    try:
        return forced_fast_linear(x, prepared)
    finally:
        cpu.W4_ACTIVATION_BITS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--min-run-time", type=float, default=0.1, help="seconds per candidate per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    dense_fp32 = torch.randn(args.size, args.size) * 0.02
    dense_bf16 = dense_fp32.bfloat16()
    print(
        f"# {args.size}x{args.size} linear, {args.dtype} activations, {torch.get_num_threads()} threads, ms "
        f"(best of interleaved rounds)"
    )
    print()
    print(
        "| scheme | M | cpu backend | cpu kernel | fast kernel forced | 16-bit activations | "
        "dequant + fp32 | reference | dense bf16 | dense fp32 | dense bf16 / cpu |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    prepared_dense = cpu.prepare_linear(QuantLinearWeights("dense", dense_bf16), torch.bfloat16)
    for num_rows in args.rows:
        x = torch.randn(num_rows, args.size).to(dtype)
        base = interleaved_best_ms(
            {
                "bf16": (F.linear, x.bfloat16(), dense_bf16),
                "fp32": (F.linear, x.float(), dense_fp32),
                "cpu": (cpu.linear, x.bfloat16(), prepared_dense),
            },
            args.rounds,
            args.min_run_time,
        )
        bf16_ms, fp32_ms = base["bf16"], base["fp32"]
        kernel = "dense-fp32-workspace" if num_rows >= cpu.DENSE_BF16_MAX_M else "dense-bf16"
        print(
            f"| dense bf16 | {num_rows} | {base['cpu']:.2f} | {kernel} | - | - | - | - | {bf16_ms:.2f} | "
            f"{fp32_ms:.2f} | "
            f"{bf16_ms / base['cpu']:.2f} |"
        )
        for scheme in args.schemes:
            w = make_weights(scheme, args.size)
            prepared = cpu.prepare_linear(w, dtype)
            candidates = {
                "cpu": (cpu.linear, x, prepared),
                "dequant": (
                    cpu.linear,
                    x,
                    cpu.CpuLinear("dequant", w, args.size, w.weight, w.weight_scale.float()),
                ),
                "reference": (reference.linear, x, reference.prepare_linear(w, dtype)),
            }
            if prepared.kernel != "dequant":
                candidates["fast"] = (forced_fast_linear, x, prepared)
            if prepared.kernel == "native" and w.num_bits == 4:
                candidates["a16"] = (activations_16_bit_linear, x, prepared)
            ms = interleaved_best_ms(candidates, args.rounds, args.min_run_time)
            print(
                f"| {scheme} | {num_rows} | {ms['cpu']:.2f} | {prepared.kernel} | "
                f"{ms.get('fast', float('nan')):.2f} | {ms.get('a16', float('nan')):.2f} | "
                f"{ms['dequant']:.2f} | {ms['reference']:.2f} | {bf16_ms:.2f} | {fp32_ms:.2f} | "
                f"{bf16_ms / ms['cpu']:.2f} |"
            )


if __name__ == "__main__":
    main()
