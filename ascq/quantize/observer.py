"""Weight observers (llm-compressor's): the (min, max) range of each weight group a recipe's `observer` picks
— minmax, or the MSE search over shrunk ranges (on the native kernel where it is built) — and round-to-nearest
weight quantization from those ranges. The grid math itself is `ascq.core.qmath`."""

from __future__ import annotations

import dataclasses

import torch
from compressed_tensors.quantization import QuantizationArgs

from ascq.core import qmath
from ascq.kernels import native


@dataclasses.dataclass(frozen=True)
class MinMaxGrid:
    """A weight's fake quantization when it is min-max round-to-nearest per group or channel with integer zero
    points, run by the native kernel (group_fake_quant.c): `fake_quantize_weight` and AWQ's searches."""

    group_len: int  # the row's length when per channel
    q_range: tuple[int, int]
    symmetric: bool
    scale_dtype: torch.dtype

    def fake_quantize(self, w: torch.Tensor, col_scales: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 w [out, in] -> fp32 Q(w), or Q(w · s) / s with `col_scales` s [in]."""
        return native.group_fake_quant(
            w, self.group_len, self.q_range, self.symmetric, self.scale_dtype, col_scales
        )


MINMAX_OBSERVERS = (None, "minmax", "memoryless_minmax", "static_minmax")  # the same ranges for a weight
WEIGHT_OBSERVERS = (*MINMAX_OBSERVERS[1:], "mse")
# llm-compressor's MovingAverageMSEObserver defaults
MSE_DEFAULTS = {
    "maxshrink": 0.2,
    "grid": 100.0,
    "norm": 2.4,
}


def weight_ranges(
    grouped: torch.Tensor,
    args: QuantizationArgs,
    scale_dtype: torch.dtype,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) per group of `grouped` [..., group_len] as the weight observer says: the extremes (minmax),
    or for `observer: mse` the extremes shrunk by the factor 1 - i/grid, i = 0 .. maxshrink·grid, whose
    quantization error Σ|q - w|^norm is smallest per group (llm-compressor's MSE observer and its defaults,
    `observer_kwargs` maxshrink / grid / norm; every step is tried, without its early stop). `importance`
    (broadcast against `grouped`, mse only) weights each element's error: Σ importance·|q - w|^norm (GPTQ's
    diag(H), see `gptq_modifier`)."""
    low, high = grouped.amin(-1), grouped.amax(-1)
    if args.observer in MINMAX_OBSERVERS:
        if importance is not None:
            raise ValueError("weight_ranges: importance weights only the mse observer's error")
        return low, high
    options = {**MSE_DEFAULTS, **(args.observer_kwargs or {})}
    steps = int(options["maxshrink"] * options["grid"]) + 1
    shrinks = torch.tensor([1 - step / options["grid"] for step in range(steps)], dtype=torch.float32)
    flat = grouped.float().reshape(-1, grouped.shape[-1]).contiguous()
    low, high = low.float().reshape(-1, 1), high.float().reshape(-1, 1)
    # [groups, steps]
    scale, zero = qmath.compute_qparams(
        low * shrinks,
        high * shrinks,
        args.num_bits,
        args.symmetric,
        scale_dtype,
        qmath.zero_point_dtype(args),
    )
    zero = None if args.symmetric else zero.float()
    if importance is not None:
        importance = importance.float().expand(grouped.shape).reshape(flat.shape).contiguous()
    if native.available():
        errors = native.group_quant_errors(
            flat,
            scale.float().contiguous(),
            zero,
            qmath.int_range(args.num_bits),
            options["norm"],
            importance,
        )
    else:
        errors = _group_quant_errors(flat, scale, zero, args.num_bits, options["norm"], importance)
    # the first of equal errors
    best = shrinks[torch.nan_to_num(errors, nan=float("inf")).argmin(-1)][:, None]
    return (low * best).view(grouped.shape[:-1]), (high * best).view(grouped.shape[:-1])


MSE_CHUNK_ELEMENTS = 1 << 17


def _group_quant_errors(
    flat: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    num_bits: int,
    norm: float,
    importance: torch.Tensor | None = None,
) -> torch.Tensor:
    """`native.group_quant_errors` in torch ops (hosts without the native kernels): Σ importance ·
    |dequantize( quantize(x)) - x|^norm [groups, candidates], a chunk of groups at a time through every
    candidate while it is in cache."""
    errors = torch.empty(scale.shape, dtype=torch.float32)
    rows_per_chunk = max(1, MSE_CHUNK_ELEMENTS // flat.shape[1])
    for first in range(0, flat.shape[0], rows_per_chunk):
        chunk = slice(first, first + rows_per_chunk)
        buffer = torch.empty_like(flat[chunk])
        for c in range(scale.shape[1]):
            values = qmath.grid_values(
                flat[chunk],
                scale[chunk, c, None],
                None if zero is None else zero[chunk, c, None],
                num_bits,
                out=buffer,
            )
            error = (
                qmath.dequantize_into(
                    values, scale[chunk, c, None], None if zero is None else zero[chunk, c, None]
                )
                .sub_(flat[chunk])
                .abs_()
                .pow_(norm)
            )
            errors[chunk, c] = (error if importance is None else error.mul_(importance[chunk])).sum(-1)
    return errors


def weight_qparams(
    w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) of a weight from its observer's ranges (`weight_ranges`): shape [1], [out, 1] or
    [out, in // group_size]."""
    grouped = qmath.to_groups(w.float(), str(args.strategy), args.group_size)
    scale, zero_point = qmath.compute_qparams(
        *weight_ranges(grouped, args, scale_dtype),
        args.num_bits,
        args.symmetric,
        scale_dtype,
        qmath.zero_point_dtype(args),
    )
    if args.strategy == "tensor":
        return scale.reshape(1), zero_point.reshape(1)
    return scale, zero_point


def quantize_weight(
    w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest: (q int8 [out, in], scale, zero_point or None when symmetric)."""
    scale, zero_point = weight_qparams(w, args, scale_dtype)
    zero_point = None if args.symmetric else zero_point
    return qmath.quantize_with_qparams(w, scale, zero_point, args), scale, zero_point


def fake_quantize_weight(
    w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    grid = minmax_grid(w, args, scale_dtype)
    if grid is not None:
        return grid.fake_quantize(w.float()).to(w.dtype)
    q, scale, zero_point = quantize_weight(w, args, scale_dtype)
    return qmath.dequantize_weight(q, scale, zero_point, args).to(w.dtype)


def minmax_grid(w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype) -> MinMaxGrid | None:
    """`fake_quantize_weight`'s grid where group_fake_quant.c computes it (None elsewhere)."""
    if not _native_fake_quant(w, args, scale_dtype):
        return None
    group_len = args.group_size if str(args.strategy) == "group" else w.shape[1]
    if w.shape[1] % group_len:
        return None
    return MinMaxGrid(group_len, qmath.int_range(args.num_bits), bool(args.symmetric), scale_dtype)


def _native_fake_quant(w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype) -> bool:
    """Whether group_fake_quant.c computes this fake quantization (the same values, one pass per group)."""
    return (
        native.available()
        and args.type == "int"
        and args.observer in MINMAX_OBSERVERS
        and str(args.strategy) in ("group", "channel")
        and qmath.zero_point_dtype(args) is None
        and scale_dtype in native.SCALE_KINDS
        and w.dim() == 2
    )
