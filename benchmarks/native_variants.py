"""The native kernels' builds side by side (`native.VARIANTS`: avx512, avx2) on SmolLM2's shapes, alternating
the builds over rounds; prints min / median microseconds per call and the avx2 / avx512 ratio of medians.

    OMP_NUM_THREADS=2 python benchmarks/native_variants.py --rounds 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import torch

from ascq.kernels import native


def packed(n: int, k: int, group_size: int, gen: torch.Generator) -> native.PackedWeights:
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // group_size, generator=gen)
    zeros = torch.randint(-8, 8, (n, k // group_size), generator=gen).float()
    return native.pack(q, 4, scales, zeros, group_size)


def cases(gen: torch.Generator) -> dict:
    up, down = packed(3072, 576, 32, gen), packed(576, 1536, 32, gen)
    head = torch.randn(49152, 576, generator=gen).bfloat16()
    cache = torch.randn(300, 16, 3, 64, generator=gen).bfloat16()
    query, tables = torch.randn(8, 9, 64, generator=gen), torch.arange(256, dtype=torch.int32).view(8, 32)
    lens = torch.full((8,), 500, dtype=torch.int32)
    x1, x8, x_down = (
        torch.randn(1, 576).bfloat16(),
        torch.randn(8, 576).bfloat16(),
        torch.randn(1, 1536).bfloat16(),
    )
    return {
        "w4a16 3072x576 g32 M=1": lambda lib: native.weight_only_mm(lib, x1, up),
        "w4a16 576x1536 g32 M=1": lambda lib: native.weight_only_mm(lib, x_down, down),
        "w4a16 3072x576 g32 M=8": lambda lib: native.weight_only_mm(lib, x8, up),
        "bf16 49152x576 M=1 (LM head)": lambda lib: native.bf16_mm(lib, x1.float(), head),
        "decode attention 8 seqs x 500": lambda lib: native.paged_decode_attention(
            lib, query, cache, cache, tables, lens, 0.125, 1.0, 1.0
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    lib = native.load()
    if lib is None:
        raise SystemExit(f"no native kernels here: {native.unavailable_reason()}")
    features = native.features_of(lib.ascq_cpu_features())
    builds = {
        v: native._build(shutil.which("cc") or "gcc", v)
        for v, needs in native.VARIANTS.items()
        if set(needs) <= features
    }
    work = cases(torch.Generator().manual_seed(0))
    times = {(c, v): [] for c in work for v in builds}
    for round_index in range(args.rounds):
        order = list(builds.items()) if round_index % 2 == 0 else list(reversed(builds.items()))
        for name, build in order:
            for case, call in work.items():
                for _ in range(5):
                    call(build)
                start = time.perf_counter()
                for _ in range(args.calls):
                    call(build)
                times[(case, name)].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"builds: {', '.join(builds)}; chosen: {native.variant()}; {torch.get_num_threads()} threads")
    for case in work:
        cells = [
            f"{v} {min(times[(case, v)]):.1f} / {statistics.median(times[(case, v)]):.1f} us" for v in builds
        ]
        ratio = ""
        if {"avx2", "avx512"} <= set(builds):
            ratio = (
                f"  avx2/avx512 "
                f"{statistics.median(times[(case, 'avx2')]) / statistics.median(times[(case, 'avx512')]):.2f}"
            )
        print(f"{case:32s} " + "   ".join(cells) + ratio)


if __name__ == "__main__":
    main()
