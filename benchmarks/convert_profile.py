"""Where `ascq convert`'s time goes: exclusive wall seconds per phase, on the first N decoder layers of a
model.

    OMP_NUM_THREADS=2 python benchmarks/convert_profile.py zoo/smollm2-135m-instruct --recipe awq-int4 \
        --num-samples 4 --seq-len 512 --layers 3

The convert runs in this process (into a temporary folder) with timers wrapped around the converter's phases:
(Without the perplexity before/after, `--no-eval`, as `compare_llmcompressor.py` times it.) Loading a layer,
the modifiers' calibration forwards, SmoothQuant's scale math, AWQ's α-grid and clip search, GPTQ's Hessians
and solve, round-to-nearest, writing, installing the quantized weights, the propagation forward. Times are
exclusive (a phase inside another is subtracted from it); "other" is the rest of the convert call. Each
layer's wall time and peak RSS (Linux) come first.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from ascq.quantize import (
    awq,
    awq_modifier,
    convert,
    gptq,
    gptq_modifier,
    layer_context,
    observer,
    pipeline,
    smoothquant,
)
from ascq.quantize.architectures import Architecture
from ascq.quantize.awq_modifier import AWQModifier
from ascq.quantize.quantization_modifier import QuantizationModifier

TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
_STACK: list[list[float]] = []  # [start, child seconds] per active phase


def timed(phase: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _STACK.append([time.perf_counter(), 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            start, child = _STACK.pop()
            elapsed = time.perf_counter() - start
            TOTALS[phase] += elapsed - child
            CALLS[phase] += 1
            if _STACK:
                _STACK[-1][1] += elapsed

    return wrapper


def patch(owner, name: str, phase: str) -> None:
    setattr(owner, name, timed(phase, getattr(owner, name)))


LAYERS: list[tuple[float, float]] = []  # per decoder layer: wall seconds, peak RSS GiB


def peak_rss_per_layer() -> None:
    """Each `convert_layer` call's wall time and peak RSS: Linux resets the process's peak (VmHWM) when "5"
    is written to /proc/self/clear_refs, so each layer's peak is read on its own."""
    convert_layer = pipeline.convert_layer

    def wrapper(*args, **kwargs):
        Path("/proc/self/clear_refs").write_text("5")
        start = time.perf_counter()
        convert_layer(*args, **kwargs)
        hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
        LAYERS.append((time.perf_counter() - start, hwm_kb / 2**20))

    pipeline.convert_layer = wrapper


def install_timers() -> None:
    patch(convert, "load_calibration", "calibration tokens")
    patch(pipeline.CheckpointReader, "get_prefix", "read layer tensors")
    patch(Architecture, "build_layer", "build layer")
    patch(layer_context.LayerContext, "run", "modifier calibration forward")
    patch(layer_context.LayerContext, "observe", "modifier calibration forward (partial)")
    patch(smoothquant.SmoothQuantModifier, "process_layer", "SmoothQuant (excl. forward)")
    patch(AWQModifier, "process_layer", "AWQ other")
    patch(awq, "search_scales", "AWQ alpha grid")
    patch(awq, "search_clip", "AWQ clip search")
    patch(awq_modifier, "replay", "AWQ block replay")
    patch(gptq_modifier.GPTQModifier, "process_layer", "GPTQ other")
    patch(gptq.HessianAccumulator, "add", "GPTQ Hessian accumulation")
    patch(gptq_modifier, "gptq_quantize", "GPTQ solve")
    patch(QuantizationModifier, "process_layer", "QuantizationModifier (RTN, observers)")
    patch(observer, "quantize_weight", "RTN quantize_weight")
    patch(pipeline, "_write_layer", "write layer")
    patch(pipeline, "install_quantized", "install quantized weights")
    patch(pipeline, "_forward_all", "propagation forward")
    patch(pipeline.ShardWriter, "finish", "write: finish shards")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--recipe", nargs="+", default=["w8a8"])
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3, help="convert only the first N decoder layers")
    parser.add_argument("--calibration-dtype", default="auto", help="as ascq convert's")
    args = parser.parse_args()
    install_timers()
    peak_rss_per_layer()
    load_architecture = convert.load_architecture

    def first_layers(model_dir):
        arch = load_architecture(model_dir)
        arch.num_layers = min(args.layers, arch.num_layers)
        return arch

    convert.load_architecture = first_layers
    with tempfile.TemporaryDirectory(prefix="ascq-convert-profile-") as tmp:
        options = convert.ConvertOptions(
            args.model,
            args.recipe,
            out=Path(tmp) / "out",
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            progress=False,
            evaluate=False,
            calibration_dtype=args.calibration_dtype,
        )
        convert.convert = timed("other", convert.convert)
        start = time.perf_counter()
        convert.convert(options)
        total = time.perf_counter() - start
    print(
        f"{' '.join(args.recipe)}, {args.layers} layers, {args.num_samples} x {args.seq_len} tokens, "
        f"{torch.get_num_threads()} threads: {total:.1f} s"
    )
    for index, (seconds, peak_gib) in enumerate(LAYERS):
        print(f"  layer {index}: {seconds:7.1f} s, peak RSS {peak_gib:.2f} GiB")
    for phase, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        print(
            f"  {phase:40} {seconds:8.2f} s {100 * seconds / total:5.1f} %  ({CALLS[phase]} calls, "
            f"{seconds / args.layers:.3f} s/layer)"
        )


if __name__ == "__main__":
    main()
