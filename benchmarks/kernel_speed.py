"""Quantized linear micro-benchmark: one out x in layer (default 4096 x 4096), per scheme x M, in one run: the
`cpu` backend (and each of its kernel paths, to justify the per-M thresholds in ascq/kernels/cpu.py), the
`reference` backend, and dense bf16 / fp32 F.linear as baselines. Prints a markdown table (ms, best of
interleaved rounds) and the speedup of the cpu backend over dense bf16 F.linear. "16-bit activations": w4a16
on the native kernel with ASCQ_W4_ACTIVATION_BITS=16 (the cpu backend's default rounds them to 8 bits from 2
rows); "fbgemm": W8A8 / W4A8 on fbgemm at every M (the cpu backend takes the native int8-activation kernel
below NATIVE_INT8_MAX_M rows). Two dense rows: "dense bf16" (a bf16 engine) and "dense fp32" (an fp32 engine
serving a bf16 checkpoint: the cpu backend keeps the weight in bf16, against fp32 F.linear on the fp32 copy).

    OMP_NUM_THREADS=2 python benchmarks/kernel_speed.py [--size 4096] [--rows 1 8 32 128 512] [--dtype bf16]

The decode paths on SmolLM2's MLP shape (each scheme once with bf16 and once with fp32 activations):

    OMP_NUM_THREADS=2 python benchmarks/kernel_speed.py --out-features 1536 --in-features 576 --rows 1 2 8 \
        --schemes w8a16 w8a8_dynamic w8a8_static w4a16 --dtype bf16 fp32
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
    "NATIVE_INT8_MAX_M": 10**9,
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


def make_weights(scheme: str, out_features: int, in_features: int) -> QuantLinearWeights:
    half = 2 ** (WEIGHT_BITS[scheme] - 1)
    group_size = GROUP_SIZE.get(scheme)
    num_groups = 1 if group_size is None else in_features // group_size
    return QuantLinearWeights(
        scheme,
        torch.randint(-half, half, (out_features, in_features), dtype=torch.int8),
        weight_scale=torch.rand(out_features, num_groups) * 0.01,
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


def fbgemm_linear(x: torch.Tensor, prepared: cpu.CpuLinear) -> torch.Tensor:
    """cpu.linear with W8A8 / W4A8 on fbgemm at every M (the native int8-activation kernel switched off)."""
    saved = cpu.NATIVE_INT8_MAX_M
    cpu.NATIVE_INT8_MAX_M = 0
    try:
        return cpu.linear(x, prepared)
    finally:
        cpu.NATIVE_INT8_MAX_M = saved


def activations_16_bit_linear(x: torch.Tensor, prepared: cpu.CpuLinear) -> torch.Tensor:
    """forced_fast_linear with 4-bit weight-only products on the 16-bit activation kernel at every M."""
    saved = cpu.W4_ACTIVATION_BITS
    cpu.W4_ACTIVATION_BITS = 16
    try:
        return forced_fast_linear(x, prepared)
    finally:
        cpu.W4_ACTIVATION_BITS = saved


def dense_rows(
    x: torch.Tensor, dense_fp32: torch.Tensor, dense_bf16: torch.Tensor, rounds: int, min_run_time: float
) -> tuple[list[str], float]:
    """The dense rows at x's M, and dense bf16 F.linear's time (the last column's baseline)."""
    num_rows = x.shape[0]
    engines = {
        "bf16": cpu.prepare_linear(QuantLinearWeights("dense", dense_bf16), torch.bfloat16),
        "fp32": cpu.prepare_linear(QuantLinearWeights("dense", dense_bf16), torch.float32),
    }
    base = interleaved_best_ms(
        {
            "bf16": (F.linear, x.bfloat16(), dense_bf16),
            "fp32": (F.linear, x.float(), dense_fp32),
            "cpu bf16": (cpu.linear, x.bfloat16(), engines["bf16"]),
            "cpu fp32": (cpu.linear, x.float(), engines["fp32"]),
        },
        rounds,
        min_run_time,
    )
    bf16_ms, fp32_ms = base["bf16"], base["fp32"]
    rows = []
    for engine, prepared in engines.items():
        on_native = prepared.weight.dtype == torch.bfloat16 and num_rows < cpu.DENSE_BF16_MAX_M
        weight = "bf16" if prepared.weight.dtype == torch.bfloat16 else "fp32"
        kernel = f"{weight} weight, " + ("native bf16 kernel" if on_native else "large-M path")
        ms = base[f"cpu {engine}"]
        rows.append(
            f"| dense {engine} | {num_rows} | {ms:.2f} | {kernel} | - | - | - | - | - | {bf16_ms:.2f} | "
            f"{fp32_ms:.2f} | {bf16_ms / ms:.2f} |"
        )
    return rows, bf16_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="out and in features (square)")
    parser.add_argument("--out-features", type=int, help="instead of --size")
    parser.add_argument("--in-features", type=int, help="instead of --size")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], nargs="+", default=["bf16"])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--min-run-time", type=float, default=0.1, help="seconds per candidate per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out_features, in_features = args.out_features or args.size, args.in_features or args.size
    torch.manual_seed(0)
    dense_fp32 = (torch.randn(out_features, in_features) * 0.02).bfloat16().float()  # bf16 checkpoint values
    dense_bf16 = dense_fp32.bfloat16()
    print(
        f"# {out_features}x{in_features} linear, {torch.get_num_threads()} threads, ms (best of interleaved "
        f"rounds)"
    )
    print()
    print(
        "| scheme | M | cpu backend | cpu kernel | fast kernel forced | 16-bit activations | fbgemm | "
        "dequant + fp32 | reference | dense bf16 | dense fp32 | dense bf16 / cpu |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for num_rows in args.rows:
        x = torch.randn(num_rows, in_features)
        rows, bf16_ms = dense_rows(x, dense_fp32, dense_bf16, args.rounds, args.min_run_time)
        print("\n".join(rows))
        for scheme in args.schemes:
            w = make_weights(scheme, out_features, in_features)
            for dtype_name in args.dtype:
                dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
                xd = x.to(dtype)
                prepared = cpu.prepare_linear(w, dtype)
                dequant = cpu.CpuLinear("dequant", w, out_features, w.weight, w.weight_scale.float())
                candidates = {
                    "cpu": (cpu.linear, xd, prepared),
                    "dequant": (cpu.linear, xd, dequant),
                    "reference": (reference.linear, xd, reference.prepare_linear(w, dtype)),
                }
                if prepared.kernel != "dequant":
                    candidates["fast"] = (forced_fast_linear, xd, prepared)
                if prepared.kernel == "native" and w.num_bits == 4:
                    candidates["a16"] = (activations_16_bit_linear, xd, prepared)
                if prepared.kernel == "native_int8":
                    candidates["fbgemm"] = (fbgemm_linear, xd, prepared)
                ms = interleaved_best_ms(candidates, args.rounds, args.min_run_time)
                print(
                    f"| {scheme} ({dtype_name} activations) | {num_rows} | {ms['cpu']:.2f} | "
                    f"{prepared.kernel} | {ms.get('fast', float('nan')):.2f} | "
                    f"{ms.get('a16', float('nan')):.2f} | {ms.get('fbgemm', float('nan')):.2f} | "
                    f"{ms['dequant']:.2f} | {ms['reference']:.2f} | {bf16_ms:.2f} | - | "
                    f"{bf16_ms / ms['cpu']:.2f} |"
                )


if __name__ == "__main__":
    main()
