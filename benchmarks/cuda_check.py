"""Run the kernel tests' comparisons on a CUDA GPU: the `cuda` backend (tensors on the GPU) against the
`reference` backend (on the CPU) for every linear case x dtype x M, paged attention (block 16 / 128, fp8
cache, mixed batch), fp8 cache writes and MoE; CUDA graphs (`enforce_eager=False`) against eager greedy tokens
on tiny-llama; then times a 4096 x 4096 linear per scheme against dense bf16. Prints tables; exits 1 if any
comparison fails. Needs no GPU-specific test setup; well under 2 minutes.

    python benchmarks/cuda_check.py
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_kernels import (  # noqa: E402  (the tests' own cases and helpers)
    DECODE_BATCH,
    FP8,
    LINEAR_CASES,
    MIXED_BATCH,
    NUM_ROWS,
    build_paged_batch,
    make_experts,
    make_weights,
    rel_error,
)

from ascq.kernels import QuantLinearWeights, get_backend  # noqa: E402

BATCHES = {"mixed": MIXED_BATCH, "decode": DECODE_BATCH}
DEVICE = torch.device("cuda")  # --device cpu dry-runs the script itself on a machine without a GPU
failures: list[str] = []


def to_device(w: QuantLinearWeights) -> QuantLinearWeights:
    moved = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}
    return QuantLinearWeights(**{k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in moved.items()})


def check(name: str, error: float, tolerance: float) -> None:
    status = "ok" if error < tolerance else "FAIL"
    if status == "FAIL":
        failures.append(name)
    print(f"| {name} | {error:.2e} | {tolerance:.0e} | {status} |")


def check_linears(ref, cuda) -> None:
    for case in LINEAR_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            try:
                check_linear(ref, cuda, case, dtype)
            except Exception as exc:
                failures.append(f"linear {case} {dtype}")
                print(f"| linear {case} {dtype} | raised {type(exc).__name__}: {str(exc)[:200]} | - | FAIL |")


def check_linear(ref, cuda, case, dtype) -> None:
    scheme, out_features, in_features, group_size, symmetric = case
    w = make_weights(scheme, out_features, in_features, group_size, symmetric)
    if scheme == "dense":
        w.weight = w.weight.to(dtype)
    prepared = cuda.prepare_linear(to_device(w), dtype)
    prepared_ref = ref.prepare_linear(w, dtype)
    errors = []
    for num_rows in NUM_ROWS:
        x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows)).to(dtype)
        y = cuda.linear(x.to(DEVICE), prepared).cpu()
        errors.append(rel_error(y, ref.linear(x, prepared_ref)))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    label = f"linear {scheme} {out_features}x{in_features} g{group_size} {dtype} [{prepared.kernel}]"
    check(label, max(errors), tolerance)


def check_attention(ref, cuda) -> None:
    num_heads, num_kv_heads, head_dim, scale = 8, 2, 32, 32**-0.5
    for (batch_name, batch), block_size in itertools.product(BATCHES.items(), (16, 128)):
        for dtype in (torch.float32, torch.bfloat16):
            for kv in ("same", "fp8"):
                k_scale, v_scale = (0.5, 0.25) if kv == "fp8" else (1.0, 1.0)
                cache_dtype = FP8 if kv == "fp8" else dtype
                k_cache, v_cache, tables, _, _ = build_paged_batch(
                    ref, batch, block_size, num_kv_heads, head_dim, cache_dtype, k_scale, v_scale
                )
                query_lens = [q for q, _ in batch]
                query = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
                starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
                seq_lens = torch.tensor([n for _, n in batch], dtype=torch.int32)
                expected = ref.paged_attention(
                    query, k_cache, v_cache, tables, starts, seq_lens, scale, k_scale, v_scale
                )
                on_gpu = [t.to(DEVICE) for t in (query, k_cache, v_cache, tables, starts, seq_lens)]
                out = cuda.paged_attention(*on_gpu, scale, k_scale, v_scale).cpu()
                tolerance = 1e-4 if dtype == torch.float32 else 2e-2
                check(
                    f"paged_attention {batch_name} block {block_size} {dtype} kv {kv}",
                    rel_error(out, expected),
                    tolerance,
                )


def check_fp8_write(ref, cuda) -> None:
    caches = {}
    for name, backend, device in (("ref", ref, "cpu"), ("cuda", cuda, DEVICE)):
        k_cache = torch.zeros(4, 16, 2, 8, dtype=FP8, device=device)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0)) * 100
        value = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
        slots = torch.tensor([5, 16, 63])
        backend.write_kv_cache(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), 0.1, 2.0)
        caches[name] = torch.cat([k_cache.cpu().view(torch.uint8), v_cache.cpu().view(torch.uint8)])
    check("fp8 write_kv_cache bytes", float((caches["ref"] != caches["cuda"]).sum()), 0.5)


def check_moe(ref, cuda) -> None:
    for scheme in ("dense", "w4a16", "w8a16", "w8a8_dynamic", "w4a8_dynamic"):
        for dtype in (torch.float32, torch.bfloat16):
            gate, up, down = make_experts(scheme, 16, 256, 128, group_size=128 if scheme == "w4a16" else None)
            if scheme == "dense":
                for w in gate + up + down:
                    w.weight = w.weight.to(dtype)
            x = torch.randn(37, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
            weights, ids = ref.select_experts(torch.randn(37, 16), 4, renormalize=False)
            expected = ref.moe_experts(x, weights, ids, ref.prepare_experts(gate, up, down, dtype))
            prepared = cuda.prepare_experts(*([to_device(w) for w in ws] for ws in (gate, up, down)), dtype)
            y = cuda.moe_experts(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), prepared).cpu()
            tolerance = {
                torch.float32: 1e-4 if scheme in ("dense", "w4a16", "w8a16") else 2e-3,
                torch.bfloat16: 3e-2,
            }
            check(f"moe {scheme} {dtype}", rel_error(y, expected), tolerance[dtype])


def check_decode_graphs(ref, cuda) -> None:
    """runtime/device_graphs.py's CUDA graphs vs eager: tiny-llama's greedy tokens over decode batches 6..1
    (capture sizes 1, 2, 4, 6: batches 3 and 5 replay padded). The test suite runs this code only on the NPU
    emulator."""
    if DEVICE.type != "cuda":
        print("| decode graphs vs eager | skipped: needs a CUDA device | - | - |")
        return
    from test_device_graphs import PROMPTS, greedy_tokens

    from ascq import LLM
    from ascq.paths import PROJECT_DIR

    def engine(enforce_eager: bool) -> LLM:
        return LLM(
            str(PROJECT_DIR / "zoo" / "tiny-llama"),
            device=str(DEVICE),
            dtype="bfloat16",
            max_num_seqs=len(PROMPTS),
            kv_cache_memory=64 << 20,
            enforce_eager=enforce_eager,
        )

    llm = engine(enforce_eager=False)
    graphs = llm.engine.runner.device_graphs
    assert graphs is not None, "enforce_eager=False captured no CUDA graphs"
    run, replayed = graphs.run, []

    def counted(input_ids: torch.Tensor, *args) -> torch.Tensor | None:
        hidden = run(input_ids, *args)
        replayed.append(hidden is not None)
        return hidden

    graphs.run = counted
    tokens = {False: greedy_tokens(llm), True: greedy_tokens(engine(enforce_eager=True))}
    assert any(replayed), "no decode step replayed the CUDA graphs"
    differing = sum(a != b for a, b in zip(tokens[False], tokens[True], strict=True))
    check(f"decode graphs vs eager: greedy sequences differing (of {len(PROMPTS)})", differing, 0.5)


def time_linears(cuda) -> None:
    size = 4096
    print("\n| scheme | kernel | M=1 ms | M=32 ms | M=512 ms | dense bf16 M=1 / scheme M=1 |")
    print("|---|---|---|---|---|---|")
    dense = None
    for scheme in ("dense", "w4a16", "w8a16", "w8a8_dynamic", "w4a8_dynamic"):
        w = make_weights(scheme, size, size, 128 if scheme == "w4a16" else None, bias=False)
        if scheme == "dense":
            w.weight = w.weight.bfloat16()
        prepared = cuda.prepare_linear(to_device(w), torch.bfloat16)
        times = []
        for num_rows in (1, 32, 512):
            x = torch.randn(num_rows, size, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(3):
                cuda.linear(x, prepared)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                cuda.linear(x, prepared)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 20)
        dense = dense or times[0]
        print(
            f"| {scheme} | {prepared.kernel} | {times[0]:.3f} | {times[1]:.3f} | {times[2]:.3f} | "
            f"{dense / times[0]:.2f} |"
        )


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    DEVICE = torch.device(parser.parse_args().device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine (or --device cpu to dry-run)")
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"# cuda backend vs reference on {name} (torch {torch.__version__})\n")
    print("| check | rel. error | tolerance | status |")
    print("|---|---|---|---|")
    ref, cuda = get_backend("reference"), get_backend("cuda")
    for step in (check_linears, check_attention, check_fp8_write, check_moe, check_decode_graphs):
        try:
            step(ref, cuda)
        except Exception as exc:  # report and keep going: the table is the deliverable
            failures.append(step.__name__)
            print(f"| {step.__name__} | raised {type(exc).__name__}: {str(exc)[:200]} | - | FAIL |")
    try:
        if DEVICE.type == "cuda":
            time_linears(cuda)
    except Exception as exc:
        failures.append("time_linears")
        print(f"time_linears raised {type(exc).__name__}: {str(exc)[:300]}")
    print(f"\n{len(failures)} failed: {', '.join(failures)}" if failures else "\nall checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
